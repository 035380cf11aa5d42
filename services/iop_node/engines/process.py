"""A server process of the node's own: started in its own session through an exec shim that
makes it die with the node, its output copied into a rotating log, its pid file, and the clean-up
of what an earlier node left running.

Two ways keep a server from outliving its node. The shim sets ``PR_SET_PDEATHSIG`` (SIGKILL) in
the child before it execs the server (not ``preexec_fn``: the node has threads), so the kernel
kills the server when the node dies, even by SIGKILL. Processes the server started itself
(Ollama's runners) do not inherit that; the pid file (pid, process group, start time, argv) lets
the next node start kill the whole group, checking the start time so that a recycled pid is
never taken for the server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import os
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import structlog

from iop_node.uncut import started

__all__ = [
    "EngineFiles",
    "RotatingLog",
    "ServerProcess",
    "describe_exit",
    "kill_group",
    "kill_leftovers",
    "shimmed",
    "spawn",
]

_log = structlog.get_logger("iop.node.engine")

# argv: SHIM NODE_PID COMMAND...: dies with its parent (SIGKILL), in case it is gone already, then execs.
_SHIM = """\
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # PR_SET_PDEATHSIG
    sys.exit("iop engine shim: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    sys.exit("iop engine shim: the node is gone")
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    sys.exit("iop engine shim: cannot run " + sys.argv[2] + ": " + exc.strerror)
"""
_TAIL_LINES = 40
_TAIL_LINE_CHARS = 400
_READ_CHUNK = 64 * 1024
_EXIT_POLL = 0.05  # seconds between two looks at whether the server exited


def _file_name(model: str) -> str:
    """``model`` as a file name: anything but letters, digits, dot, dash and underscore becomes _,
    and a name so changed gets a short hash of the original (``a/b`` and ``a_b`` stay apart)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", model).lstrip(".")
    if name == model:
        return name
    return f"{name}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class EngineFiles:
    """A served model's files in engines_dir: MODEL.log (+ .1 .. .N), MODEL.PID.pid per running server
    (a reload that replaces a route starts the new server while the old one finishes its runs), and a
    folder MODEL.d/."""

    directory: Path
    model: str

    @property
    def log(self) -> Path:
        return self.directory / f"{_file_name(self.model)}.log"

    def pid_file(self, pid: int) -> Path:
        return self.directory / f"{_file_name(self.model)}.{pid}.pid"

    @property
    def workdir(self) -> Path:
        """The engine's own folder (Ollama's models, by default)."""
        return self.directory / f"{_file_name(self.model)}.d"


class RotatingLog:
    """A log file rotated at ``max_bytes`` (MODEL.log -> .1 -> ... -> .N, the oldest dropped).

    One per file, shared (:meth:`shared`): a replaced route's old and new servers write the same
    MODEL.log, and two handles would rotate it under each other. It never raises on a write: a file
    it cannot write (disk full, folder removed) drops the output, said once, and is opened again at
    the next write, so the server's output is always read (a full pipe would block it)."""

    _open: dict[Path, RotatingLog] = {}  # noqa: RUF012 - the registry of shared logs, by file
    """The logs in use in this process, by file; each with its count of users."""

    def __init__(self, path: Path, *, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._users = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO | None = path.open("ab")
        self._size = self._file.tell()
        self._failing = False

    @classmethod
    def shared(cls, path: Path, *, max_bytes: int, backups: int) -> RotatingLog:
        """The log of ``path`` in use already, or a new one; :meth:`close` once done with it. The newest
        user's bounds hold (a reload that changed them)."""
        key = path.absolute()
        log = cls._open.get(key)
        if log is None:
            log = cls._open[key] = cls(path, max_bytes=max_bytes, backups=backups)
        log.max_bytes, log.backups = max_bytes, backups
        log._users += 1
        return log

    def write(self, data: bytes) -> None:
        """Append ``data``, rotating first when it would pass ``max_bytes`` (a chunk is never split);
        dropped when the file cannot be written."""
        try:
            if self._file is not None and self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
            if self._file is None:
                self._file = self.path.open("ab")
                self._size = self._file.tell()
            self._file.write(data)
            self._file.flush()
            self._size += len(data)
        except OSError as exc:
            self._drop(exc)
            return
        if self._failing:
            self._failing = False
            _log.info("engine log written again", path=str(self.path))

    def _drop(self, exc: OSError) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None  # opened again at the next write
        if not self._failing:
            self._failing = True
            _log.warning("engine log not written", path=str(self.path), error=str(exc), output="dropped until it is")

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        for number in range(self.backups, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{number - 1}") if number > 1 else self.path
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{number}"))
        _log.debug("engine log rotated", path=str(self.path), max_bytes=self.max_bytes, backups=self.backups)

    def close(self) -> None:
        """Done with it: closed once its last user closed it."""
        self._users -= 1
        if self._users > 0:
            return
        if RotatingLog._open.get(key := self.path.absolute()) is self:
            del RotatingLog._open[key]
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


class ServerProcess:
    """A started server: its process, the task copying its output, the last lines of it."""

    def __init__(self, process: asyncio.subprocess.Process, log: RotatingLog, files: EngineFiles) -> None:
        self.process = process
        self.pid = process.pid
        self.files = files
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._log = log
        self._partial = b""  # the server's output after its last newline
        self._noted = b""  # the same for its setup commands' output
        self._swept = False  # killed and reaped: its pid may be another process's by now, never signalled again
        self._copying = asyncio.get_running_loop().create_task(self._copy(), name=f"iop-engine-log-{files.model}")

    async def _copy(self) -> None:
        """Copy the server's output into its log until the pipe closes; keep the last lines. The log
        never raises (it drops what it cannot write), so the pipe is always drained."""
        stdout = self.process.stdout
        assert stdout is not None
        with contextlib.suppress(OSError):
            while chunk := await stdout.read(_READ_CHUNK):
                self._log.write(chunk)
                self._partial = self._keep_lines(self._partial, chunk)

    def _keep_lines(self, partial: bytes, chunk: bytes) -> bytes:
        """Put the lines that ``chunk`` completes into the tail; the rest of a line, to be continued."""
        lines = (partial + chunk).split(b"\n")
        rest = lines.pop()[-_TAIL_LINE_CHARS:]
        self.tail.extend(line.decode(errors="replace").rstrip()[:_TAIL_LINE_CHARS] for line in lines)
        return rest

    def note(self, data: bytes) -> None:
        """Write ``data`` into its log and tail as if it had said it (the output of its setup commands)."""
        self._log.write(data)
        self._noted = self._keep_lines(self._noted, data)

    def last_lines(self, count: int = 5) -> str:
        """The end of its output, for a reason: the last ``count`` lines that are not empty."""
        partial = [rest.decode(errors="replace") for rest in (self._noted, self._partial)]
        lines = [line for line in [*self.tail, *partial] if line.strip()]
        return " | ".join(lines[-count:])

    def signal_group(self, signum: signal.Signals) -> None:
        """Send ``signum`` to its process group (the server and whatever it started)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    async def exited(self) -> int:
        """Its exit status once it exited. Polled: asyncio's ``wait()`` also waits for the output
        pipe to close, which a process the server started (and left running) may hold open."""
        while (status := self.process.returncode) is None:  # noqa: ASYNC110 - no event is set at exit alone
            await asyncio.sleep(_EXIT_POLL)
        return status

    async def wait_output(self, timeout: float = 1.0) -> None:
        """Give the copy task a moment to read what the server wrote before it exited."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._copying), timeout)

    async def stop(self, grace: float) -> int:
        """SIGTERM to its group, SIGKILL after ``grace`` s (and to stragglers); its pid file removed."""
        if self.process.returncode is None:
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.exited(), grace)
        return await self.kill()

    async def kill(self) -> int:
        """SIGKILL its group and the rest of its session now; the exit status once reaped and its output
        read. Removes its pid file. Once done, never again: a reaped leader's pid may be reused."""
        # Its session's members are ours: the kernel gives no process the session's id while it has any.
        if not self._swept:
            reaped = self.process.returncode is not None
            members = self._members(reaped)
            if not reaped:  # a reaped leader's pid is no longer its: the group is reached through its members
                self.signal_group(signal.SIGKILL)
            _kill_each(members)
        status = await self.exited()
        if not self._swept:
            self._swept = True  # before anything else can interleave: never twice
            _kill_each(self._members(reaped=True))  # those started meanwhile
        await self.wait_output()
        self._copying.cancel()
        self.files.pid_file(self.pid).unlink(missing_ok=True)
        return status

    def _members(self, reaped: bool) -> list[int]:
        """The processes of its session; once the leader is reaped, not a process holding the leader's pid
        again (a reused pid is another's)."""
        members = _session_members(self.pid)
        return [pid for pid in members if pid != self.pid] if reaped else members


async def spawn(argv: list[str], *, env: dict[str, str], files: EngineFiles, log: RotatingLog) -> ServerProcess:
    """Start ``argv`` in a session of its own (it leads its process group), through the shim, with
    its output going to ``log``; write its pid file. OSError when the shim cannot start or the pid
    file cannot be written (the process is killed then)."""
    files.workdir.mkdir(parents=True, exist_ok=True)
    process = await start_in_session(
        shimmed(argv),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **env}, cwd=files.workdir,
    )  # fmt: skip
    try:
        record = {
            "pid": process.pid, "pgid": process.pid, "start_time": _start_time(process.pid), "argv": argv,
            "node_pid": os.getpid(), "node_start_time": _start_time(os.getpid()),
        }  # fmt: skip
        files.pid_file(process.pid).write_text(json.dumps(record))
        return ServerProcess(process, log, files)
    except BaseException:  # no pid file (disk full, read-only folder): not left running where nothing sees it
        await asyncio.shield(kill_group(process))
        files.pid_file(process.pid).unlink(missing_ok=True)
        raise


async def start_in_session(argv: list[str], **options: Any) -> asyncio.subprocess.Process:
    """create_subprocess_exec in a session of its own, which a cancel cannot cut in half
    (:func:`iop_node.uncut.started`): cancelled while starting, the group is killed once started."""
    return await started(asyncio.create_subprocess_exec(*argv, start_new_session=True, **options), kill_group)


def shimmed(argv: list[str]) -> list[str]:
    """``argv`` run through the exec shim: it dies with the node (start it in a session of its own)."""
    return [sys.executable, "-c", _SHIM, str(os.getpid()), *argv]


async def kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the process group ``process`` leads; return once it is reaped (not waiting for its pipes,
    which something it started may hold)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    while process.returncode is None:  # noqa: ASYNC110 - no event is set at exit alone
        await asyncio.sleep(_EXIT_POLL)


def describe_exit(status: int) -> str:
    """ "exited with status 1" or "signal 9 (SIGKILL)" from an asyncio return code."""
    if status >= 0:
        return f"exited with status {status}"
    with contextlib.suppress(ValueError):
        return f"signal {-status} ({signal.Signals(-status).name})"
    return f"signal {-status}"


def _stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (0: state, 2: process group, 3: session, 19: start
    time), None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None  # field 22 of stat: start time in clock ticks after boot


def _session_members(session: int) -> list[int]:
    """Pids of the processes in session ``session`` (ours lead their own, so session = group = leader)."""
    pids = [entry.name for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return [int(pid) for pid in pids if (fields := _stat(pid)) and int(fields[3]) == session]


def _kill_each(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` (members of one of our sessions in another process group)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def kill_leftovers(directory: Path) -> int:
    """Kill what a node before this one left running, by the pid files in ``directory``; how many
    servers were killed. A pid whose process started at another time is not ours (recycled). A pid
    file is removed once its server is gone (or unreadable), kept while the node that wrote it runs.
    OSError when the folder cannot be read or cleaned."""
    killed = 0
    for path in sorted(directory.glob("*.pid")) if directory.is_dir() else ():
        if not path.is_file():  # a model's folder named so (model "x.pid"), say
            continue
        record = _read_record(path)
        owner = "gone" if record is None else _owner(record)
        if owner == "running node":
            continue
        if record is not None and owner == "left running":
            members = _session_members(record["pgid"])
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(record["pgid"], signal.SIGKILL)
            _kill_each(members)  # the group's and the rest of the session's
            killed += 1
            _log.warning("engine left running by an earlier node killed", pid=record["pid"], processes=members,
                         argv=record.get("argv"))  # fmt: skip
        path.unlink(missing_ok=True)
    return killed


def _read_record(path: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(path.read_text())
        if isinstance(record, dict) and isinstance(record.get("pid"), int) and isinstance(record.get("pgid"), int):
            return record
    return None


def _owner(record: dict[str, Any]) -> Literal["running node", "left running", "gone"]:
    """Whose the recorded server is: a node that runs still (sharing the folder; it keeps its
    servers), none (left running by a node that is gone: the server, or a process of its session,
    which outlives its leader), or it is gone.

    While the leader's pid is in use its start time must match; once it is gone, the kernel does not
    give its pid to another process while a group or session of that id exists, so members are ours."""
    node = record.get("node_pid")
    if isinstance(node, int) and node != os.getpid():
        node_started = _start_time(node)
        if node_started is not None and node_started == record.get("node_start_time"):
            return "running node"
    started = _start_time(record["pid"])
    if started is not None:
        return "left running" if started == record.get("start_time") else "gone"
    return "left running" if _session_members(record["pgid"]) else "gone"
