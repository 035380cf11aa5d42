"""The ``cli`` adapter: runs a configured program per run and streams its stdout as the output.

The program is started without a shell, in a session of its own, so that its process group holds
it and everything it spawns. Every way out of a run stops that whole group: a cancel, a timeout
or output that is not UTF-8 sends SIGTERM, then SIGKILL after ``kill_grace`` seconds; a program
that exits has whatever it left behind killed at once. The last ``stderr_tail`` bytes of stderr
are kept in the run record and quoted when the program fails.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import shutil
import signal
from collections.abc import Mapping
from typing import Literal

import pydantic
import structlog
from structlog.typing import FilteringBoundLogger

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.domain import ExecutionSpec, cannot_count, refuse_continuation
from iop_node.ports import EventSink
from iop_node.uncut import started, to_the_end
from iop_wire.errors import IopError

__all__ = ["CliAdapter", "CliOptions"]

_log = structlog.get_logger("iop.node.cli")
_PLACEHOLDER = "{prompt}"
_READ_SIZE = 64 * 1024
_EXIT_POLL = 0.1  # seconds between looks at whether the program exited
_PIPES_TIMEOUT = 5.0  # seconds the pipes may stay open after the group is killed
_DETAIL_LINES, _DETAIL_CHARS = 3, 500  # how much of stderr an error message quotes


class CliOptions(pydantic.BaseModel):
    """How one model is served by a program."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    argv: list[str] = pydantic.Field(min_length=1)
    """The program and its arguments; never run through a shell."""
    prompt: Literal["stdin", "arg"] = "stdin"
    """Where the prompt goes: written to stdin (then closed), or into each ``{prompt}`` of ``argv``."""
    timeout: float = pydantic.Field(default=300.0, gt=0)
    """Seconds a run may take (the node ends it sooner if its deadline comes first)."""
    env: list[str] = ["PATH", "HOME", "LANG", "LC_ALL", "TZ"]
    """Names of the node's environment variables the program sees; it sees no others."""
    kill_grace: float = pydantic.Field(default=2.0, ge=0)
    """Seconds between SIGTERM and SIGKILL when a run is stopped."""
    stderr_tail: int = pydantic.Field(default=4096, ge=0)
    """Bytes of stderr kept (the last ones)."""
    cwd: str | None = None
    """Working directory of the program; the node's own if None."""

    @pydantic.field_validator("argv")
    @classmethod
    def _names_a_program(cls, argv: list[str]) -> list[str]:
        if not argv[0]:
            raise ValueError("argv[0] must name the program")
        return argv

    @pydantic.model_validator(mode="after")
    def _has_a_place_for_the_prompt(self) -> CliOptions:
        if self.prompt == "arg" and not any(_PLACEHOLDER in item for item in self.argv):
            raise ValueError("prompt 'arg' needs an argv item containing {prompt}")
        return self


class CliAdapter:
    """Serves each model by running its program once per run."""

    name = "cli"

    def __init__(self, models: Mapping[str, CliOptions]) -> None:
        self._models = dict(models)
        self._found = {model: _resolvable(options) for model, options in self._models.items()}

    def available(self, model: str) -> bool:
        """Whether the program was found, as last looked (node.status asks often: no PATH search)."""
        return self._found[model]

    async def aclose(self) -> None:
        """Nothing to release: each run stops its own process group."""

    def served(self, model: str) -> pb.ServedModel | None:
        """None: each run's program is started by the run."""
        return None

    async def start(self) -> None:
        """Nothing to start: each run starts its own program."""

    async def capabilities(self) -> list[pb.ModelInfo]:
        """Every configured model; available while its program can be found (looked up again now)."""
        self._found = {model: _resolvable(options) for model, options in self._models.items()}
        kinds = [pb.RUN_KIND_CHAT, pb.RUN_KIND_COMPLETION]
        return [pb.ModelInfo(name=model, kinds=kinds, available=found) for model, found in self._found.items()]

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> None:
        """Run the model's program for ``spec``, streaming its stdout to ``sink`` as it arrives."""
        refuse_continuation(spec, "the cli adapter runs a program, which cannot be asked to go on from a text")
        _refuse_unsupported(spec)
        options = self._models[spec.request.model]
        run_id = spec.request.run_id
        # Cancelled after the fork, asyncio would kill the program alone and wait for the pipes its children
        # hold open; the program starts to its end instead, and is stopped with its group.
        proc = await started(
            _spawn(options, spec.prompt_text()), lambda started_proc: _stop_started(started_proc, options, sink, run_id)
        )
        log = _log.bind(run_id=run_id, pid=proc.pid)
        log.info("cli_started", program=options.argv[0])
        run = _Run(proc, options, sink, log)
        try:
            code = await run.stream(options.timeout)
        finally:
            await to_the_end(run.close())
        if code != 0:
            raise _failure(code, run.stderr_text())
        await sink.complete(pb.FINISH_REASON_STOP)


