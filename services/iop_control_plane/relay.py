"""Runs through the control-plane: place, open on the node, relay, fail over.

A requester's run is served under its own id and opened on the chosen node under
``<requester connection id>.<run id>.<attempt>`` (README, "Runs"). Events are forwarded as
received (:func:`iop_wire.relay`). A run that fails before its first delta (the node's
connection lost, or a retryable error) is tried on another node, up to the policy's attempts
and within its deadline, waiting in the queue when the others are full; the requester sees one
start and gapless numbers.

Migration: a run whose node is lost after output (its connection closed, or the liveness watchdog
closed it) is continued on another node that can continue its model and kind
(``ModelInfo.continuable_kinds``), sent with the output already delivered
(:class:`iop_wire.continuation.Delivered`, fed each delta relayed): the node generates only what
follows, and its complete reports the whole run's usage. Up to the policy's ``migrations`` per run,
within its deadline, waiting in the queue like a failover. A run that cannot be continued (its
output cannot be handed on, no migrations left, no node can continue it, its deadline) ends with
``ERROR_CODE_NODE_LOST`` saying why. A run that arrives with a continuation (an edge continuing
it) is placed only on nodes that can continue it.

Admission (:mod:`iop_control_plane.admission`): a run whose candidates are all full waits in its
model's queue, by priority (the request's, else the policy's default) then the caller's fair share
(the policy's ``fairness``: :mod:`iop_control_plane.fairness`) then arrival, until a slot
frees (:meth:`RunRelay.wake`: a run ended, a node reported or registered) or its deadline (the
request's, else ``queue_timeout``) passes. A full queue or a passed deadline ends the run with
RESOURCE_EXHAUSTED and a retry-after hint from the queue's drain rate. A caller at its policy
limit waits in the queue too. A run cancelled while queued leaves the queue at once. Each run's
prompt is charged to its caller's service as it is admitted, its completion as its attempt ends.

A run its requester cancels mid-attempt is answered at once; its ledger entry waits, off the
requester's path, for the node's count of what it used (:mod:`iop_control_plane.cancelled`).
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from iop_control_plane.admission import HOLD, HOLDS_PER_PASS, AdmissionQueue, Hold, Waiter
from iop_control_plane.cancelled import CancelledRuns
from iop_control_plane.fairness import FairShare, estimated_prompt_tokens
from iop_control_plane.ledger import Attempt, LedgerEntry
from iop_control_plane.metrics import ControlPlaneMetrics
from iop_control_plane.nodes import NodeSessions
from iop_control_plane.policy import Policy
from iop_control_plane.prefix import Prefix, prompt_prefixes
from iop_control_plane.scheduler import Decision, Scheduler
from iop_control_plane.settings import FairnessSettings, LedgerSettings
from iop_control_plane.text import NAME_CHARS, clip
from iop_control_plane.traffic import Traffic
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import EventSink, IopError, RunStream, acting_caller, code_name, relay
from iop_wire.continuation import STOPPED_CODES, Delivered
from iop_wire.errors import Reason
from iop_wire.logs import RateLimitedLog
from iop_wire.messages import error_message
from iop_wire.tls import TRUSTED_ROLES

__all__ = ["RunRelay"]

_log = structlog.get_logger("iop.control_plane")
_RETRY_AFTER = datetime.timedelta(seconds=1)
_DEADLINE_GRACE = 0.5
"""Seconds past a run's deadline the control-plane waits for the node to end it before ending it itself."""
_Terminal = tuple[pb.RunEvent, bytes]
_Log = structlog.typing.FilteringBoundLogger
_HELD_BYTES = 1 << 20
"""Bytes of delta events a run's relay keeps undecoded (about 10,000 tokens) before it decodes them into its
``Delivered`` (which keeps their text, up to its own bound)."""


@dataclass(slots=True)
class _Run:
    """A requester's run while the control-plane serves it: what each step (admit, wait, attempt) reads;
    only its fair-share charging (``fair_model``, ``estimate``) changes as it goes."""

    request: pb.RunRequest
    sink: EventSink
    """Where its events go (the requester's side)."""
    caller: str
    """Who it is for: the requester's certificate, or the caller it acts for."""
    session: str | None
    """Its session-affinity key, if the request names one."""
    priority: int
    """The request's, else the policy's (below 0: background)."""
    entry: LedgerEntry
    """Its ledger row, filled in as it goes."""
    log: _Log
    prompt_tokens: int = 0
    """Its prompt's estimated tokens (charged to its caller when admitted, corrected to the node's count)."""
    prompt: tuple[Prefix, ...] = ()
    """Its prompt's prefix hashes, when a model is placed by prefix (hashed once, on arrival)."""
    fair_model: str = ""
    """The queue whose fair-share counters its attempts are charged to: the model it was admitted
    under (as requested), then the model a failover waited for."""
    estimate: int = 0
    """The prompt's estimate charged at admission and not yet corrected to a node's count."""
    continuing: int | None = None
    """Its kind once it continues delivered output (it arrived with a continuation, or migrated):
    it is placed only on nodes that can continue that kind; None until then."""
    continuation: pb.Continuation | None = None
    """The continuation its next attempts carry (the request's own, else the last migration's)."""
    output: _Output | None = None
    """What the requester was sent, kept to continue the run; None when its policy allows no migration."""
    migrations: int = 0
    """Times this control-plane continued it on another node."""
    upstream: RunStream | None = None
    """Its attempt's stream from the node while it is relayed: where a requester's cancel leaves the node's
    count of what the run used to come (:mod:`iop_control_plane.cancelled`)."""


