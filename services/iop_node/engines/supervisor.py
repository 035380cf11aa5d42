"""One served model's server kept running: started, probed, restarted, given up on, stopped.

    STARTING --ready probe passes--> READY --exits / stops answering--> RESTARTING --backoff--> STARTING
    STARTING --exits, or start_timeout--> RESTARTING (a failed start) ... max_failed_starts in a row --> FAILED
    (READY for less than stable_after, then an exit or a hang, also counts as a failed start)
    any --aclose--> STOPPING (SIGTERM to its group, SIGKILL after stop_grace)

Plain code in one task per served model. Every transition is one log line (``iop.node.engine``),
the ``iop_node_engine_state`` gauge and :attr:`Supervisor.served`, which node.status and the
capabilities carry. FAILED is final until the route is reloaded (a new supervisor).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters.httpclient import HttpClient, HttpError
from iop_node.engines.process import (
    EngineFiles,
    RotatingLog,
    ServerProcess,
    describe_exit,
    kill_group,
    shimmed,
    spawn,
    start_in_session,
)
from iop_node.engines.settings import LOOPBACK, EngineSettings, Launch
from iop_node.metrics import NodeMetrics

__all__ = ["STATE_NAMES", "Supervisor"]

_log = structlog.get_logger("iop.node.engine")

STATE_NAMES = {
    pb.SERVED_STATE_STARTING: "starting",
    pb.SERVED_STATE_READY: "ready",
    pb.SERVED_STATE_RESTARTING: "restarting",
    pb.SERVED_STATE_FAILED: "failed",
    pb.SERVED_STATE_STOPPING: "stopping",
}
_READY_POLL = 0.1  # seconds between two ready probes while starting (a llama.cpp server is ready in ~1 s)
_MAX_PROBE_BODY = 4 * 1024 * 1024  # bytes of a model list read
_REASON_LINES = 5  # log lines in a reason
_READ_CHUNK = 64 * 1024


def _free_port() -> int:
    """A loopback port nothing listens on now; taken meanwhile, the start fails and the next picks again."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def _unlisted(document: Any, model: str) -> str | None:
    """Why a model list (OpenAI ``data[].id``, Ollama ``models[].name``) does not name ``model``; None if it does."""
    entries = None
    if isinstance(document, dict):
        entries = document["data"] if "data" in document else document.get("models")
    if not isinstance(entries, list):
        return "its model list is not an object with a list in data (or models)"
    names = {str(entry.get("id") or entry.get("name")) for entry in entries if isinstance(entry, dict)}
    if model in names or f"{model}:latest" in names:
        return None
    return f"its model list does not name {model}"


