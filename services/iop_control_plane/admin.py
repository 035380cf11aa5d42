"""Operations an admin certificate may ask for: list, drain, undrain, remove and reload nodes; show
and apply policy; list runs from the ledger, token usage, and the overview of recent traffic. Edges
and workers, which act for callers, may ask the read-only ones (:data:`READ_ONLY`): the edge
decides which API key sees what.

``nodes.reload`` is sent on to the node over its registration connection (it reads its config
file's routes again) and its answer relayed: what changed, or why nothing did.

A drain is kept by the control-planes only: no new runs go to the node, its runs in flight
finish, and ``nodes.undrain`` lifts it (the node is not sent ``node.drain``, which it could not
take back). A drain holds across the node's reconnections and restarts of the control-plane.
Removing a node revokes every certificate it was issued (and the one it presented), closes its
connection at once and forgets it: it comes back only by joining again with a new token.

Drains, removals and applied policies are written to the state store before they take effect
here (an admin's request fails UNAVAILABLE when the store cannot take them), and other
control-planes sharing the store follow within ``store.poll_interval``
(:mod:`iop_control_plane.replicas`). Every applied policy is kept, numbered; the newest is in force.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import structlog

from iop_control_plane.identity import IdentityStore
from iop_control_plane.nodes import NodeSessions
from iop_control_plane.policy import load_policy
from iop_control_plane.registry import NodeState, NodeView
from iop_control_plane.scheduler import Scheduler
from iop_control_plane.state import PolicyRecord, StateStore
from iop_control_plane.traffic import WINDOW_MAX, Traffic
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import Inbound, IopError, MessageHandler
from iop_wire.settings import ConfigError

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
    from google.protobuf.timestamp_pb2 import Timestamp

__all__ = ["MAX_REASON_CHARS", "READ_ONLY", "Operations", "PolicyInForce"]

READ_ONLY = ("nodes_list", "runs_list", "usage_list", "overview_show")
"""What an edge or worker certificate may ask besides runs and capabilities: reads, no operation."""

_log = structlog.get_logger("iop.control_plane")
_T = TypeVar("_T")
MAX_REASON_CHARS = 1000
"""Longest reason a drain, undrain or remove may give: it is kept, logged and shown in every nodes
listing (and each console's live push) while the node is drained, so it is bounded."""
_RELOAD_TIMEOUT = 8.0
"""Seconds a node has to answer nodes.reload (it starts servers without waiting for them): less than
``iop``'s 10 s wait for the answer, so the admin hears which node did not answer."""
_STATES = {
    NodeState.READY: pb.NODE_STATE_READY,
    NodeState.UNAVAILABLE: pb.NODE_STATE_UNAVAILABLE,
    NodeState.DRAINING: pb.NODE_STATE_DRAINING,
}


class PolicyInForce:
    """The policy text in force, with its version (hex SHA-256 of the text), time and source."""

    def __init__(self, text: str = "", source: str = "default", serial: int = 0) -> None:
        self.text, self.source = text, source
        self.version = hashlib.sha256(text.encode()).hexdigest()
        self.loaded_at = time.time_ns()
        self.serial = serial
        """Its number in the state store (0: not recorded there)."""


class Operations:
    """The admin message handlers."""

    def __init__(
        self,
        scheduler: Scheduler,
        sessions: NodeSessions,
        policy: PolicyInForce,
        identity: IdentityStore,
        *,
        traffic: Traffic | None = None,
        queued: Callable[[], dict[str, int]] = dict,
        name: str = "control-plane",
    ) -> None:
        self.scheduler, self.sessions, self.policy, self.identity = scheduler, sessions, policy, identity
        self.state: StateStore = identity.store
        self.traffic = traffic or Traffic()
        """Runs that ended here recently (the relay's)."""
        self.queued = queued
        """Runs waiting in the admission queues now, per model (the relay's)."""
        self.name = name
        """This control-plane's certificate name, as overview.shown says who answered."""
        self._reloads: set[asyncio.Task[None]] = set()

    def handlers(self) -> dict[str, MessageHandler]:
        """``{body field: handler}`` for an admin's connection."""
        return {
            "nodes_list": self.nodes_list,
            "nodes_drain": self.nodes_drain,
            "nodes_undrain": self.nodes_undrain,
            "nodes_remove": self.nodes_remove,
            "nodes_reload": self.nodes_reload,
            "policy_show": self.policy_show,
            "policy_apply": self.policy_apply,
            "runs_list": self.runs_list,
            "usage_list": self.usage_list,
            "overview_show": self.overview_show,
        }

    async def nodes_list(self, inbound: Inbound) -> None:
        """Every registered node, in any state."""
        answer = pb.Envelope()
        answer.nodes_listed.SetInParent()  # the body even when there is no node
        listed = answer.nodes_listed.nodes
        for node in sorted(self.sessions.registry.nodes.values(), key=lambda n: n.node_id):
            self._add(listed, node)
        await inbound.reply(answer)

    async def nodes_drain(self, inbound: Inbound) -> None:
        """No new runs to the node until undrained."""
        message = inbound.envelope.nodes_drain
        node = self._node(message.node_id)
        reason = _reason(message.reason) or f"drained by {inbound.peer.name}"
        await _stored(self.state.set_drain(node.node_id, reason, inbound.peer.name, drained=True), "the drain")
        self.sessions.drained.add(node.node_id)
        if node.state is NodeState.READY:
            self.sessions.mark(node.node_id, NodeState.DRAINING, reason)
        await inbound.reply(pb.Envelope(operation_done=pb.OperationDone(message=f"node {node.node_id} draining")))

    async def nodes_undrain(self, inbound: Inbound) -> None:
        """New runs go to the node again (if it is connected)."""
        message = inbound.envelope.nodes_undrain
        node = self._node(message.node_id)
        _reason(message.reason)
        await _stored(self.state.set_drain(node.node_id, "", inbound.peer.name, drained=False), "the undrain")
        self.sessions.drained.discard(node.node_id)
        if node.state is NodeState.DRAINING and self.sessions.connection(node.node_id) is not None:
            self.sessions.mark(node.node_id, NodeState.READY, message.reason or f"undrained by {inbound.peer.name}")
        done = pb.OperationDone(message=f"node {node.node_id} {node.state.value}")
        await inbound.reply(pb.Envelope(operation_done=done))

    async def nodes_remove(self, inbound: Inbound) -> None:
        """Revoke the node's certificates, close its connection at once and forget it."""
        message = inbound.envelope.nodes_remove
        node_id, sessions = message.node_id, self.sessions
        reason = _reason(message.reason) or f"removed by {inbound.peer.name}"
        connection = sessions.connections.get(node_id)
        peer = connection.peer if connection is not None else None
        shared = node_id in sessions.shared
        presented = (peer.serial, peer.not_after) if peer is not None and peer.serial and not shared else None
        revoked = await _stored(self.identity.revoke_node(node_id, reason, also=presented), "the revocation")
        if node_id in sessions.drained:
            await _stored(self.state.set_drain(node_id, "", inbound.peer.name, drained=False), "the removal")
        error = IopError(
            pb.ERROR_CODE_PERMISSION_DENIED,
            f"node {node_id} was removed ({reason}): its certificate is revoked; join again with a new token",
            reason=pb.ERROR_REASON_CERTIFICATE_REVOKED,
        )
        if not await sessions.forget(node_id, error) and not revoked:
            raise IopError(pb.ERROR_CODE_NOT_FOUND, f"no node {node_id[:80]!r} is registered or holds a certificate")
        _log.warning("node removed", node_id=node_id, reason=reason, revoked=revoked, by=inbound.peer.name)
        said = f"node {node_id} removed; {len(revoked)} certificate(s) revoked"
        if shared:
            said += (
                "; it used the shared development certificate, which is not revoked (every local node uses it):"
                " it can register again"
            )
        await inbound.reply(pb.Envelope(operation_done=pb.OperationDone(message=said)))

    async def nodes_reload(self, inbound: Inbound) -> None:
        """The node reads its routes again; its answer (what changed, or the config's error) is relayed."""
        node_id = inbound.envelope.nodes_reload.node_id
        if node_id not in self.sessions.registry.nodes:
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, f"no node {node_id[:80]!r} is registered")
        connection = self.sessions.connection(node_id)
        if connection is None:
            raise IopError(pb.ERROR_CODE_UNAVAILABLE, f"node {node_id} is not connected: it cannot be asked to reload")
        _log.info("node reload requested", node_id=node_id, by=inbound.peer.name)
        try:
            reload = pb.Envelope(nodes_reload=pb.NodesReload(node_id=node_id))
            answer = await connection.request(reload, _RELOAD_TIMEOUT)
        except TimeoutError:
            message = (
                f"node {node_id} did not answer the reload within {_RELOAD_TIMEOUT:g}s; it may still apply it:"
                " check 'iop nodes ls' or the node's log ('routes reloaded')"
            )
            raise IopError(pb.ERROR_CODE_UNAVAILABLE, message) from None
        if answer.WhichOneof("body") != "operation_done":
            message = f"node {node_id} answered nodes.reload with something else"
            raise IopError(pb.ERROR_CODE_PROTOCOL_VIOLATION, message)
        await inbound.reply(pb.Envelope(operation_done=answer.operation_done))

    async def runs_list(self, inbound: Inbound) -> None:
        """Runs from the ledger, newest first (what is committed: the writer batches)."""
        listed = await _read(self.sessions.store.runs(inbound.envelope.runs_list), "the run ledger")
        await inbound.reply(pb.Envelope(runs_listed=listed))

    async def usage_list(self, inbound: Inbound) -> None:
        """Token usage per hour or day, by caller and model, from the ledger's rollup (what is committed)."""
        listed = await _read(self.sessions.store.usage(inbound.envelope.usage_list), "the usage")
        await inbound.reply(pb.Envelope(usage_listed=listed))

    async def overview_show(self, inbound: Inbound) -> None:
        """Runs that ended here in the window asked, and the runs queued here and running on the nodes now."""
        window = inbound.envelope.overview_show.window_seconds
        if window > WINDOW_MAX:
            message = f"window_seconds is {window}, over the limit of {WINDOW_MAX}"
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, message, param="window_seconds")
        shown = self.traffic.shown(window, queued=self.queued(), running=self._running())
        shown.control_plane = self.name
        await inbound.reply(pb.Envelope(overview_shown=shown))

    def _running(self) -> dict[str, int]:
        """Runs executing on the registered nodes now, per model: their reports plus the runs sent since."""
        running: dict[str, int] = {}
        for node in self.sessions.registry.nodes.values():
            for view in node.models.values():
                if busy := view.in_flight + view.sent_since_report:
                    running[view.model] = running.get(view.model, 0) + busy
        return running

    async def policy_show(self, inbound: Inbound) -> None:
        """The policy in force."""
        policy = self.policy
        shown = pb.PolicyShown(yaml=policy.text, version=policy.version, source=policy.source)
        shown.loaded_at.FromNanoseconds(policy.loaded_at)
        await inbound.reply(pb.Envelope(policy_shown=shown))

    async def policy_apply(self, inbound: Inbound) -> None:
        """Validate and apply a policy; an invalid one changes nothing."""
        message = inbound.envelope.policy_apply
        try:
            load_policy(message.yaml)
        except ConfigError as exc:
            _log.warning("policy refused", reason=str(exc), peer=inbound.peer.name)
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, str(exc)) from None
        await self.record(message.yaml, message.source or f"policy.apply by {inbound.peer.name}", inbound.peer.name)
        applied = pb.PolicyApplied(version=self.policy.version)
        applied.loaded_at.FromNanoseconds(self.policy.loaded_at)
        await inbound.reply(pb.Envelope(policy_applied=applied))

    async def record(self, text: str, source: str, applied_by: str) -> PolicyInForce:
        """Record a valid policy in the store as the newest, then put it in force here (replicas follow);
        IopError UNAVAILABLE when the store cannot take it (nothing changes)."""
        digest = hashlib.sha256(text.encode()).hexdigest()
        record = await _stored(self.state.add_policy(text, digest, source, applied_by), "the policy")
        return self.apply(text, source, serial=record.version)

    def apply(self, text: str, source: str, *, serial: int = 0) -> PolicyInForce:
        """Validate ``text`` and put it in force here only; ConfigError (one line naming the key) changes nothing."""
        policy = load_policy(text)
        self.scheduler.apply(policy)
        self.policy = PolicyInForce(text, source, serial)
        _log.info("policy applied", version=self.policy.version, number=serial or None, source=source)
        return self.policy

    def follow(self, newest: PolicyRecord) -> None:
        """Put in force the store's newest policy (recorded here or by a replica) unless it is already."""
        if newest.version == self.policy.serial:
            return
        try:
            self.apply(newest.text, newest.source, serial=newest.version)
        except ConfigError as exc:  # written by a control-plane whose policy rules differ
            _log.error("stored policy refused", reason=str(exc), number=newest.version, kept=self.policy.version)
            self.policy.serial = newest.version  # not again every poll

    def reload(self, path: Path | None) -> None:
        """Read the policy file again (on SIGHUP) and record it (in a task); a bad file is logged and the
        old policy stays."""
        if path is None:
            _log.warning("policy not reloaded", reason="no policy_path is set")
            return
        try:
            text = path.read_text(encoding="utf-8")
            load_policy(text)
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            _log.error(
                "policy reload refused", reason=f"policy_path: cannot read {path}: {reason}", kept=self.policy.version
            )
            return
        except ConfigError as exc:
            _log.error("policy reload refused", reason=f"policy_path: {path}: {exc}", kept=self.policy.version)
            return
        task = asyncio.get_running_loop().create_task(self._record_reload(text, str(path)), name="iop-policy-reload")
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def _record_reload(self, text: str, source: str) -> None:
        try:
            await self.record(text, source, "SIGHUP")
        except IopError as exc:
            _log.error("policy reload refused", reason=exc.message, kept=self.policy.version)

    def _node(self, node_id: str) -> NodeView:
        node = self.sessions.registry.nodes.get(node_id)
        if node is None:
            raise IopError(pb.ERROR_CODE_NOT_FOUND, f"no node {node_id!r} is registered")
        return node

    def _add(self, listed: RepeatedCompositeFieldContainer[pb.NodeInfo], node: NodeView) -> None:
        """``node`` added to the answer in place: built apart and copied in, 1,000 nodes took 3-4 times
        as long, most of the `iop nodes ls` round trip."""
        sessions = self.sessions
        loads = [(view, view.in_flight + view.sent_since_report) for view in node.models.values()]
        info = listed.add(
            node_id=node.node_id,
            state=_STATES[node.state],
            reason=node.reason,
            in_flight=sum(in_flight for _, in_flight in loads),
            capacity=sum(view.capacity for view, _ in loads),
            address=sessions.addresses.get(node.node_id, ""),
            shared_certificate=node.node_id in sessions.shared,
        )
        if node.labels:  # a map given to add() is copied through Python's MutableMapping.update, even empty
            info.labels.update(node.labels)
        for view, in_flight in loads:
            info.models.add(
                model=view.model,
                in_flight=in_flight,
                queued=view.queued,
                capacity=view.capacity,
                available=view.available,
                served=view.served,
            )
        connection = sessions.connections.get(node.node_id)
        if connection is not None and connection.peer.serial:
            info.certificate_serial = connection.peer.serial
            if connection.peer.not_after is not None:
                _set_time(info.certificate_not_after, connection.peer.not_after)
        if (seen := sessions.last_seen.get(node.node_id)) is not None:
            _set_time(info.last_heartbeat, seen)
        if (first := sessions.store.first_seen.get(node.node_id)) is not None:
            _set_time(info.first_seen, first)


