"""The cli adapter against real programs: streaming, prompts, failures, timeouts and cancellation.

Process groups are checked in /proc. Orphaned grandchildren are reaped by pid 1, which may take
its time, so a group counts as gone once none of its members is alive (zombies are dead already).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import sys
import time
from pathlib import Path

import pydantic
import pytest
from conftest import assert_eventually, every_process_stat, forked_and_frozen

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters.cli import CliAdapter, CliOptions
from iop_node.domain import ExecutionSpec
from iop_wire.errors import IopError

MiB = 1024 * 1024


class RecordingSink:
    """Keeps what the adapter writes."""

    def __init__(self) -> None:
        self.deltas: list[str] = []
        self.completed: list[pb.FinishReason.ValueType] = []
        self.annotations: dict[str, str] = {}

    async def delta(self, text: str) -> None:
        self.deltas.append(text)

    async def output(self, delta: pb.RunDelta) -> None:
        raise AssertionError("the cli adapter writes text only")

    async def complete(
        self,
        finish_reason: pb.FinishReason.ValueType,
        usage: pb.Usage | None = None,
        timings: pb.Timings | None = None,
    ) -> None:
        self.completed.append(finish_reason)

    def annotate(self, key: str, value: str) -> None:
        self.annotations[key] = value

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def _spec(text: str = "hi", deadline: datetime.datetime | None = None) -> ExecutionSpec:
    message = pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text=text)])
    request = pb.RunRequest(run_id="r1", model="m", messages=[message], stream=True)
    return ExecutionSpec(
        request=request,
        adapter="cli",
        target_model="m",
        kind=pb.RUN_KIND_CHAT,
        sampling=pb.Sampling(),
        openai_fields={},
        deadline=deadline,
    )


def _py(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


async def _run(options: CliOptions, spec: ExecutionSpec | None = None) -> RecordingSink:
    sink = RecordingSink()
    await CliAdapter({"m": options}).execute(spec or _spec(), sink)
    return sink


async def _failed(options: CliOptions, spec: ExecutionSpec | None = None) -> tuple[IopError, RecordingSink]:
    sink = RecordingSink()
    with pytest.raises(IopError) as caught:
        await CliAdapter({"m": options}).execute(spec or _spec(), sink)
    return caught.value, sink


def _start(options: CliOptions) -> tuple[asyncio.Task[None], RecordingSink]:
    sink = RecordingSink()
    return asyncio.create_task(CliAdapter({"m": options}).execute(_spec(), sink)), sink


def _live_group_members(pgid: int) -> list[int]:
    """Pids of the processes alive in group ``pgid``."""
    return [pid for pid, fields in every_process_stat() if int(fields[2]) == pgid and fields[0] != "Z"]


def _read_pid(path: Path) -> int | None:
    text = path.read_text() if path.exists() else ""
    return int(text) if text.endswith("\n") else None


async def _pid_of(path: Path, task: asyncio.Task[None]) -> int:
    """The pid the program wrote to ``path``, once it has."""
    await assert_eventually(lambda: _read_pid(path) is not None or task.done())
    pid = _read_pid(path)
    assert pid is not None, task
    return pid


def _reaped(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


async def _assert_gone(pid: int) -> None:
    """The program was reaped, and every process of its group dies (SIGKILL takes effect soon after it is sent)."""
    assert _reaped(pid), "the program is left as a zombie or still runs"
    await assert_eventually(lambda: _live_group_members(pid) == [])


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "go"
    os.mkfifo(path)
    return path


async def _release(fifo: Path) -> None:
    # Opening a FIFO for writing blocks until the program opens it for reading.
    await asyncio.to_thread(fifo.write_text, "go\n")


async def test_stdout_is_streamed_as_it_arrives(fifo: Path) -> None:
    code = "import sys; print('a', end='', flush=True); open(sys.argv[1]).readline(); print('b', end='')"
    task, sink = _start(CliOptions(argv=_py(code, str(fifo))))
    await assert_eventually(lambda: bool(sink.deltas) or task.done())
    assert sink.deltas == ["a"] and not task.done()
    await _release(fifo)
    await task
    assert sink.text == "ab"
    assert sink.completed == [pb.FINISH_REASON_STOP]
    assert sink.annotations == {}


async def test_prompt_on_stdin() -> None:
    sink = await _run(CliOptions(argv=_py("import sys; sys.stdout.write(sys.stdin.read().upper())")))
    assert sink.text == "USER: HI"
    assert sink.completed == [pb.FINISH_REASON_STOP]


async def test_prompt_as_argument_with_stdin_empty() -> None:
    argv = _py("import sys; print(repr(sys.stdin.read()), sys.argv[1:])", "<{prompt}>", "x{prompt}{prompt}", "-v")
    sink = await _run(CliOptions(argv=argv, prompt="arg"), _spec("{0} hi"))
    assert sink.text == "'' ['<user: {0} hi>', 'xuser: {0} hiuser: {0} hi', '-v']\n"


async def test_prompt_with_nul_cannot_be_an_argument() -> None:
    error, _ = await _failed(CliOptions(argv=_py("pass", "{prompt}"), prompt="arg"), _spec("a\0b"))
    assert error.code == pb.ERROR_CODE_INVALID_ARGUMENT


async def test_a_continuation_is_refused_before_the_program_starts(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    spec = _spec()
    spec.request.continuation.text = "so far"
    error, sink = await _failed(CliOptions(argv=_py("import sys; open(sys.argv[1], 'w')", str(marker))), spec)
    assert (error.code, error.param) == (pb.ERROR_CODE_INVALID_ARGUMENT, "continuation")
    assert not marker.exists() and sink.deltas == []


async def test_nonzero_exit_is_a_backend_error_quoting_stderr() -> None:
    code = "import sys; print('partial'); sys.stderr.write('first\\nboom: it broke\\n'); sys.exit(3)"
    error, sink = await _failed(CliOptions(argv=_py(code)))
    assert error.code == pb.ERROR_CODE_BACKEND_ERROR and not error.retryable
    assert "exit code 3" in error.message and error.message.endswith("first | boom: it broke")
    assert sink.annotations == {"stderr_tail": "first\nboom: it broke\n"}
    assert sink.text == "partial\n" and sink.completed == []


async def test_death_by_signal_names_the_signal() -> None:
    error, _ = await _failed(CliOptions(argv=_py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")))
    assert error.code == pb.ERROR_CODE_BACKEND_ERROR and "SIGKILL" in error.message


async def test_missing_or_unexecutable_program(tmp_path: Path) -> None:
    plain_file = tmp_path / "not-a-program"
    plain_file.write_text("#!/bin/sh\n")
    missing = CliOptions(argv=["iop-no-such-program", "x"])
    adapter = CliAdapter(
        {"missing": missing, "plain": CliOptions(argv=[str(plain_file)]), "python": CliOptions(argv=[sys.executable])}
    )
    infos = {info.name: info for info in await adapter.capabilities()}
    assert {name: info.available for name, info in infos.items()} == {"missing": False, "plain": False, "python": True}
    assert list(infos["python"].kinds) == [pb.RUN_KIND_CHAT, pb.RUN_KIND_COMPLETION]
    error, _ = await _failed(missing)
    assert error.code == pb.ERROR_CODE_BACKEND_ERROR and not error.retryable
    assert error.message == "cli program not found: iop-no-such-program"
    error, _ = await _failed(CliOptions(argv=[str(plain_file)]))
    assert error.message == f"cli program not executable: {plain_file}"


async def test_invalid_utf8_is_a_protocol_error_and_stops_the_program(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = (
        "import os, sys, time; open(sys.argv[1], 'w').write(f'{os.getpid()}\\n');"
        "sys.stdout.buffer.write(b'ok\\xff\\xfe'); sys.stdout.flush(); time.sleep(60)"
    )
    error, _ = await _failed(CliOptions(argv=_py(code, str(pid_file))))
    assert error.code == pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR
    assert error.message.startswith("cli program wrote invalid UTF-8")
    pid = _read_pid(pid_file)
    assert pid is not None
    await _assert_gone(pid)


async def test_character_split_across_writes_decodes(fifo: Path) -> None:
    code = (
        "import sys; o = sys.stdout.buffer; o.write(b'caf\\xc3'); o.flush();"
        "open(sys.argv[1]).readline(); o.write(b'\\xa9!')"
    )
    task, sink = _start(CliOptions(argv=_py(code, str(fifo))))
    await assert_eventually(lambda: bool(sink.deltas) or task.done())
    await _release(fifo)
    await task
    assert sink.deltas == ["caf", "é!"]


async def test_timeout_stops_the_whole_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    argv = ["sh", "-c", 'sleep 60 & echo $$ > "$1"; sleep 60; wait', "sh", str(pid_file)]
    error, _ = await _failed(CliOptions(argv=argv, timeout=0.3))
    assert error.code == pb.ERROR_CODE_DEADLINE_EXCEEDED
    pid = _read_pid(pid_file)
    assert pid is not None
    await _assert_gone(pid)


async def test_only_allowed_environment_is_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_SECRET", "x")
    code = "import os; print(os.environ.get('IOP_TEST_SECRET'), os.environ.get('PATH'))"
    sink = await _run(CliOptions(argv=_py(code)))
    assert sink.text == f"None {os.environ['PATH']}\n"
    sink = await _run(CliOptions(argv=_py(code), env=["IOP_TEST_SECRET"]))
    assert sink.text == "x None\n"


async def test_cancel_stops_the_group_promptly(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    argv = ["sh", "-c", 'echo $$ > "$1"; sleep 60 & sleep 60; wait', "sh", str(pid_file)]
    options = CliOptions(argv=argv, kill_grace=10)
    task, _ = _start(options)
    pid = await _pid_of(pid_file, task)
    await assert_eventually(lambda: len(_live_group_members(pid)) == 3)  # sh and both sleeps
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < options.kill_grace  # SIGTERM was enough
    await _assert_gone(pid)


async def test_a_cancel_while_the_program_is_starting_stops_its_whole_group(tmp_path: Path) -> None:
    # The cancel lands inside create_subprocess_exec, after the fork, before its pipes are connected. asyncio
    # then kills only the program and waits for the pipes its children hold: a minute here, before the fix.
    pid_file = tmp_path / "pid"
    argv = ["sh", "-c", 'sleep 600 & echo $$ > "$1"; sleep 600; wait', "sh", str(pid_file)]
    options = CliOptions(argv=argv, kill_grace=10)
    task, _ = _start(options)
    await forked_and_frozen(task, lambda: len(_live_group_members(_read_pid(pid_file) or 0)) == 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(options.kill_grace + 20):  # a bound on a hang, not a timing check
            await task
    pid = _read_pid(pid_file)
    assert pid is not None
    await _assert_gone(pid)


async def test_cancel_kills_a_program_that_ignores_sigterm(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = (
        "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "open(sys.argv[1], 'w').write(f'{os.getpid()}\\n'); print('x', flush=True); time.sleep(60)"
    )
    task, sink = _start(CliOptions(argv=_py(code, str(pid_file)), kill_grace=0.2))
    await assert_eventually(lambda: bool(sink.deltas) or task.done())
    pid = await _pid_of(pid_file, task)
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started >= 0.2
    await _assert_gone(pid)


async def test_children_left_behind_are_killed_when_the_program_exits(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    # The background sleep inherits stdout: without the group kill the run would last a minute.
    argv = ["sh", "-c", 'echo $$ > "$1"; sleep 60 & echo done', "sh", str(pid_file)]
    sink = await _run(CliOptions(argv=argv, timeout=10))
    assert sink.text == "done\n" and sink.completed == [pb.FINISH_REASON_STOP]
    pid = _read_pid(pid_file)
    assert pid is not None
    await _assert_gone(pid)


async def test_large_output_streams_whole_and_stderr_keeps_its_tail() -> None:
    code = "import sys; sys.stdout.write('a€' * 262144); sys.stderr.write('e' * (1 << 20) + 'END')"
    sink = await _run(CliOptions(argv=_py(code), stderr_tail=1000))
    assert sink.text == "a€" * 262144
    assert len(sink.text.encode()) == MiB
    assert sink.annotations["stderr_tail"] == "e" * 997 + "END"


async def test_empty_stderr_tail_keeps_nothing() -> None:
    code = "import sys; sys.stderr.write('noise'); sys.exit(2)"
    error, sink = await _failed(CliOptions(argv=_py(code), stderr_tail=0))
    assert error.message == "cli program failed with exit code 2"
    assert sink.annotations == {}


@pytest.mark.parametrize(
    "fields",
    [
        {"argv": []},
        {"argv": [""]},
        {"argv": ["cat"], "prompt": "arg"},
        {"argv": ["cat"], "shell": True},
        {"argv": ["cat"], "timeout": 0},
        {"argv": ["cat"], "kill_grace": -1},
    ],
)
def test_invalid_options_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        CliOptions.model_validate(fields)


class StalledSink(RecordingSink):
    """A sink whose reader stopped reading: the first delta never returns."""

    async def delta(self, text: str = "", **fields: object) -> None:
        self.deltas.append(text)
        await asyncio.Event().wait()


async def test_cancel_while_the_sink_holds_back_a_flood_of_output(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = (
        "import os, sys\nopen(sys.argv[1], 'w').write(f'{os.getpid()}\\n')\nwhile True: sys.stdout.write('y' * 65536)"
    )
    sink = StalledSink()
    task = asyncio.create_task(CliAdapter({"m": CliOptions(argv=_py(code, str(pid_file)))}).execute(_spec(), sink))
    pid = await _pid_of(pid_file, task)
    await assert_eventually(lambda: bool(sink.deltas))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _assert_gone(pid)
