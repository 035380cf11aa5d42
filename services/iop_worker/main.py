"""``iop worker --config worker.yaml``: keep files and batches, run batch lines, until SIGTERM or SIGINT.

One mTLS listener where edges (and admins) send the file and batch messages; one connection to
the control-plane (role worker) that every line runs through; the job store (SQLite, or
PostgreSQL with ``store.url``). On start, batches left open by a previous run (or by a worker
that died) are picked up: their lines whose leases expired are leased again. SIGTERM stops
taking connections, cancels the lines running here and gives their leases back, so another
worker (or the next start) runs them. Start-up problems end the process with exit code 2 and
one line on stderr naming the setting. ``--ready-file PATH`` is written once it serves (JSON:
pid, port, metrics_port).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import structlog
from prometheus_client import start_http_server

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import EventSink, Handler, IopError, Listener, PeerIdentity, Role
from iop_wire.dialer import KeepConnected, Links
from iop_wire.metrics import expose
from iop_wire.settings import bind_error, run_service, write_ready_file
from iop_worker.batches import Batches
from iop_worker.engine import Engine
from iop_worker.files import Files
from iop_worker.metrics import WorkerMetrics
from iop_worker.settings import Problem, Settings, StartError, load_settings
from iop_worker.store import JobStore
from iop_worker.supervise import first_failure

__all__ = ["run"]

_log = structlog.get_logger("iop.worker")
_ROLES = frozenset({Role.EDGE, Role.ADMIN})


def run(config: Path, *, ready_file: Path | None = None, log_level: str | None = None) -> int:
    """Start the worker described by ``config``; returns the exit code (2 when it cannot start)."""
    return run_service(
        "worker", config, load_settings, lambda settings: _serve(settings, ready_file), log_level=log_level
    )


def open_store(settings: Settings) -> JobStore:
    """The store the settings name: PostgreSQL for ``store.url``, else the SQLite file."""
    if settings.store.url is not None:
        from iop_worker.pg_store import PgJobStore  # noqa: PLC0415 - only a PostgreSQL worker loads asyncpg

        return PgJobStore(settings.store.url)
    from iop_worker.sqlite_store import SqliteJobStore  # noqa: PLC0415 - one of the two

    return SqliteJobStore(settings.store.path)


def _control_plane(settings: Settings) -> Links:
    """The worker's links to its control-plane(s) (role control-plane), each redialed with backoff:
    a line's run goes to one that is up, and a run lost with its connection is tried again."""
    cp = settings.control_plane
    connection = settings.connection.config(heartbeat_interval=settings.heartbeat_interval)
    return Links(
        [KeepConnected(target, backoff=cp.backoff()) for target in cp.targets(settings.tls.config(), connection)]
    )


async def _listen(settings: Settings, handler_for: Callable[[PeerIdentity], Handler]) -> Listener:
    """The listener edges and admins reach; StartError names the setting that cannot be used."""
    connection = settings.connection.config(heartbeat_interval=settings.heartbeat_interval)
    listen = settings.listen.config(settings.tls, connection, _ROLES)
    try:
        return await Listener(listen, handler_for).start()
    except ssl.SSLError as exc:
        raise StartError([Problem("tls", f"OpenSSL cannot use these files: {exc.reason or exc}")]) from None
    except OSError as exc:
        raise bind_error("listen", listen.host, listen.port, exc) from None


async def _refuse_run(request: pb.RunRequest, sink: EventSink) -> None:
    await sink.error(
        IopError(pb.ERROR_CODE_PERMISSION_DENIED, "the worker runs no runs: send them to the control-plane")
    )


def _lower_priority(nice: int | Literal["idle"]) -> None:
    """Batch lines yield the CPU to interactive runs (the control-plane's priority orders runs, not CPU).

    "idle": SCHED_IDLE, where the kernel has it: the worker runs on CPU time nothing else wants,
    and a waking interactive process takes the CPU from it at once; elsewhere nice 19.
    """
    if nice != "idle":
        os.nice(nice)
    elif hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)


async def _opened_store(settings: Settings) -> JobStore:
    """The job store, open; StartError (one line naming ``store``) when it cannot be."""
    store = open_store(settings)
    try:
        await store.open()
    except Exception as exc:  # noqa: BLE001 - OSError or a driver's own errors (sqlite3, asyncpg): one line
        raise StartError([Problem("store", f"cannot open the job store: {exc}")]) from None
    return store


async def _serve(settings: Settings, ready_file: Path | None) -> int:
    _lower_priority(settings.nice)
    metrics = WorkerMetrics()
    expose(metrics.registry)
    store = await _opened_store(settings)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(store.aclose)
        link = _control_plane(settings)
        link.start()
        stack.push_async_callback(link.stop)
        engine = Engine(store, link, settings.batches, metrics, name=settings.worker_id)
        files = Files(store, max_bytes=settings.max_file_bytes)
        stack.push_async_callback(files.aclose)
        sweeper = asyncio.create_task(files.sweep_forever(metrics.part_failures), name="iop-worker-sweep")
        stack.callback(sweeper.cancel)
        batches = Batches(store, settings.batches, files, metrics.part_failures, wake=engine.wake)
        stack.push_async_callback(batches.aclose)
        batches.resume(await store.unfinished_batches())
        messages = {**files.handlers(), **batches.handlers()}

        def handler_for(peer: PeerIdentity) -> Handler:
            return Handler(run=_refuse_run, messages=messages)

        listener = await _listen(settings, handler_for)
        stack.push_async_callback(listener.close, "worker shutting down")
        metrics_port = None
        if settings.metrics_port is not None:
            try:
                server, _ = start_http_server(settings.metrics_port, "127.0.0.1", metrics.registry)
            except OSError as exc:
                raise bind_error("metrics_port", "127.0.0.1", settings.metrics_port, exc) from None
            stack.callback(server.shutdown)
            metrics_port = server.server_port
        engine_task = asyncio.create_task(engine.run_forever(), name="iop-worker-engine")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        _log.info("worker started", port=listener.port, owner=engine.owner, store=type(store).__name__)
        if ready_file is not None:
            write_ready_file(ready_file, port=listener.port, metrics_port=metrics_port)
        try:
            ended = await first_failure(stop.wait(), (engine_task, sweeper))
        finally:
            engine_task.cancel()
            await asyncio.gather(engine_task, return_exceptions=True)
            if ready_file is not None:
                ready_file.unlink(missing_ok=True)  # noqa: ASYNC240 - one unlink while stopping
    _log.info("worker stopped")
    return 0 if ended is None else 1
