"""``iop edge --config edge.yaml``: serve the OpenAI-compatible API until SIGTERM or SIGINT.

uvicorn runs the FastAPI app on uvloop with httptools (HTTP/1.1), on sockets bound here (one per
address of ``http.host``, all on one port) so that a port in use is one line naming it.
Start-up problems end the process with exit code 2 and one line on stderr naming the setting.
``--ready-file PATH`` is written once it serves (JSON: pid, port) and removed when it stops.
SIGTERM ends the console's live streams, stops taking connections, lets requests in progress
finish (uvicorn's graceful shutdown, at most 5 s), then closes the control-plane and worker connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import structlog
import uvicorn

from iop_edge.app import build_app
from iop_edge.edge import Edge
from iop_edge.head import HeadLimits, head_protocol
from iop_edge.keyring import open_keyring
from iop_edge.metrics import EdgeMetrics
from iop_edge.refusals import Refusals
from iop_edge.settings import Settings, StartError, load_settings
from iop_edge.upstream import Upstream, worker_pool
from iop_wire.metrics import expose
from iop_wire.settings import bind_error, run_service, write_ready_file

__all__ = ["run"]

_log = structlog.get_logger("iop.edge")
_GRACEFUL_SECONDS = 50
"""Seconds requests in progress (a long streamed answer) have to finish once the edge is told to stop;
then they are cut. Under ``iop down``'s 60 s before SIGKILL, so the edge still flushes its usage and
removes its ready file. The console's live streams, which never end by themselves, are ended first."""


def run(config: Path, *, ready_file: Path | None = None, log_level: str | None = None) -> int:
    """Start the edge described by ``config``; returns the exit code (2 when it cannot start)."""
    return run_service(
        "edge", config, load_settings, lambda settings: _serve(settings, ready_file), log_level=log_level
    )


class _Server(uvicorn.Server):
    """uvicorn's server with the edge's signal handling: SIGTERM or SIGINT stop it gracefully, and
    the process then closes its control-plane connections and ready file (uvicorn's own handlers
    raise the signal again once it has stopped, which would end the process before that)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def stop(self) -> None:
        """Stop taking connections; requests in progress finish (a second call forces it)."""
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def _bind(settings: Settings) -> list[socket.socket]:
    """One listening socket per ``http.host``, all on one port (with port 0, the one the first got)."""
    port, bound = settings.http.port, []
    try:
        for host in settings.http.hosts:
            bound.append(_bind_one(host, port))
            port = bound[0].getsockname()[1]
    except StartError:
        _close(bound)
        raise
    return bound


def _bind_one(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise bind_error("http", host, port, exc) from None
    sock.listen(2048)
    sock.setblocking(False)  # noqa: FBT003 - the socket API's own flag
    return sock


def _close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def _shown_host(settings: Settings) -> str:
    """The first address bound, as a URL's host (any address: 127.0.0.1)."""
    host = settings.http.hosts[0]
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # noqa: S104 - compared, not bound
    return f"[{host}]" if ":" in host else host


def _head_limits(settings: Settings) -> HeadLimits:
    http = settings.http
    return HeadLimits(timeout=http.header_timeout, max_bytes=http.max_head_bytes, max_headers=http.max_headers)


async def _serve(settings: Settings, ready_file: Path | None) -> int:
    sockets = _bind(settings)  # first: a port in use is the only line printed
    metrics = EdgeMetrics()
    expose(metrics.registry)
    worker = worker_pool(settings)
    edge = Edge(settings=settings, upstream=Upstream(settings), metrics=metrics, worker=worker)
    keyring = None
    if settings.auth == "keys":
        try:
            keyring = await open_keyring(edge)
        except StartError:
            _close(sockets)
            raise
        if not len(keyring.keys):
            _log.warning(
                "no API keys",
                reason=f"{keyring.keys.storage.name} holds none: every request gets 401 until 'iop keys create NAME'",
            )
    else:
        _log.warning(
            "AUTHENTICATION IS OFF",
            reason="auth: none: every request is served without an API key; for local development only",
        )
    app = build_app(edge)
    server = _Server(
        uvicorn.Config(
            app,
            loop="none",
            http=head_protocol(_head_limits(settings), Refusals(metrics)),
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_keep_alive=int(settings.http.keep_alive),
            limit_concurrency=settings.http.max_connections,
            server_header=False,
            timeout_graceful_shutdown=_GRACEFUL_SECONDS,
        )
    )
    loop = asyncio.get_running_loop()

    def stop() -> None:
        app.state.console.hub.end_all()  # live streams never end by themselves: end them first
        server.stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop)
    edge.upstream.start()
    worker.start()
    port = sockets[0].getsockname()[1]
    try:
        serving = asyncio.ensure_future(server.serve(sockets=sockets))
        while not server.started and not serving.done():  # noqa: ASYNC110 - uvicorn sets a flag, no event
            await asyncio.sleep(0.01)
        if server.started:
            _log.info(
                "edge started",
                hosts=list(settings.http.hosts),
                port=port,
                control_plane=edge.upstream.address,
                worker=worker.address or None,
                auth=settings.auth,
                console=f"http://{_shown_host(settings)}:{port}/console",
            )
            if ready_file is not None:
                write_ready_file(ready_file, port=port)
        await serving
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)  # noqa: ASYNC240 - one unlink while stopping
        await asyncio.gather(edge.upstream.aclose(), worker.aclose(), app.state.console.aclose())
        await app.state.responses.aclose()  # before the keyring closes the key store its writes go to
        if keyring is not None:
            await keyring.aclose()
        _close(sockets)
        _log.info("edge stopped")
    return 0