class Supervisor:
    """Keeps one served model's server running; :attr:`served` says how it is."""

    def __init__(
        self,
        *,
        model: str,
        engine: str,
        target: str,
        settings: EngineSettings,
        files: EngineFiles,
        metrics: NodeMetrics,
        on_port: Callable[[int], Awaitable[None]],
    ) -> None:
        self.model = model
        self.engine = engine
        self.target = target
        self.settings = settings
        self.files = files
        self.served = pb.ServedModel(engine=engine, state=pb.SERVED_STATE_STARTING)  # said once it starts
        self._metrics = metrics
        self._on_port = on_port
        self._server: ServerProcess | None = None
        self._launch: Launch | None = None
        self._task: asyncio.Task[None] | None = None
        self._log: RotatingLog | None = None
        self._displaced: object = None  # the model's supervisor whose state series this one took over
        self._stopped = False

    @property
    def ready(self) -> bool:
        """READY and its process not seen exited (runs go elsewhere from the moment it is reaped)."""
        server = self._server
        return self.served.state == pb.SERVED_STATE_READY and server is not None and server.process.returncode is None

    def describe(self) -> str:
        """Its state and why, for an error message."""
        name = STATE_NAMES.get(self.served.state, "unknown")
        return f"{name}: {self.served.reason}" if self.served.reason else name

    def start(self) -> None:
        """Start the server in the background (returns at once); once only (RuntimeError after)."""
        if self._task is not None:
            raise RuntimeError(f"the supervisor of {self.model} is started already")
        settings = self.settings
        self._log = RotatingLog.shared(self.files.log, max_bytes=settings.log_max_bytes, backups=settings.log_backups)
        owners = self._metrics.engine_state_owners
        self._displaced = owners.get(self.model)
        owners[self.model] = self  # the newest one routed says the model's state
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"iop-engine-{self.model}")

    async def stop(self) -> None:
        """STOPPING: SIGTERM to the server's group, SIGKILL after stop_grace, its pid file removed."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        server, self._server = self._server, None
        if server is not None and server.process.returncode is None:
            self._set(pb.SERVED_STATE_STOPPING, pid=server.pid)
            status = await server.stop(self.settings.stop_grace)
            _log.info("engine stopped", model=self.model, engine=self.engine, status=describe_exit(status))
        elif server is not None:
            await server.kill()  # reaped already (killed once at most): its output read, its pid file removed
        if self._log is not None:
            self._log.close()
            self._log = None
        self._stopped = True
        owners, displaced = self._metrics.engine_state_owners, self._displaced
        self._displaced = None  # replaced again and again, the stopped ones are not kept alive in a chain
        if owners.get(self.model) is not self:
            return
        if isinstance(displaced, Supervisor) and not displaced._stopped:  # a reload that failed: it serves on
            owners[self.model] = displaced
            displaced._publish()
            return
        del owners[self.model]
        for name in STATE_NAMES.values():  # a removed route leaves no series behind
            with contextlib.suppress(KeyError):
                self._metrics.engine_state.remove(self.model, name)

    async def _run(self) -> None:
        try:
            await self._keep_running()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug or an unusable engines folder: FAILED, said, never quiet
            _log.exception("engine supervisor failed", model=self.model, engine=self.engine)
            server, self._server = self._server, None
            if server is not None:  # not left running where nothing watches it
                with contextlib.suppress(Exception):
                    await server.kill()
            self._set(pb.SERVED_STATE_FAILED, reason=f"the node could not run it: {exc}")

    async def _keep_running(self) -> None:
        served, settings = self.served, self.settings
        while True:
            reason = await self._start_once()
            if reason is None:  # it was ready, then exited or hung
                ready_since = time.monotonic()
                reason, why, lasted_until = await self._watch()
                served.restarts += 1
                # served well for stable_after (up to its exit, or its last answer before a hang): restarted
                # after the first backoff
                if lasted_until - ready_since >= settings.stable_after:
                    served.failed_starts = 0
                else:  # a crash loop: counted as a failed start
                    served.failed_starts += 1
            else:
                served.failed_starts += 1
                why = "start_failed"
            delay = min(settings.backoff * 2 ** max(served.failed_starts - 1, 0), settings.max_backoff)
            self._metrics.engine_restarts.labels(self.model, why).inc()
            if served.failed_starts >= settings.max_failed_starts:
                self._set(pb.SERVED_STATE_FAILED, reason=reason)
                return
            self._set(pb.SERVED_STATE_RESTARTING, reason=reason, backoff=delay)
            await asyncio.sleep(delay)

    async def _start_once(self) -> str | None:
        """Start the server and wait for it to be ready; None when it is, else why not (it is stopped)."""
        port = _free_port()
        launch = self.settings.launch(target=self.target, port=port, workdir=self.files.workdir)
        await self._on_port(port)
        self._launch, self.served.port = launch, port
        self._set(pb.SERVED_STATE_STARTING, pid=0, reason=self.served.reason)  # why the last one ended, kept
        started = time.monotonic()
        assert self._log is not None
        spawning = asyncio.ensure_future(spawn(launch.argv, env=launch.env, files=self.files, log=self._log))
        try:
            self._server = await asyncio.shield(spawning)
        except asyncio.CancelledError:  # stopped while starting: what was started is stopped with it
            with contextlib.suppress(Exception):  # a failed spawn killed its process itself
                self._server = await spawning
            raise
        except OSError as exc:
            return f"cannot start {launch.argv[0]}: {exc}"
        self.served.pid = self._server.pid
        _log.info("engine started", model=self.model, engine=self.engine, pid=self._server.pid, port=port,
                  argv=launch.argv)  # fmt: skip
        reason = await self._until_ready(self._server, launch, started)
        if reason is not None:
            await self._server.kill()
            self._server = None
            return reason
        self._metrics.engine_ready.labels(self.model).observe(time.monotonic() - started)
        self._set(pb.SERVED_STATE_READY, pid=self._server.pid)
        return None

    async def _until_ready(self, server: ServerProcess, launch: Launch, started: float) -> str | None:
        deadline = started + self.settings.start_timeout
        setup = list(launch.setup)
        unready = ""  # why its last answer was not ready
        async with _Prober(self.served.port, self.settings.probe_timeout) as probe:
            while (status := server.process.returncode) is None:
                if time.monotonic() > deadline:
                    _log.warning("engine start timed out", model=self.model, timeout=self.settings.start_timeout)
                    late = f"not ready after {self.settings.start_timeout:g} s"
                    return self._reason(f"{late}: {unready}" if unready else late, server)
                document = await probe.get_json(launch.ready_path)
                if document is not None and setup:
                    if failure := await self._setup(setup.pop(0), launch, server, deadline):
                        return failure
                    continue
                if document is not None:
                    if launch.ready_model is None or not (why := _unlisted(document, launch.ready_model)):
                        return None
                    unready = f"GET {launch.ready_path}: {why}"
                await asyncio.sleep(_READY_POLL)
        await server.wait_output()
        return self._reason(describe_exit(status), server)

    async def _setup(self, command: list[str], launch: Launch, server: ServerProcess, deadline: float) -> str | None:
        """Run one setup command (ollama pull/create) against the started server; why it failed, or None."""
        server.note(f"iop: {' '.join(command)}\n".encode())
        try:  # through the shim, in a group of its own: it dies with the node, is killed with its children
            process = await start_in_session(
                shimmed(command), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env={**os.environ, **launch.env},
            )  # fmt: skip
        except OSError as exc:
            return f"cannot run {command[0]}: {exc}"
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.1)):
                status = await _copied(process, server)
        except TimeoutError:
            return f"{' '.join(command[1:3])} not done within start_timeout ({self.settings.start_timeout:g} s)"
        finally:  # timed out, or the supervisor stopped: not left running
            if process.returncode is None:
                await asyncio.shield(kill_group(process))
        if status:
            return f"{' '.join(command[1:3])} {describe_exit(status)}: {server.last_lines(_REASON_LINES)}"
        return None

    async def _watch(self) -> tuple[str, str, float]:
        """Probe the ready server until it exits or stops answering for hang_timeout; why, the metric's
        reason (exited, hung), and until when it served (its exit, or its last answer before the hang:
        a server hanging soon after each ready is a crash loop however long hang_timeout is). It is
        stopped when this returns."""
        server, launch, settings = self._server, self._launch, self.settings
        assert server is not None and launch is not None
        answered = time.monotonic()
        async with _Prober(self.served.port, settings.probe_timeout) as probe:
            while True:
                with contextlib.suppress(TimeoutError):
                    status = await asyncio.wait_for(server.exited(), settings.probe_interval)
                    await server.kill()  # what it started, killed right after it exited (never later)
                    self._server = None
                    return self._reason(describe_exit(status), server), "exited", time.monotonic()
                if await probe.answers(launch.health_path):
                    answered = time.monotonic()
                elif time.monotonic() - answered >= settings.hang_timeout and server.process.returncode is None:
                    silent = time.monotonic() - answered
                    _log.warning("engine hung: killed", model=self.model, pid=server.pid, silent=round(silent, 1))
                    await server.kill()
                    self._server = None
                    return self._reason(f"stopped answering for {silent:.0f} s", server), "hung", answered

    def _reason(self, what: str, server: ServerProcess) -> str:
        lines = server.last_lines(_REASON_LINES)
        return f"{what}; last log lines: {lines}" if lines else what

    def _set(self, state: pb.ServedState.ValueType, *, reason: str = "", pid: int | None = None, **fields: Any) -> None:
        """Enter ``state``: ServedModel, the state gauge, one log line."""
        served = self.served
        served.state, served.reason = state, reason
        if pid is not None:
            served.pid = pid
        if state in (pb.SERVED_STATE_RESTARTING, pb.SERVED_STATE_FAILED):
            served.pid = 0
        served.since.GetCurrentTime()
        self._publish()
        level = {pb.SERVED_STATE_RESTARTING: "warning", pb.SERVED_STATE_FAILED: "error"}.get(state, "info")
        getattr(_log, level)(
            "engine " + STATE_NAMES[state], model=self.model, engine=self.engine, reason=reason or None,
            pid=served.pid or None, port=served.port or None, restarts=served.restarts,
            failed_starts=served.failed_starts, **fields,
        )  # fmt: skip

    def _publish(self) -> None:
        """Its state into the state gauge, if the model's series are its own."""
        if self._metrics.engine_state_owners.get(self.model) is self:
            for value, name in STATE_NAMES.items():
                self._metrics.engine_state.labels(self.model, name).set(1 if value == self.served.state else 0)