class _Output:
    """What a run's requester was sent, and when: fed each delta event the relay forwards (``relay``'s
    ``on_delta``), it keeps the delivered output to continue the run (:class:`Delivered`, bounded) and
    times the gap a migration leaves.

    The events' bodies are kept as received and decoded into ``Delivered`` only when a migration
    needs them, or once they hold ``_HELD_BYTES``: reading each delta's fields as it passes would
    cost the relay a fifth of its per-event time, for runs that are almost never cut.
    """

    __slots__ = ("_bodies", "_held", "delivered", "last_at", "resumed")

    def __init__(self, request: pb.RunRequest) -> None:
        self.delivered = Delivered(request)
        self._bodies: list[bytes] = []
        self._held = 0
        self.last_at = 0.0
        """time.monotonic() of the last delta sent."""
        self.resumed: Callable[[float], None] | None = None
        """Called once with the gap (seconds since the last delta) at the next delta: set at a migration."""

    def add(self, event: pb.RunEvent, body: bytes) -> None:
        now = time.monotonic()
        if self.resumed is not None:
            resumed, self.resumed = self.resumed, None
            resumed(now - self.last_at)
        self.last_at = now
        if self.delivered.why_not:  # it cannot be continued: nothing more to keep
            return
        if not body:  # a codec other than protobuf: the event is all there is
            self._fold()
            self.delivered.add(event.delta)
            return
        self._bodies.append(body)
        self._held += len(body)
        if self._held > _HELD_BYTES:
            self._fold()

    def continuation(self) -> pb.Continuation | None:
        """The next attempt's continuation; None when the run cannot be continued (``delivered.why_not``)."""
        self._fold()
        return self.delivered.continuation()

    def _fold(self) -> None:
        """Decode the kept bodies into ``delivered``, in order."""
        for body in self._bodies:
            self.delivered.add(pb.Envelope.FromString(body).run_event.delta)
        self._bodies.clear()
        self._held = 0