async def _stop_started(proc: asyncio.subprocess.Process, options: CliOptions, sink: EventSink, run_id: str) -> None:
    """Stop the program a cancelled run was starting, with its whole group."""
    log = _log.bind(run_id=run_id, pid=proc.pid)
    log.info("cli_stopping", reason="cancelled_while_starting")
    await _Run(proc, options, sink, log).close()


def _refuse_unsupported(spec: ExecutionSpec) -> None:
    """INVALID_ARGUMENT for what a program cannot be asked: to count tokens, to sample from the top k."""
    if spec.kind == pb.RUN_KIND_COUNT_TOKENS:
        raise cannot_count(spec, "it is a program (cli adapter)")
    if spec.sampling.HasField("top_k"):
        message = f"model {spec.request.model!r} (cli adapter) cannot take top_k: its program has no such setting"
        raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, message, param="top_k")


class _Run:
    """One started program: stdout goes to the sink, stderr into a bounded tail."""

    def __init__(
        self, proc: asyncio.subprocess.Process, options: CliOptions, sink: EventSink, log: FilteringBoundLogger
    ) -> None:
        self._proc = proc
        self._options = options
        self._sink = sink
        self._log = log
        self._tail = bytearray()
        self._stderr = asyncio.create_task(self._read_stderr())
        self._leftovers = asyncio.create_task(self._kill_leftovers_on_exit())

    async def stream(self, seconds: float) -> int:
        """Forward stdout until it closes, then return the program's exit code (negative: signal)."""
        try:
            async with asyncio.timeout(seconds) as scope:
                await self._forward_stdout()
                return await self._proc.wait()
        except TimeoutError:
            if not scope.expired():
                raise
            self._log.info("cli_stopping", reason="timeout")
            raise IopError(
                pb.ERROR_CODE_DEADLINE_EXCEEDED, f"cli program did not finish within {seconds:.3g} s", retryable=False
            ) from None
        except asyncio.CancelledError:
            self._log.info("cli_stopping", reason="cancelled")
            raise

    async def _forward_stdout(self) -> None:
        assert self._proc.stdout is not None
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        try:
            while chunk := await self._proc.stdout.read(_READ_SIZE):
                if text := decoder.decode(chunk):
                    await self._sink.delta(text)
            decoder.decode(b"", final=True)  # raises if the output ends inside a character
        except UnicodeDecodeError as exc:
            self._log.info("cli_stopping", reason="invalid_utf8")
            raise IopError(
                pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR, f"cli program wrote invalid UTF-8 on stdout: {exc.reason}"
            ) from exc

    async def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        while chunk := await self._proc.stderr.read(_READ_SIZE):
            self._tail += chunk
            del self._tail[: max(0, len(self._tail) - self._options.stderr_tail)]

    async def _kill_leftovers_on_exit(self) -> None:
        # Children left in the group would keep stdout open, and the run going, after the program is done.
        while self._proc.returncode is None:  # noqa: ASYNC110  exit has no event: wait() also waits for the pipes
            await asyncio.sleep(_EXIT_POLL)
        _signal_group(self._proc.pid, signal.SIGKILL)

    def stderr_text(self) -> str:
        """The kept end of stderr, decoded leniently: it is for people to read."""
        return self._tail.decode("utf-8", errors="replace")

    async def close(self) -> None:
        """Stop the whole process group, wait until its pipes close, and annotate the stderr tail."""
        self._leftovers.cancel()
        # Reading stdout to its end keeps its pipe from pausing, or wait() would never see it close.
        drain = asyncio.create_task(_discard(self._proc.stdout))
        if self._proc.returncode is None:
            await self._terminate()
        _signal_group(self._proc.pid, signal.SIGKILL)
        await self._wait_closed(drain)
        self._log.info("cli_exited", exit_code=self._proc.returncode)
        if self._tail:
            self._sink.annotate("stderr_tail", self.stderr_text())

    async def _terminate(self) -> None:
        _signal_group(self._proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._proc.wait(), self._options.kill_grace)

    async def _wait_closed(self, drain: asyncio.Task[None]) -> None:
        try:
            async with asyncio.timeout(_PIPES_TIMEOUT):
                await asyncio.gather(drain, self._stderr)
                await self._proc.wait()
        except TimeoutError:
            self._log.warning("cli_pipes_held_open", reason="a process outside the group keeps the pipes open")