async def _copied(process: asyncio.subprocess.Process, server: ServerProcess) -> int:
    """Copy a setup command's output into the server's log as it comes (a pull's progress is long); its status."""
    assert process.stdout is not None
    while chunk := await process.stdout.read(_READ_CHUNK):
        server.note(chunk)
    return await process.wait()


class _Prober:
    """GET requests to the server on loopback, each bounded by the probe timeout."""

    def __init__(self, port: int, timeout: float) -> None:
        self._client = HttpClient(f"http://{LOOPBACK}:{port}", max_connections=1)
        self._timeout = timeout

    async def __aenter__(self) -> _Prober:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._client.aclose()

    async def _get(self, path: str) -> tuple[int, bytes] | None:
        try:
            async with asyncio.timeout(self._timeout):
                timeout = self._timeout
                async with await self._client.request("GET", path, connect_timeout=timeout, head_timeout=timeout) as r:
                    return r.status, await r.read(_MAX_PROBE_BODY)
        except (HttpError, TimeoutError, OSError):
            return None

    async def answers(self, path: str) -> bool:
        """Whether GET ``path`` got any HTTP answer in time (an error status is an answer: alive)."""
        return await self._get(path) is not None

    async def get_json(self, path: str) -> Any:
        """The JSON body of a 200 answer to GET ``path``; None for anything else."""
        answer = await self._get(path)
        if answer is None or answer[0] != 200:
            return None
        with contextlib.suppress(ValueError, RecursionError):  # RecursionError: nested too deep
            return json.loads(answer[1])
        return None
