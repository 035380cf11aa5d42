"""Runs through the control-plane: place, open on the node, relay, fail over.

A requester's run is served under its own id and opened on the chosen node under
``<requester connection id>.<run id>.<attempt>`` (README, "Runs"). Events are forwarded as
received (:func:`iop_wire.relay`). A run that fails before its first delta (the node's
connection lost, or a retryable error) is tried on another node, up to the policy's attempts
and within its deadline; the requester sees one start and gapless numbers. A node lost after
output ends the run with ``ERROR_CODE_NODE_LOST``. No admission queue yet: a run whose
candidates are all full is refused RESOURCE_EXHAUSTED with a retry-after hint.
"""

from __future__ import annotations

import datetime
import time

import structlog

from iop_control_plane.metrics import ControlPlaneMetrics
from iop_control_plane.nodes import NodeSessions
from iop_control_plane.scheduler import Decision, Scheduler
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import EventSink, IopError, acting_caller, code_name, relay
from iop_wire.messages import error_message

__all__ = ["RunRelay"]

_log = structlog.get_logger("iop.control_plane")
_RETRY_AFTER = datetime.timedelta(seconds=1)
_Terminal = tuple[pb.RunEvent, bytes]


class RunRelay:
    """The run handler of requesters' connections (edge, worker, admin)."""

    def __init__(
        self, scheduler: Scheduler, sessions: NodeSessions, metrics: ControlPlaneMetrics, *, attempts: int = 3
    ) -> None:
        self.scheduler = scheduler
        self.sessions = sessions
        self.metrics = metrics
        self.default_attempts = attempts
        """Attempts where the policy sets none."""

    def attempts(self, model: str) -> int:
        """Nodes a run of ``model`` may be tried on: the policy's, else the settings' default."""
        policy = self.scheduler.policy
        model_policy = policy.models.get(model)
        if (model_policy and model_policy.attempts) or "attempts" in policy.defaults.model_fields_set:
            return policy.attempts_for(model)
        return self.default_attempts

    async def run(self, request: pb.RunRequest, sink: EventSink) -> None:
        """Serve one run.request from a requester."""
        caller = acting_caller(sink.peer, request.caller.id)
        log = _log.bind(run_id=request.run_id, requester=sink.connection_id, caller=caller)
        session = request.metadata.get("session") or None
        model, tried = request.model, set[str]()
        last: _Terminal | None = None
        refused: Decision | None = None
        for attempt in range(1, self.attempts(request.model) + 1):
            decision = self.scheduler.choose(model, session=session, caller=caller, exclude=tried)
            log.debug("decision", outcome=decision.outcome, policy=decision.policy, reason=decision.reason)
            self.metrics.decisions.labels(decision.policy, decision.outcome).inc()
            if decision.node_id is None:
                refused = decision
                break
            model, node_id = decision.model, decision.node_id
            tried.add(node_id)
            terminal, lost = await self._attempt(request, sink, caller, decision, attempt)
            if terminal[0].WhichOneof("event") == "complete":
                await sink.forward(*terminal)
                return
            error = terminal[0].error
            if sink.outputs:
                await self._after_output(sink, terminal, node_id=node_id, lost=lost)
                return
            if not (lost or error.retryable) or _past(request):
                await sink.forward(*terminal)
                return
            log.info("failover", node_id=node_id, attempt=attempt, code=code_name(error.code), reason=error.message)
            self.metrics.failovers.labels("connection_lost" if lost else code_name(error.code)).inc()
            last = terminal
        if last is not None:
            await sink.forward(*last)  # the last attempt's failure says more than "no other node"
        elif refused is not None:
            await sink.error(_refusal(refused))

    async def _attempt(
        self, request: pb.RunRequest, sink: EventSink, caller: str, decision: Decision, attempt: int
    ) -> tuple[_Terminal, bool]:
        """Open the run on the decision's node and relay it: (its terminal event, whether the node was lost)."""
        assert decision.node_id is not None
        node_id = decision.node_id
        upstream = pb.RunRequest()
        upstream.CopyFrom(request)
        upstream.run_id = f"{sink.connection_id}.{request.run_id}.{attempt}"
        upstream.model = decision.model
        upstream.caller.id = caller
        connection = self.sessions.connection(node_id)
        try:
            if connection is None:
                raise IopError(pb.ERROR_CODE_UNAVAILABLE, f"node {node_id} has no connection")
            stream = await connection.open_run(upstream)
            terminal = await relay(stream, sink)
        except IopError as exc:
            exc.run_id = request.run_id
            terminal = (pb.RunEvent(error=error_message(exc)), b"")
        finally:
            self.scheduler.registry.finished(node_id, decision.model)
        return terminal, connection is None or connection.closed

    async def _after_output(self, sink: EventSink, terminal: _Terminal, *, node_id: str, lost: bool) -> None:
        if not lost:
            await sink.forward(*terminal)
            return
        _log.warning("node lost mid-run", node_id=node_id, run_id=sink.run_id, outputs=sink.outputs)
        self.metrics.node_lost.inc()
        message = f"node {node_id} was lost after {sink.outputs} output(s); send the run again"
        await sink.error(IopError(pb.ERROR_CODE_NODE_LOST, message, retryable=True))


def _refusal(decision: Decision) -> IopError:
    if decision.outcome == "all_busy":
        message = f"every node for {decision.model!r} is busy ({decision.reason})"
        return IopError(pb.ERROR_CODE_RESOURCE_EXHAUSTED, message, retryable=True, retry_after=_RETRY_AFTER)
    if decision.outcome == "unknown_model":
        return IopError(pb.ERROR_CODE_MODEL_NOT_FOUND, f"no node serves {decision.model!r}")
    return IopError(pb.ERROR_CODE_UNAVAILABLE, decision.reason, retryable=True)


def _past(request: pb.RunRequest) -> bool:
    """Whether the run's deadline has passed (no retry then)."""
    return request.HasField("deadline") and request.deadline.ToNanoseconds() <= time.time_ns()