async def _spawn(options: CliOptions, prompt: str) -> asyncio.subprocess.Process:
    """Start the program in a new session, its prompt on stdin or in its arguments."""
    on_stdin = options.prompt == "stdin"
    argv = options.argv if on_stdin else [item.replace(_PLACEHOLDER, prompt) for item in options.argv]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if on_stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=_child_env(options),
            cwd=options.cwd,
            start_new_session=True,
        )
    except (OSError, ValueError) as exc:
        raise _spawn_error(options, exc) from exc
    if proc.stdin is not None:
        # The pipe's transport flushes and then closes it; a program that never reads cannot block us.
        proc.stdin.write(prompt.encode())
        proc.stdin.close()
    return proc


def _spawn_error(options: CliOptions, exc: OSError | ValueError) -> IopError:
    program = options.argv[0]
    if isinstance(exc, ValueError):  # the only one exec raises: an argument holds a NUL character
        return IopError(pb.ERROR_CODE_INVALID_ARGUMENT, "cli program arguments cannot contain NUL characters")
    if isinstance(exc, FileNotFoundError):
        missing = options.cwd is not None and exc.filename == options.cwd
        message = f"cli working directory not found: {options.cwd}" if missing else f"cli program not found: {program}"
    elif isinstance(exc, PermissionError):
        message = f"cli program not executable: {program}"
    else:
        message = f"cli program could not start: {program}: {exc.strerror}"
    return IopError(pb.ERROR_CODE_BACKEND_ERROR, message, retryable=False)


def _child_env(options: CliOptions) -> dict[str, str]:
    return {name: os.environ[name] for name in options.env if name in os.environ}


def _resolvable(options: CliOptions) -> bool:
    # Resolve as the child will: with its PATH, which may not be the node's.
    path = _child_env(options).get("PATH", os.defpath)
    return shutil.which(options.argv[0], path=path) is not None


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


async def _discard(stream: asyncio.StreamReader | None) -> None:
    while stream is not None and await stream.read(_READ_SIZE):
        pass


def _failure(code: int, stderr: str) -> IopError:
    """The error for a program that ended badly, quoting the end of its stderr."""
    if code < 0:
        what = f"cli program was killed by signal {_signal_name(-code)}"
    else:
        what = f"cli program failed with exit code {code}"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    detail = " | ".join(lines[-_DETAIL_LINES:])[-_DETAIL_CHARS:]
    return IopError(pb.ERROR_CODE_BACKEND_ERROR, f"{what}: {detail}" if detail else what, retryable=False)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
