"""The edge's connections to its peers: a small pool per peer, each kept open by the wire's dialer.

:class:`Pool` serves the control-plane (runs) and the worker (files and batches) alike; only the
address section, the certificate role the peer must hold and the peer's name differ. Requests
are spread over the connections that are up, in turn; a connection that closes is redialed with
backoff (``iop_wire.KeepConnected``) and skipped meanwhile. With none up, a request is refused
at once (503), never queued here: the control-plane is where runs wait. Capabilities (the
models for ``/v1/models`` and ``/ready``) are asked on a connection that is up and reused for
``capabilities_ttl`` seconds, so a burst of model lists costs the control-plane one request.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import structlog

from iop_edge.settings import Settings
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import IopError, Role
from iop_wire.connection import Connection
from iop_wire.dialer import KeepConnected
from iop_wire.runs import RunStream
from iop_wire.settings import ControlPlaneAddress

__all__ = ["Pool", "Upstream", "worker_pool"]

_log = structlog.get_logger("iop.edge")
_CAPABILITIES_TIMEOUT = 5.0


class Pool:
    """A pool of connections to one peer (none when its address is unset)."""

    def __init__(
        self, settings: Settings, section: ControlPlaneAddress, *, connections: int, role: Role, setting: str
    ) -> None:
        self.peer = role.value
        """The peer's name in errors: control-plane, worker."""
        self.setting = setting
        """The settings section naming its address (``worker``), for the error when it is unset."""
        self.links: list[KeepConnected] = []
        self.address = ""
        self._turn = itertools.count()
        if section.address is None:
            return
        connection = settings.connection.config(heartbeat_interval=settings.heartbeat_interval)
        target = section.target(settings.tls.config(), connection, role)
        self.links = [KeepConnected(target, backoff=section.backoff()) for _ in range(connections)]
        self.address = target.address

    def start(self) -> None:
        """Start dialing every connection of the pool."""
        for link in self.links:
            link.start()

    async def aclose(self) -> None:
        """Close every connection (runs still open on them end with an error)."""
        await asyncio.gather(*(link.stop() for link in self.links))

    def connection(self) -> Connection:
        """A connection that is up, in turn; 503 (UNAVAILABLE) when none is."""
        links = self.links
        if not links:
            message = f"no {self.peer} is configured: set {self.setting}.address in the edge's settings"
            raise IopError(pb.ERROR_CODE_UNAVAILABLE, message, param=f"{self.setting}.address")
        start = next(self._turn)
        for offset in range(len(links)):
            connection = links[(start + offset) % len(links)].connection
            if connection is not None and not connection.closed:
                return connection
        raise IopError(pb.ERROR_CODE_UNAVAILABLE, f"the {self.peer} at {self.address} is not reachable", retryable=True)

    @property
    def connected(self) -> int:
        """Connections of the pool that are up."""
        return sum(link.connection is not None and not link.connection.closed for link in self.links)


class Upstream(Pool):
    """The pool of connections to the control-plane: runs and capabilities."""

    def __init__(self, settings: Settings) -> None:
        cp = settings.control_plane
        super().__init__(settings, cp, connections=cp.connections, role=Role.CONTROL_PLANE, setting="control_plane")
        self._ttl = cp.capabilities_ttl
        self._capabilities: tuple[float, pb.CapabilityResponse] | None = None
        self._asking: asyncio.Future[pb.CapabilityResponse] | None = None

    async def open_run(self, request: pb.RunRequest) -> RunStream:
        """Submit a run on a connection that is up."""
        return await self.connection().open_run(request, urgent=False)  # written at the end of the turn

    async def capabilities(self) -> pb.CapabilityResponse:
        """The models available across the platform's ready nodes (cached ``capabilities_ttl`` s)."""
        cached = self._capabilities
        if cached is not None and time.monotonic() - cached[0] < self._ttl:
            return cached[1]
        if self._asking is None:  # one request at a time; the others wait for its answer
            self._asking = asyncio.ensure_future(self._ask())
        asking = self._asking
        try:
            return await asyncio.shield(asking)
        finally:
            if asking.done() and self._asking is asking:
                self._asking = None

    async def _ask(self) -> pb.CapabilityResponse:
        answer = await self.connection().capabilities(timeout=_CAPABILITIES_TIMEOUT)
        self._capabilities = (time.monotonic(), answer)
        return answer

    def models(self, capabilities: pb.CapabilityResponse) -> dict[str, pb.ModelInfo]:
        """Model name -> its info, over every adapter."""
        return {model.name: model for adapter in capabilities.adapters for model in adapter.models}


def worker_pool(settings: Settings) -> Pool:
    """The pool of connections to the worker (files and batches); empty when ``worker.address`` is unset."""
    worker = settings.worker
    return Pool(settings, worker, connections=worker.connections, role=Role.WORKER, setting="worker")