class _Queued(Waiter[Decision]):
    """A queued run, and the future its handler waits on."""

    __slots__ = ("continuing", "exclude", "future", "kind", "prompt", "session", "waited_for")

    def __init__(
        self,
        model: str,
        caller: str,
        priority: int,
        since: float,
        session: str | None,
        *,
        exclude: frozenset[str] = frozenset(),
        prompt_tokens: int = 0,
        prompt: tuple[Prefix, ...] = (),
        continuing: int | None = None,
        kind: int | None = None,
    ) -> None:
        super().__init__(model, caller, priority, since, counted=bool(exclude), prompt_tokens=prompt_tokens)
        self.session = session
        self.prompt = prompt
        """Its run's prompt prefixes (the ``prefix`` policy places by them)."""
        self.exclude = exclude
        """Nodes a failover already tried."""
        self.continuing = continuing
        """The kind of run it continues, if it does: only nodes that can continue it take it."""
        self.kind = kind
        """Its run's kind (counting tokens goes only to nodes that can)."""
        self.waited_for: str | None = None
        """The node holding its prompt's prefix it last waited for, full, while another had room."""
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class RunRelay:
    """The run handler of requesters' connections (edge, worker, admin)."""

    def __init__(
        self,
        scheduler: Scheduler,
        sessions: NodeSessions,
        metrics: ControlPlaneMetrics,
        *,
        attempts: int = 3,
        queue_size: int = 256,
        queue_timeout: float = 30.0,
        background_yield: float = 1.0,
        registration_grace: float = 0.0,
        fairness: FairnessSettings | None = None,
        ledger: LedgerSettings | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.sessions = sessions
        self.metrics = metrics
        self.default_attempts = attempts
        """Attempts where the policy sets none."""
        self.fair = FairShare(fairness or FairnessSettings(), self._policy, metrics.registry)
        """Each caller's service, and its metrics."""
        self.queue = AdmissionQueue[Decision](
            queue_size, self._caller_limit, fairness=self.fair.fairness_for, counters=self.fair.counters
        )
        """Runs waiting for a slot, per model; runs in progress per caller."""
        self.queue.on_displaced = self._displaced
        self.queue.on_holds_bound = self._holds_bound
        self._holds_log = RateLimitedLog(every=60.0)
        self.queue_timeout = queue_timeout
        """Seconds a run without a deadline may wait in the queue."""
        self.background_yield = background_yield
        """Seconds at most a background run is held back from nodes with interactive runs awaiting a first output."""
        self._held: asyncio.TimerHandle | None = None
        self.registration_grace = registration_grace
        """Seconds after start a model served before the restart is UNAVAILABLE, not MODEL_NOT_FOUND."""
        self._started = time.monotonic()
        self._over_long_log = RateLimitedLog(every=1.0)
        metrics.watch_queue(self.queue)
        self.traffic = Traffic(metrics.overview_folded)
        """Runs that ended here in the last hour, for overview.show."""
        ledger = ledger or LedgerSettings()
        self.cancelled = CancelledRuns(
            self._record, metrics, wait=ledger.cancel_usage_wait, limit=ledger.cancel_usage_waits
        )
        """Runs their requester cancelled, waiting for their node's count before they are recorded."""

    def attempts(self, model: str) -> int:
        """Nodes a run of ``model`` may be tried on: the policy's, else the settings' default."""
        policy = self.scheduler.policy
        model_policy = policy.models.get(model)
        if (model_policy and model_policy.attempts) or "attempts" in policy.defaults.model_fields_set:
            return policy.attempts_for(model)
        return self.default_attempts

    async def run(self, request: pb.RunRequest, sink: EventSink) -> None:
        """Serve one run.request from a requester, noted in the ledger from its start and recorded when it ends."""
        caller = acting_caller(sink.peer, request.caller.id)
        entry = LedgerEntry(request.run_id, sink.peer.name, sink.connection_id, caller, request.model)
        store = self.sessions.store
        store.run_started(entry)
        terminal: pb.RunEvent | None = None  # None: the requester went away
        run: _Run | None = None
        try:
            if (over_long := _over_long(request, caller)) is not None:
                terminal = await self._refuse_over_long(sink, *over_long)
            elif request.HasField("continuation") and sink.peer.role not in TRUSTED_ROLES:
                # Output delivered elsewhere is vouched for only by a peer that relays runs: from
                # anyone else it would be prompt text that bypasses the estimate and the charge.
                message = "only an edge, worker or control-plane may send a run with a continuation"
                terminal = await _refuse(sink, IopError(pb.ERROR_CODE_PERMISSION_DENIED, message, param="continuation"))
            else:
                run = self._prepared(request, sink, caller, entry)
                terminal = await self._run(run)
        finally:
            entry.outputs, entry.first_output = sink.outputs, sink.first_output_at
            entry.ending(terminal, sink.cancel_reason)
            if terminal is None and run is not None and run.upstream is not None:
                self.cancelled.hold(entry, run.upstream)  # recorded once its node says what it used
            else:
                self._record(entry)

    def _record(self, entry: LedgerEntry) -> None:
        """Hand an ended run to the ledger's writer and the overview."""
        self.sessions.store.run_ended(entry)
        self.traffic.ended(entry)

    def _prepared(self, request: pb.RunRequest, sink: EventSink, caller: str, entry: LedgerEntry) -> _Run:
        """A run received, with what its steps read: priority, prompt estimate and prefixes, what it continues."""
        policy = self.scheduler.policy
        log = _log.bind(run_id=request.run_id, requester=sink.connection_id, caller=caller)
        session = request.metadata.get("session") or None
        priority, prompt_tokens = self.priority(request, caller), estimated_prompt_tokens(request)
        prompt = prompt_prefixes(request) if policy.places_by_prefix(request.model) else ()
        run = _Run(
            request, sink, caller, session, priority, entry, log, prompt_tokens, prompt, request.model, prompt_tokens
        )
        entry.prompt_estimate = prompt_tokens
        if request.HasField("continuation"):
            run.continuing, run.continuation = _kind(request), request.continuation
        if policy.may_migrate(request.model):
            run.output = _Output(request)  # kept only for a run that may be continued
        return run

    async def _refuse_over_long(self, sink: EventSink, field: str, name: str) -> pb.RunEvent:
        """INVALID_ARGUMENT for a name over NAME_CHARS, shown clipped; counted, and logged at most once a second."""
        self.metrics.names_refused.labels(field).inc()
        message = f"{field} is {len(name)} characters, over the limit of {NAME_CHARS}: {clip(name, 64)!r}"
        self._over_long_log.warning(
            field, _log, "run refused", reason=message, requester=sink.connection_id, peer=sink.peer.name
        )
        error = IopError(pb.ERROR_CODE_INVALID_ARGUMENT, message, param="model" if field == "model" else "")
        return await _refuse(sink, error)

    async def _run(self, run: _Run) -> pb.RunEvent:
        admitted = await self._admit(run)
        if isinstance(admitted, Decision) and admitted.node_id is None:
            admitted = self._refusal(admitted)
        if isinstance(admitted, IopError):
            return await _refuse(run.sink, admitted)
        try:
            return await self._serve(run, admitted)
        finally:
            self.queue.ended(run.caller)
            self.wake()

    def _refusal(self, decision: Decision) -> IopError:
        """Why a run placed nowhere is refused: a model nodes served before a restart is UNAVAILABLE
        (retryable) for ``registration_grace`` seconds, while they dial back."""
        since = time.monotonic() - self._started
        recent = since < self.registration_grace and decision.model in self.sessions.store.served_before
        if decision.outcome == "unknown_model" and recent:
            message = (
                f"no node serves {decision.model!r} yet: the control-plane started {since:.0f} s ago"
                " and the nodes that served it are registering again"
            )
            return IopError(pb.ERROR_CODE_UNAVAILABLE, message, retryable=True, retry_after=_RETRY_AFTER)
        return _refusal(decision)

    def priority(self, request: pb.RunRequest, caller: str) -> int:
        """The run's priority: the request's, else the policy's for its model and caller (below 0: background)."""
        return request.priority or self.scheduler.policy.priority_for(request.model, caller)

    def _caller_limit(self, caller: str) -> int | None:
        return self.scheduler.policy.caller_limit(caller)  # the policy in force now: it may be reloaded

    def _policy(self) -> Policy:
        return self.scheduler.policy

    def _displaced(self, waiter: Waiter[Decision]) -> None:
        """A waiter gave its place in a full queue to a caller under its share: its handler refuses it."""
        assert isinstance(waiter, _Queued)
        self._stop_waiting(waiter)
        self.fair.displaced(waiter.model, waiter.caller)
        if not waiter.future.done():
            waiter.future.set_result(None)

    def _stop_waiting(self, waiter: _Queued) -> None:
        """``waiter`` no longer waits for the node it did (if any): that node's load stops counting it."""
        node_id, waiter.waited_for = waiter.waited_for, None
        if node_id is not None:
            waiting = self.scheduler.waiting
            waiting[node_id] -= 1
            if waiting[node_id] <= 0:
                del waiting[node_id]

    def _holds_bound(self, model: str) -> None:
        """A pick of ``model``'s queue passed over HOLDS_PER_PASS runs waiting for their prefix's node, and ended."""
        self.metrics.holds_bound.inc()
        self._holds_log.warning(
            "holds",
            _log,
            "queue pick ended at the bound of runs waiting for their prefix's node; the rest wait for the next",
            model=model,
            bound=HOLDS_PER_PASS,
        )

    def wake(self) -> None:
        """A slot may have freed (a run ended, a node reported, registered or was undrained): admit waiters."""
        if not self.queue.waiting():
            return
        for waiter in self.queue.admit(self._place_waiter, time.monotonic()):
            assert isinstance(waiter, _Queued)
            if not waiter.future.done():
                waiter.future.set_result(None)

    def _choose(self, run: _Run, model: str, exclude: frozenset[str] = frozenset()) -> Decision:
        background = run.priority < 0 and self.background_yield > 0
        began = time.perf_counter()
        decision = self.scheduler.choose(
            model,
            session=run.session,
            caller=run.caller,
            exclude=exclude,
            background=background,
            prompt=run.prompt,
            continuing=run.continuing,
            kind=_kind(run.request),
        )
        self.metrics.decision_time.observe(time.perf_counter() - began)
        run.log.debug("decision", outcome=decision.outcome, policy=decision.policy, reason=decision.reason)
        self._count(decision)
        if decision.yielded:
            self.metrics.background_yields.inc()
        return decision

    def _place_waiter(self, waiter: Waiter[Decision]) -> Decision | Hold | None:
        assert isinstance(waiter, _Queued)
        held = time.monotonic() - waiter.since
        background = waiter.priority < 0 and held < self.background_yield
        began = time.perf_counter()
        decision = self.scheduler.choose(
            waiter.model,
            session=waiter.session,
            caller=waiter.caller,
            exclude=waiter.exclude,
            background=background,
            prompt=waiter.prompt,
            continuing=waiter.continuing,
            kind=waiter.kind,
            waiting_for=waiter.waited_for,
        )
        self.metrics.decision_time.observe(time.perf_counter() - began)
        if decision.yielded and self._held is None:  # placed anyway once held for background_yield
            self._held = asyncio.get_running_loop().call_later(self.background_yield - held, self._hold_ended)
        if decision.outcome == "all_busy":
            if decision.waits_for is None:
                return None  # every candidate is full: whatever it waited for, it still does
            if waiter.waited_for != decision.waits_for:
                if waiter.waited_for is None:
                    self.metrics.waits_for_prefix(decision, self.scheduler.policy.models)
                self._stop_waiting(waiter)
                self.scheduler.waiting[decision.waits_for] += 1
                waiter.waited_for = decision.waits_for
                _log.debug(
                    "waiting for the node holding the prompt's prefix", model=waiter.model, reason=decision.reason
                )
            return HOLD
        self._stop_waiting(waiter)
        self._count(decision)
        if decision.node_id is not None and not waiter.counted:
            self.queue.started(waiter.caller)
        return decision

    def _count(self, decision: Decision) -> None:
        """A decision in the metrics: by policy and outcome, and the prefix policy's by reason."""
        self.metrics.decisions.labels(decision.policy, decision.outcome).inc()
        self.metrics.placed_by_prefix(decision, self.scheduler.policy.models)

    def _hold_ended(self) -> None:
        self._held = None
        self.wake()

    def _awaiting_first_output(self, node_id: str) -> Callable[[], None]:
        """Count an interactive run on ``node_id`` until the returned function is called (once counts)."""
        node = self.scheduler.registry.nodes.get(node_id)
        if node is None:
            return lambda: None
        node.awaiting_first_output += 1

        def arrived() -> None:
            nonlocal node
            if node is not None:
                node.awaiting_first_output -= 1
                if not node.awaiting_first_output:
                    self.wake()  # background runs held back from the node may go
                node = None

        return arrived

    async def _admit(self, run: _Run) -> Decision | IopError:
        """A decision for the run's first attempt, placed or refused, waiting in the queue if it must."""
        model, caller = run.request.model, run.caller
        if not self.queue.ahead(model, run.priority) and self.queue.may_start(caller):
            decision = self._choose(run, model)
            if decision.outcome != "all_busy":
                if decision.node_id is not None:
                    self.queue.started(caller)
                    self.queue.counters.charge(model, caller, prompt=run.prompt_tokens)
                return decision
        return await self._wait(run, model)

    async def _wait(self, run: _Run, model: str, exclude: frozenset[str] = frozenset()) -> Decision | IopError:
        """Wait in ``model``'s queue for a slot (a failover: on a node not in ``exclude``)."""
        caller, log = run.caller, run.log
        waiter = _Queued(
            model,
            caller,
            run.priority,
            time.monotonic(),
            run.session,
            exclude=exclude,
            prompt_tokens=run.prompt_tokens,
            prompt=run.prompt,
            continuing=run.continuing,
            kind=_kind(run.request),
        )
        timeout = self._timeout(run.request)
        if timeout <= 0 or not self.queue.offer(waiter):
            self.metrics.queue_refused.labels("full" if timeout > 0 else "deadline").inc()
            full = f"the queue for {model!r} is full ({self.queue.depth(model)} waiting)"
            if timeout > 0:
                return self._exhausted(model, full, reason=pb.ERROR_REASON_QUEUE_FULL)
            return self._exhausted(model, "the run's deadline has passed")
        log.debug("queued", model=model, priority=run.priority, depth=self.queue.depth(model), timeout=timeout)
        self.wake()  # the waiters ahead may all be held by their callers' limits
        try:
            if not waiter.future.done():
                await asyncio.wait({waiter.future}, timeout=timeout)
        except asyncio.CancelledError:
            self._leave(waiter, log, "cancelled")
            raise
        if waiter.displaced:  # out of the queue already
            self._observe(waiter, log, "displaced")
            full = f"the queue for {model!r} is full; this run's place went to a caller under its fair share"
            return self._exhausted(model, full, reason=pb.ERROR_REASON_QUEUE_FULL)
        if waiter.outcome is None:
            if not (waiter.counted or self.queue.may_start(caller)):  # its own limit held it, not the nodes
                self._leave(waiter, log, "caller_limit")
                message = f"caller {caller!r} is at its policy's limit of runs in progress for {timeout:.3g} s"
                return self._exhausted(model, message, reason=pb.ERROR_REASON_CALLER_LIMIT)
            self._leave(waiter, log, "deadline")
            return self._exhausted(model, f"no slot for {model!r} within {timeout:.3g} s; every node is busy")
        self._observe(waiter, log, "admitted")
        return waiter.outcome

    def _leave(self, waiter: _Queued, log: _Log, outcome: str) -> None:
        """A waiter leaves without running: out of the queue, or, if placed meanwhile, its slot given back."""
        self._stop_waiting(waiter)
        decision = waiter.outcome
        if decision is not None and decision.node_id is not None:
            self.scheduler.registry.finished(decision.node_id, decision.model)
            if not waiter.counted:
                self.queue.ended(waiter.caller)
            self.wake()
        else:
            self.queue.withdraw(waiter)
        self._observe(waiter, log, outcome)

    def _observe(self, waiter: _Queued, log: _Log, outcome: str) -> None:
        waited = time.monotonic() - waiter.since
        self.metrics.queue_wait.labels(outcome).observe(waited)
        self.fair.observe_wait(waiter.caller, waited)
        log.debug("dequeued", model=waiter.model, outcome=outcome, waited=round(waited, 4))

    def _timeout(self, request: pb.RunRequest) -> float:
        """Seconds the run may wait in the queue: until its deadline, else ``queue_timeout``."""
        if request.HasField("deadline"):
            return (request.deadline.ToNanoseconds() - time.time_ns()) / 1e9
        return self.queue_timeout

    def _exhausted(self, model: str, message: str, *, reason: Reason = pb.ERROR_REASON_UNSPECIFIED) -> IopError:
        retry_after = datetime.timedelta(seconds=self.queue.retry_after(model, time.monotonic()))
        return IopError(
            pb.ERROR_CODE_RESOURCE_EXHAUSTED, message, retryable=True, retry_after=retry_after, reason=reason
        )

    async def _serve(self, run: _Run, decision: Decision) -> pb.RunEvent:
        """Run the admitted run on ``decision``'s node, failing over to others before output and
        continuing it elsewhere after, while it may: its terminal event."""
        request, sink = run.request, run.sink
        tried = frozenset[str]()
        last: _Terminal | None = None
        attempts = self.attempts(request.model)
        failed = 0  # attempts that failed before output
        while True:
            node_id = decision.node_id
            assert node_id is not None
            tried |= {node_id}
            terminal, lost = await self._attempt(run, decision)
            if terminal[0].WhichOneof("event") == "complete":
                await sink.forward(*terminal)
                return terminal[0]
            error = terminal[0].error
            if sink.outputs:
                # A continuing node that fails before its own first output (it refused the
                # continuation, or was full) did not cut the run: another node may continue it.
                # A node stopping (its drain's grace ran out, SIGTERM) ends its runs SHUTTING_DOWN
                # over a connection still open: as good as lost for the run.
                lost = lost or (error.retryable and error.code in STOPPED_CODES)
                refused = not lost and not run.entry.attempts[-1].outputs and error.code not in _ENDS_THE_RUN
                if not (lost or refused):
                    await sink.forward(*terminal)
                    return terminal[0]
                refusal = ""
                if refused:
                    refusal = f"{code_name(error.code)}: {error.message}"
                    run.log.info("continuation refused", node_id=node_id, reason=refusal)
                    if run.output is not None:  # always, for a continued attempt
                        run.output.delivered.refused()
                moved = await self._migrate(run, decision, tried, refusal=refusal)
                if isinstance(moved, IopError):
                    await sink.error(moved)
                    return pb.RunEvent(error=error_message(moved))
                decision = moved
                continue
            if not (lost or error.retryable) or _past(request):
                await sink.forward(*terminal)
                return terminal[0]
            code = code_name(error.code)
            run.log.info("failover", node_id=node_id, attempt=failed + 1, code=code, reason=error.message)
            self.metrics.failovers.labels("connection_lost" if lost else code_name(error.code)).inc()
            last, failed = terminal, failed + 1
            if failed >= attempts:
                break
            found = await self._next_node(run, decision.model, tried)
            if isinstance(found, IopError) or found.node_id is None:
                break
            decision = found
        assert last is not None  # the first attempt always runs
        await sink.forward(*last)  # the last attempt's failure says more than "no other node"
        return last[0]

    async def _next_node(self, run: _Run, model: str, tried: frozenset[str]) -> Decision | IopError:
        """A node not in ``tried`` for the run's next attempt, waiting in the queue while the others
        are full, within its deadline: a decision (placed, or why none) or why the wait failed."""
        decision = self._choose(run, model, exclude=tried)
        if decision.outcome != "all_busy":
            return decision
        run.fair_model = model  # the counters that queue orders it by
        return await self._wait(run, model, exclude=tried)

    async def _migrate(
        self, run: _Run, lost: Decision, tried: frozenset[str], *, refusal: str = ""
    ) -> Decision | IopError:
        """The run's node was lost after output (or, ``refusal`` saying how, refused to continue it): a
        node to continue it on, its continuation set, or the NODE_LOST error saying why it is not
        continued (counted by outcome, logged either way)."""
        sink, output = run.sink, run.output
        node_id = lost.node_id
        log = run.log.bind(node_id=node_id, outputs=sink.outputs)
        limit = self.scheduler.policy.migrations_for(lost.model)
        continuation = output.continuation() if output is not None else None
        found: Decision | IopError | None = None
        if output is None or not limit:
            outcome, why = "limit", f"the policy's migrations is 0 for {lost.model!r}"
        elif continuation is None:
            outcome, why = "not_continuable", output.delivered.why_not
        elif run.migrations >= limit:
            why = f"it was continued {run.migrations} time(s) already, the policy's migrations for {lost.model!r}"
            outcome = "limit"
        elif _past(run.request):
            outcome, why = "deadline", "its deadline has passed"
        else:
            run.continuing = _kind(run.request)
            found = await self._next_node(run, lost.model, tried)
            outcome, why = _placed(found)
        if outcome != "continued":
            self.metrics.migrations.labels(outcome).inc()
            self.metrics.node_lost.inc()
            log.warning("node lost mid-run", reason=why, outcome=outcome)
            what = f"refused to continue the run ({refusal})" if refusal else "was lost"
            message = (
                f"node {node_id} {what} after {sink.outputs} output(s) and the run was not continued: {why};"
                " send the run again"
            )
            return IopError(pb.ERROR_CODE_NODE_LOST, message, retryable=True)
        assert isinstance(found, Decision) and output is not None and continuation is not None
        run.continuation, run.migrations = continuation, run.migrations + 1
        run.entry.migrations = run.migrations
        output.delivered.sent(continuation)
        self.metrics.migrations.labels("continued").inc()
        to = found.node_id
        log = log.bind(to_node_id=to, migration=run.migrations, tokens=continuation.completion_tokens)
        log.debug("run continuing")
        record_at = len(run.entry.attempts)  # the next attempt's record

        def resumed(gap: float) -> None:  # at the continued attempt's first output
            self.metrics.migration_gap.observe(gap)
            run.entry.attempts[record_at].gap = gap
            log.info("run migrated", gap=round(gap, 4))

        output.resumed = resumed
        return found

    async def _attempt(self, run: _Run, decision: Decision) -> tuple[_Terminal, bool]:
        """Open the run on the decision's node and relay it: (its terminal event, whether the node was lost).

        An interactive run (priority >= 0) counts as awaiting its first output on the node until
        then: background runs are held back from the node meanwhile (``Scheduler.choose``).
        """
        assert decision.node_id is not None
        request, sink, entry, node_id = run.request, run.sink, run.entry, decision.node_id
        continuation, run.upstream = run.continuation, None
        record = Attempt(node_id, decision.model, time.monotonic(), outcome="cancelled")
        record.continued = continuation is not None
        entry.attempts.append(record)
        self.sessions.store.run_placed(entry)
        upstream = _upstream(run, decision.model, len(entry.attempts))
        connection = self.sessions.connection(node_id)
        first_output = self._awaiting_first_output(node_id) if run.priority >= 0 else None
        on_delta = run.output.add if run.output is not None else None
        usage: pb.Usage | None = None
        before = sink.outputs
        try:
            if connection is None:
                raise IopError(pb.ERROR_CODE_UNAVAILABLE, f"node {node_id} has no connection")
            stream = run.upstream = await connection.open_run(upstream)
            async with asyncio.timeout(_remaining(request)):  # None: no deadline
                # the deadline cancels the node's run
                terminal = await relay(stream, sink, first_output=first_output, on_delta=on_delta)
            run.upstream = None  # its end was read: nothing left to wait for
            if terminal[0].complete.HasField("usage"):
                usage = terminal[0].complete.usage
        except TimeoutError:
            exc = IopError(pb.ERROR_CODE_DEADLINE_EXCEEDED, f"the run's deadline passed on node {node_id}")
            exc.run_id = request.run_id
            terminal = (pb.RunEvent(error=error_message(exc)), b"")
        except IopError as exc:
            exc.run_id = request.run_id
            terminal = (pb.RunEvent(error=error_message(exc)), b"")
        finally:
            record.ended, record.outputs = time.monotonic(), sink.outputs - before
            if continuation is not None:
                record.continuation_prompt_tokens = _cost(continuation, usage)
            if first_output is not None:
                first_output()
            self.scheduler.registry.finished(node_id, decision.model)
            # Charged before the slot this frees is given; the estimate is corrected once, by the first
            # attempt that served. A continued attempt's usage counts the whole run: only its own part is charged.
            served = _own_part(usage, continuation)
            if self.fair.charge_served(
                run.fair_model, run.caller, estimate=run.estimate, usage=served, outputs=record.outputs
            ):
                run.estimate = 0
            self.wake()
        lost = connection is None or connection.closed
        record.outcome, record.reason = _outcome(terminal[0], lost)
        return terminal, lost


_ENDS_THE_RUN = frozenset({pb.ERROR_CODE_DEADLINE_EXCEEDED, pb.ERROR_CODE_CANCELLED})
"""Errors of a continued attempt before its own output that end the run rather than send it to another node."""


def _upstream(run: _Run, model: str, attempt: int) -> pb.RunRequest:
    """The run's request as its node is sent it for attempt number ``attempt`` (from 1)."""
    request = run.request
    upstream = pb.RunRequest()
    upstream.CopyFrom(request)
    upstream.run_id = f"{run.sink.connection_id}.{request.run_id}.{attempt}"
    upstream.model = model
    upstream.caller.id = run.caller
    if run.continuation is not None:
        upstream.continuation.CopyFrom(run.continuation)
    return upstream


def _kind(request: pb.RunRequest) -> int:
    """The request's kind (unset means chat)."""
    return request.kind or pb.RUN_KIND_CHAT


def _placed(found: Decision | IopError) -> tuple[str, str]:
    """A migration's outcome and why, from the decision (or failed wait) for its next node."""
    if isinstance(found, IopError):  # the wait in the queue failed: full, else no slot before the deadline
        return ("queue_full" if found.reason == pb.ERROR_REASON_QUEUE_FULL else "deadline"), found.message
    if found.node_id is None:
        return "no_node", found.reason
    return "continued", ""


def _cost(continuation: pb.Continuation, usage: pb.Usage | None) -> int:
    """Prompt tokens a continued attempt re-read: from the node's usage (the whole run's, less the
    earlier continuations'), else the delivered tokens it was sent (an estimate)."""
    if usage is not None and usage.continuation_prompt_tokens:
        return max(usage.continuation_prompt_tokens - continuation.continuation_prompt_tokens, 0)
    return continuation.completion_tokens


def _own_part(usage: pb.Usage | None, continuation: pb.Continuation | None) -> pb.Usage | None:
    """``usage`` of a continued attempt less the completion tokens earlier attempts delivered (charged then)."""
    if usage is None or continuation is None:
        return usage
    own = pb.Usage()
    own.CopyFrom(usage)
    own.completion_tokens = max(usage.completion_tokens - continuation.completion_tokens, 0)
    return own


def _outcome(event: pb.RunEvent, lost: bool) -> tuple[str, str]:
    """An attempt's outcome and reason for the ledger, from its terminal event."""
    if event.WhichOneof("event") == "complete":
        return "completed", ""
    reason = f"{code_name(event.error.code)}: {event.error.message}"
    if lost:
        return "node_lost", reason
    return ("cancelled" if event.error.code == pb.ERROR_CODE_CANCELLED else "failed"), reason


def _refusal(decision: Decision) -> IopError:
    if decision.outcome == "all_busy":
        message = f"every node for {decision.model!r} is busy ({decision.reason})"
        return IopError(pb.ERROR_CODE_RESOURCE_EXHAUSTED, message, retryable=True, retry_after=_RETRY_AFTER)
    if decision.outcome == "unknown_model":
        return IopError(pb.ERROR_CODE_MODEL_NOT_FOUND, f"no node serves {decision.model!r}")
    if decision.outcome == "unsupported_kind":  # the request asks what no backend of the model does
        return IopError(pb.ERROR_CODE_INVALID_ARGUMENT, decision.reason, param="model")
    return IopError(pb.ERROR_CODE_UNAVAILABLE, decision.reason, retryable=True)


def _remaining(request: pb.RunRequest) -> float | None:
    """Seconds until the run's deadline plus a grace for the node's own DEADLINE_EXCEEDED; None: no deadline."""
    if not request.HasField("deadline"):
        return None
    return max((request.deadline.ToNanoseconds() - time.time_ns()) / 1e9, 0.0) + _DEADLINE_GRACE


def _past(request: pb.RunRequest) -> bool:
    """Whether the run's deadline has passed (no retry then)."""
    return request.HasField("deadline") and request.deadline.ToNanoseconds() <= time.time_ns()


def _over_long(request: pb.RunRequest, caller: str) -> tuple[str, str] | None:
    """(field, name) of the run's first name over NAME_CHARS: model, caller or run id; None if none is."""
    for field, name in (("model", request.model), ("caller", caller), ("run_id", request.run_id)):
        if len(name) > NAME_CHARS:
            return field, name
    return None


async def _refuse(sink: EventSink, error: IopError) -> pb.RunEvent:
    """End the run with ``error`` before it reached a node: its terminal event, for the ledger."""
    await sink.error(error)
    return pb.RunEvent(error=error_message(error))
