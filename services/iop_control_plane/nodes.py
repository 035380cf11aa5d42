"""Node sessions: ``node.register`` and ``node.status`` from a node's connection, into the registry.

A node is ready once registered, and unavailable the moment its connection closes (the wire
closes the connection of a peer silent, or not reading, for 3 heartbeat intervals). Its id
is taken while its connection is open: a second registration under that id is refused and
the live one keeps serving. Drains set by an admin hold across the node's reconnections, and
those set through another control-plane sharing the store are followed (:meth:`NodeSessions.follow_drains`,
as are its revocations: :meth:`NodeSessions.revoked`). With
TLS, :attr:`NodeSessions.vet` (the identity rule) decides whether a certificate may register the
id it names; :meth:`NodeSessions.forget` closes a removed node's connection and drops it. A node
whose routes were reloaded sends ``capability.response`` unasked on its registration connection:
taken as its capabilities from then on (:meth:`NodeSessions.on_capabilities`), from that
connection only.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable, Iterator, Mapping, Set

import structlog

from iop_control_plane.registry import ModelLoad, NodeState, Registry, Status
from iop_control_plane.store import AuditStore
from iop_control_plane.text import NAME_CHARS
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import Connection, Inbound, IopError, PeerIdentity
from iop_wire.messages import error_envelope

__all__ = ["NodeSessions", "loads", "status"]

_log = structlog.get_logger("iop.control_plane")


def continuable_kinds(capabilities: pb.CapabilityResponse) -> dict[str, frozenset[int]]:
    """The run kinds each model of a node can continue (models that continue none are left out)."""
    models = (model for adapter in capabilities.adapters for model in adapter.models)
    return {model.name: frozenset(model.continuable_kinds) for model in models if model.continuable_kinds}


def run_kinds(capabilities: pb.CapabilityResponse) -> dict[str, frozenset[int]]:
    """The run kinds each model of a node takes (its ModelInfo's ``kinds``)."""
    models = (model for adapter in capabilities.adapters for model in adapter.models)
    return {model.name: frozenset(model.kinds) for model in models}


def loads(message: pb.NodeStatus, capabilities: pb.CapabilityResponse | None = None) -> list[ModelLoad]:
    """The registry's view of a node's report; without per-model loads, its capabilities' models."""
    if message.models or capabilities is None:
        return [ModelLoad(m.model, m.in_flight, m.queued, m.capacity, m.available, _served(m)) for m in message.models]
    models = (model for adapter in capabilities.adapters for model in adapter.models)
    return [
        ModelLoad(m.name, capacity=max(m.max_concurrency, 1), available=m.available, served=_served(m)) for m in models
    ]


def _served(model: pb.ModelLoad | pb.ModelInfo) -> pb.ServedModel | None:
    """A served model's server state (kept for nodes.list); None for a model whose server the node does not run."""
    return model.served if model.HasField("served") else None


def status(node_id: str, message: pb.NodeStatus) -> Status:
    """``node.status`` as the registry takes it."""
    return Status(node_id, tuple(loads(message)), draining=message.draining)


class NodeSessions:
    """Registered nodes' connections, capabilities and times, kept with the registry."""

    def __init__(self, registry: Registry, store: AuditStore, *, heartbeat_interval: float) -> None:
        self.registry = registry
        self.store = store
        self.heartbeat_interval = heartbeat_interval
        self.connections: dict[str, Connection] = {}
        """Node id -> its live connection."""
        self.capabilities: dict[str, pb.CapabilityResponse] = {}
        """Node id -> what it registered with."""
        self.last_seen: Mapping[str, float] = _LastHeard(self.connections)
        """Node id -> when its connection last brought a whole frame (a heartbeat, at least every
        heartbeat interval; a status only comes on a change), as ``time.time()``."""
        self.addresses: dict[str, str] = {}
        """Node id -> the address its connection came from."""
        self.drained: set[str] = set()
        """Nodes an admin drained: draining also when they register again."""
        self.vet: Callable[[str, PeerIdentity], bool] | None = None
        """The identity rule (TLS on): raises IopError to refuse ``node_id`` for the peer's certificate;
        True when the peer holds the shared development certificate."""
        self.shared: set[str] = set()
        """Nodes registered with the shared development certificate."""
        self._by_connection: dict[str, str] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self._registered_listeners: list[Callable[[str], None]] = []

    def on_registered(self, listener: Callable[[str], None]) -> None:
        """Call ``listener`` with a node's id once its registration is answered."""
        self._registered_listeners.append(listener)

    def connection(self, node_id: str) -> Connection | None:
        """The node's connection while it is open."""
        connection = self.connections.get(node_id)
        return None if connection is None or connection.closed else connection

    def mark(self, node_id: str, state: NodeState, reason: str) -> None:
        """Change a node's state in the registry and the audit."""
        self.registry.mark(node_id, state, reason)
        self.store.state_changed(node_id, state.value, reason)
        _log.info("node state", node_id=node_id, state=state.value, reason=reason)

    async def on_register(self, inbound: Inbound) -> None:
        """``node.register``: take the node in (or refuse a second holder of a live id)."""
        message = inbound.envelope.node_register
        node_id, connection = message.node_id, inbound.connection
        if not node_id or len(node_id) > NAME_CHARS:
            shown = f"a node_id of {len(node_id)} characters" if node_id else "no node_id"
            raise IopError(
                pb.ERROR_CODE_INVALID_ARGUMENT,
                f"node.register needs a node_id of 1-{NAME_CHARS} characters, not {shown}",
            )
        shared = self.vet(node_id, inbound.peer) if self.vet is not None else False
        current = self.connection(node_id)
        if current is not None and current is not connection:
            _log.warning("registration refused", node_id=node_id, reason="id is live", peer=inbound.peer.name)
            raise IopError(
                pb.ERROR_CODE_PROTOCOL_VIOLATION,
                f"node id {node_id!r} is registered by a live connection; use another id or stop that node",
            )
        held = self._by_connection.get(connection.id)
        if held is not None and held != node_id:
            raise IopError(pb.ERROR_CODE_PROTOCOL_VIOLATION, f"this connection is registered as {held!r} already")
        capabilities = pb.CapabilityResponse()
        capabilities.CopyFrom(message.capabilities)
        labels = dict(capabilities.labels)
        continuable, kinds = continuable_kinds(capabilities), run_kinds(capabilities)
        reported = loads(message.status, capabilities)
        self.registry.register(node_id, reported, labels=labels, continuable=continuable, kinds=kinds)
        self.connections[node_id], self.capabilities[node_id] = connection, capabilities
        self._by_connection[connection.id] = node_id
        self.addresses[node_id] = connection.address
        self.store.node_seen(
            node_id, labels=labels, address=self.addresses[node_id], models=self.registry.nodes[node_id].models
        )
        self.store.state_changed(node_id, NodeState.READY.value, "registered")
        if shared and node_id not in self.shared:
            _log.warning(
                "node registered with the shared development certificate",
                node_id=node_id,
                reason="any process holding it may register any id: for one machine only; join machines instead",
            )
        if shared:
            self.shared.add(node_id)
        else:
            self.shared.discard(node_id)
        if node_id in self.drained:
            self.mark(node_id, NodeState.DRAINING, "drained by an admin")
        models = sorted(self.registry.nodes[node_id].models)
        _log.info("node registered", node_id=node_id, peer=inbound.peer.name, models=models)
        interval = datetime.timedelta(seconds=self.heartbeat_interval)
        registered = pb.NodeRegistered(node_id=node_id)
        registered.heartbeat_interval.FromTimedelta(interval)
        await inbound.reply(pb.Envelope(node_registered=registered))
        if held is None:  # a second node.register on the same connection is watched already
            self._watch(node_id, connection)
        for listener in self._registered_listeners:
            listener(node_id)

    async def on_status(self, inbound: Inbound) -> None:
        """``node.status``: the node's load replaces what it last reported."""
        node_id = self._registered_as(inbound.connection)
        self.registry.report(status(node_id, inbound.envelope.node_status))
        self.store.touched(node_id)

    async def on_capabilities(self, inbound: Inbound) -> None:
        """An unasked ``capability.response`` (the node's routes were reloaded): its capabilities from now on.
        Taken only on the connection the node registered on: whose they are is the registration's."""
        node_id = self._registered_as(inbound.connection, "capability.response")
        capabilities = pb.CapabilityResponse()
        capabilities.CopyFrom(inbound.envelope.capability_response)
        capabilities.node_id = node_id
        self.capabilities[node_id] = capabilities
        self.registry.set_capabilities(node_id, continuable_kinds(capabilities), run_kinds(capabilities))
        models = sorted(model.name for adapter in capabilities.adapters for model in adapter.models)
        _log.info("node capabilities changed", node_id=node_id, models=models)

    def ready_capabilities(self) -> pb.CapabilityResponse:
        """The models available on ready nodes, merged per adapter (``node_id`` "control-plane")."""
        merged: dict[tuple[str, str], pb.ModelInfo] = {}
        for node_id, capabilities in self.capabilities.items():
            node = self.registry.nodes.get(node_id)
            if node is None or node.state is not NodeState.READY:
                continue
            for adapter in capabilities.adapters:
                for model in adapter.models:
                    view = node.models.get(model.name)
                    if view is not None and view.available:
                        _merge(merged, adapter.name, model)
        adapters: dict[str, pb.AdapterInfo] = {}
        for (name, _), model in sorted(merged.items()):
            adapters.setdefault(name, pb.AdapterInfo(name=name)).models.append(model)
        total = sum(model.max_concurrency for model in merged.values())
        return pb.CapabilityResponse(node_id="control-plane", adapters=adapters.values(), max_concurrency=total)

    def follow_drains(self, drains: Mapping[str, str]) -> None:
        """Take the store's drained nodes (set here or by a replica): drain the new ones, undrain the others."""
        for node_id in drains.keys() - self.drained:
            self.drained.add(node_id)
            node = self.registry.nodes.get(node_id)
            if node is not None and node.state is NodeState.READY:
                self.mark(node_id, NodeState.DRAINING, drains[node_id] or "drained by an admin")
        for node_id in self.drained - drains.keys():
            self.drained.discard(node_id)
            node = self.registry.nodes.get(node_id)
            if node is not None and node.state is NodeState.DRAINING and self.connection(node_id) is not None:
                self.mark(node_id, NodeState.READY, "undrained by an admin")

    async def revoked(self, serials: Set[str]) -> list[str]:
        """Forget the nodes whose connection presents one of the newly revoked ``serials`` (revoked by a
        replica: removed there); the ids forgotten."""
        gone = [node_id for node_id, conn in self.connections.items() if conn.peer.serial in serials]
        for node_id in gone:
            error = IopError(
                pb.ERROR_CODE_PERMISSION_DENIED,
                f"node {node_id} was removed: its certificate is revoked; join again with a new token",
                reason=pb.ERROR_REASON_CERTIFICATE_REVOKED,
            )
            await self.forget(node_id, error)
            _log.warning("node removed", node_id=node_id, reason="its certificate was revoked by another control-plane")
        return gone

    async def forget(self, node_id: str, error: IopError) -> bool:
        """Drop ``node_id`` from the registry and close its connection at once, telling it ``error``;
        False when it was not registered."""
        known = node_id in self.registry.nodes
        connection = self.connections.pop(node_id, None)  # first: its watcher then sees it replaced
        for kept in (self.capabilities, self.addresses):
            kept.pop(node_id, None)
        self.drained.discard(node_id)
        self.shared.discard(node_id)
        self.registry.remove(node_id)
        if known:
            self.store.state_changed(node_id, "removed", error.message)
        if connection is not None and not connection.closed:
            self._by_connection.pop(connection.id, None)
            connection.send_nowait(error_envelope(error), urgent=True)
            await connection.close(error.message, code=error.code)
        return known

    def _registered_as(self, connection: Connection, what: str = "node.status") -> str:
        node_id = self._by_connection.get(connection.id)
        if node_id is not None:
            return node_id
        raise IopError(pb.ERROR_CODE_PROTOCOL_VIOLATION, f"{what} before node.register")

    def _watch(self, node_id: str, connection: Connection) -> None:
        task = asyncio.create_task(self._until_closed(node_id, connection), name="iop-node-session")
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _until_closed(self, node_id: str, connection: Connection) -> None:
        # Not wait_closed(): for a silent peer the socket is shut only close_timeout later.
        await connection.wait_closing()
        self._by_connection.pop(connection.id, None)
        if self.connections.get(node_id) is not connection:
            return  # replaced by a newer registration
        reason = connection.close_error.message if connection.close_error else "connection closed"
        self.mark(node_id, NodeState.UNAVAILABLE, f"connection closed: {reason}")

    async def aclose(self) -> None:
        """Stop watching connections."""
        for task in list(self._watchers):
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)


class _LastHeard(Mapping[str, float]):
    """When each node's connection (open or the last one closed) last brought a whole frame."""

    def __init__(self, connections: Mapping[str, Connection]) -> None:
        self._connections = connections

    def __getitem__(self, node_id: str) -> float:
        return self._connections[node_id].last_heard

    def __iter__(self) -> Iterator[str]:
        return iter(self._connections)

    def __len__(self) -> int:
        return len(self._connections)


def _merge(merged: dict[tuple[str, str], pb.ModelInfo], adapter: str, model: pb.ModelInfo) -> None:
    found = merged.get((adapter, model.name))
    if found is None:
        merged[adapter, model.name] = found = pb.ModelInfo()
        found.CopyFrom(model)
        return
    found.max_concurrency += model.max_concurrency
    found.context_length = max(found.context_length, model.context_length)
    found.kinds.extend(kind for kind in model.kinds if kind not in found.kinds)
