"""The edge's connections to its peers: a small pool per peer, each connection kept open by the wire's dialer.

:class:`Pool` serves the control-planes (runs) and the worker (files and batches) alike; only the
address section, the certificate role the peer must hold and the peer's name differ. A section
names one peer (``address``) or several (``addresses``: control-planes running active-active);
the pool keeps ``connections`` to each. Requests are spread over the connections that are up,
in turn, whichever peer they reach; a connection that closes is redialed with backoff
(``iop_wire.KeepConnected``) and skipped meanwhile. With none up, a request is refused at once
(503), never queued here: the control-plane is where runs wait.

A run opened through a control-plane whose connection dies before the run's first output is
opened again through another (``iop_wire.failover``): the client sees one stream. After output
it is continued through another from what the client got (at most ``migrations`` times), or
ends with NODE_LOST (retryable) when it cannot be. Capabilities (the models for ``/v1/models`` and ``/ready``)
are asked of every control-plane that is up and merged, then reused for ``capabilities_ttl``
seconds, so a burst of model lists costs each control-plane one request.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from iop_edge.settings import Settings
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import IopError, Role
from iop_wire.connection import Connection
from iop_wire.dialer import KeepConnected, Links
from iop_wire.errors import ConnectionClosed
from iop_wire.failover import FailoverStream, open_run_anywhere
from iop_wire.settings import ControlPlaneAddress

__all__ = ["Pool", "Upstream", "merge_capabilities", "worker_pool"]

_log = structlog.get_logger("iop.edge")
_CAPABILITIES_TIMEOUT = 5.0


class Pool:
    """A pool of connections to one peer or several (none when no address is set)."""

    def __init__(
        self, settings: Settings, section: ControlPlaneAddress, *, connections: int, role: Role, setting: str
    ) -> None:
        self.peer = role.value
        """The peer's name in errors: control-plane, worker."""
        self.setting = setting
        """The settings section naming its address (``worker``), for the error when it is unset."""
        connection = settings.connection.config(heartbeat_interval=settings.heartbeat_interval)
        targets = section.targets(settings.tls.config(), connection, role) if section.all_addresses else []
        backoff = section.backoff()
        # Interleaved (a, b, a, b): taken in turn, consecutive runs go to different control-planes.
        self.links = Links([KeepConnected(target, backoff=backoff) for _ in range(connections) for target in targets])
        self.address = ", ".join(self.links.addresses)
        """Every peer's ``host:port``, for messages."""

    def start(self) -> None:
        """Start dialing every connection of the pool."""
        self.links.start()

    async def aclose(self) -> None:
        """Close every connection (runs still open on them end with an error)."""
        await self.links.stop()

    def connection(self) -> Connection:
        """A connection that is up, in turn; 503 (UNAVAILABLE) when none is."""
        if not self.links.links:
            message = f"no {self.peer} is configured: set {self.setting}.address in the edge's settings"
            raise IopError(pb.ERROR_CODE_UNAVAILABLE, message, param=f"{self.setting}.address")
        try:
            connection = self.links.pick().connection
        except IopError:
            connection = None
        if connection is None:
            message = f"the {self.peer} at {self.address} is not reachable"
            raise IopError(pb.ERROR_CODE_UNAVAILABLE, message, retryable=True)
        return connection

    @property
    def connected(self) -> int:
        """Connections of the pool that are up."""
        return len(self.links.up())

    def per_peer(self) -> dict[str, Connection]:
        """One connection that is up to each peer (address -> connection): to ask every one of them."""
        first_up: dict[str, Connection] = {}
        for link in self.links.up():
            if link.connection is not None:
                first_up.setdefault(link.target.address, link.connection)
        return first_up

    @property
    def peers_up(self) -> int:
        """Peers with at least one connection up."""
        return len({link.target.address for link in self.links.up()})


class Upstream(Pool):
    """The pool of connections to the control-plane(s): runs and capabilities."""

    def __init__(self, settings: Settings) -> None:
        cp = settings.control_plane
        super().__init__(settings, cp, connections=cp.connections, role=Role.CONTROL_PLANE, setting="control_plane")
        self._ttl = cp.capabilities_ttl
        self._migrations = cp.migrations
        self._capabilities: tuple[float, pb.CapabilityResponse] | None = None
        self._asking: asyncio.Future[pb.CapabilityResponse] | None = None

    async def open_run(self, request: pb.RunRequest) -> FailoverStream:
        """Submit a run on a connection that is up; opened again elsewhere if that one dies (continued
        from its output when it had some)."""
        if not self.links.up():
            self.connection()  # the pool's error: none configured, or none reachable
        # written at the end of the turn
        return await open_run_anywhere(self.links, request, urgent=False, migrations=self._migrations)

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
        """Every control-plane that is up asked at once; the answers merged (one is enough)."""
        self.connection()  # the error when none is configured or up
        first_up = self.per_peer()
        asked = [connection.capabilities(timeout=_CAPABILITIES_TIMEOUT) for connection in first_up.values()]
        answers = await asyncio.gather(*asked, return_exceptions=True)
        good = [answer for answer in answers if isinstance(answer, pb.CapabilityResponse)]
        for address, answer in zip(first_up, answers, strict=True):
            if isinstance(answer, BaseException):
                _log.warning("capabilities not answered", address=address, reason=str(answer) or type(answer).__name__)
        if not good:
            failure = next(answer for answer in answers if isinstance(answer, BaseException))
            if isinstance(failure, IopError | TimeoutError):
                raise failure
            raise ConnectionClosed(str(failure))
        merged = merge_capabilities(good)
        self._capabilities = (time.monotonic(), merged)
        return merged

    def models(self, capabilities: pb.CapabilityResponse) -> dict[str, pb.ModelInfo]:
        """Model name -> its info, over every adapter."""
        return {model.name: model for adapter in capabilities.adapters for model in adapter.models}


def merge_capabilities(answers: list[pb.CapabilityResponse]) -> pb.CapabilityResponse:
    """Several control-planes' answers as one: every adapter, each model once (the first answer's info)."""
    if len(answers) == 1:
        return answers[0]
    merged = pb.CapabilityResponse()
    merged.CopyFrom(answers[0])
    adapters = {adapter.name: adapter for adapter in merged.adapters}
    seen = {(adapter.name, model.name) for adapter in merged.adapters for model in adapter.models}
    for answer in answers[1:]:
        for adapter in answer.adapters:
            into = adapters.get(adapter.name)
            if into is None:
                into = adapters[adapter.name] = merged.adapters.add(name=adapter.name)
            for model in adapter.models:
                if (adapter.name, model.name) not in seen:
                    seen.add((adapter.name, model.name))
                    into.models.add().CopyFrom(model)
    return merged


def worker_pool(settings: Settings) -> Pool:
    """The pool of connections to the worker (files and batches); empty when ``worker.address`` is unset."""
    worker = settings.worker
    return Pool(settings, worker, connections=worker.connections, role=Role.WORKER, setting="worker")