def _set_time(timestamp: Timestamp, seconds: float) -> None:
    """``timestamp`` set to ``seconds`` since the epoch, field by field: FromNanoseconds checks its range in
    Python, three times per node of a listing."""
    whole = int(seconds)
    timestamp.seconds, timestamp.nanos = whole, int((seconds - whole) * 1e9)


async def _read(read: Awaitable[_T], what: str) -> _T:
    """Await a read of the store; IopError INVALID_ARGUMENT for a bad request (ValueError), UNAVAILABLE
    (retryable) when the store cannot answer."""
    try:
        return await read
    except ValueError as exc:
        raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - any driver's error: the asker gets one line
        _log.error("state store read failed", what=what, reason=str(exc) or type(exc).__name__)
        raise IopError(pb.ERROR_CODE_UNAVAILABLE, f"cannot read {what}: {exc}", retryable=True) from None


async def _stored(write: Awaitable[_T], what: str) -> _T:
    """Await a write to the state store; IopError UNAVAILABLE (retryable) when it cannot take it."""
    try:
        return await write
    except Exception as exc:  # noqa: BLE001 - any driver's error: the admin gets one line
        _log.error("state store write failed", what=what, reason=str(exc) or type(exc).__name__)
        raise IopError(pb.ERROR_CODE_UNAVAILABLE, f"cannot record {what} in the state store: {exc}") from None


def _reason(text: str) -> str:
    """An operation's reason; IopError INVALID_ARGUMENT (naming ``reason``) past :data:`MAX_REASON_CHARS`."""
    if len(text) > MAX_REASON_CHARS:
        message = f"reason is {len(text)} characters, over {MAX_REASON_CHARS}: say it shorter"
        raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, message, param="reason")
    return text
