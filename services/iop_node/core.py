"""The node's application core: takes run requests from any transport and sees each through.

For every run: check and route it, record it, wait for a slot, start it, let the adapter
execute it through a metered sink, and record how it ended, whatever the ending (completed,
failed, cancelled in the queue or mid-stream, or cut short by the deadline).

The route table (router, admissions, an adapter per model) is replaced whole by a reload
(:meth:`Node.replace_routes`), in one step of the event loop: a run takes the route, admission
and adapter of the table it was resolved in and keeps them to its end. The admissions and adapter
instances a reload leaves behind *retire*: their runs finish within the reload's grace, the ones
still going then end retryably (SHUTTING_DOWN), and each instance no route uses is closed.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import structlog

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.admission import Admission
from iop_node.domain import ExecutionSpec, RunRecord, RunStatus
from iop_node.metrics import ModelMetrics, NodeMetrics
from iop_node.ports import Adapter, RunStore
from iop_node.reload import RouteChanges
from iop_node.router import Router
from iop_node.settings import RouteSettings
from iop_wire.errors import IopError, code_name
from iop_wire.runs import EventSink as WireSink
from iop_wire.tls import acting_caller

__all__ = ["Node"]

_log = structlog.get_logger("iop.node")
_CANCELLED = code_name(pb.ERROR_CODE_CANCELLED)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class MeteredSink:
    """The adapters' EventSink: forwards to the wire, timing tokens and counting usage."""

    __slots__ = (
        "_chars",
        "_deltas",
        "_ids",
        "_last",
        "_metrics",
        "_per_delta",
        "_prompt",
        "_record",
        "_spec",
        "_started",
        "_untokenized",
        "_wire",
        "completed",
    )

    def __init__(self, wire: WireSink, spec: ExecutionSpec, record: RunRecord, metrics: ModelMetrics) -> None:
        self._wire, self._spec, self._record = wire, spec, record
        self._metrics = metrics
        self._started = time.monotonic()
        self._last = 0.0
        self._chars = 0
        self._ids = 0
        """Token ids the deltas carried."""
        self._untokenized = False
        """Whether some delta with text carried no token ids (then the ids do not count the output)."""
        self._deltas = 0
        """Deltas with text and no token ids."""
        self._prompt: int | None = None
        """The prompt's tokens as the backend counted them (:meth:`counting`); None: estimated from its text."""
        self._per_delta = False
        """Whether the adapter said each ``delta`` is one token."""
        self.completed = False

    def counting(self, prompt_tokens: int, *, token_per_delta: bool = False) -> None:
        self._prompt, self._per_delta = prompt_tokens, token_per_delta

    async def delta(self, text: str) -> None:
        self._tick(len(text))
        self._untokenized = self._untokenized or bool(text)
        self._deltas += bool(text)
        try:
            await self._wire.delta(text)
        except UnicodeEncodeError as exc:  # a lone surrogate, e.g. half an emoji from a JSON backend
            raise IopError(
                pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR, f"the backend's text is not valid Unicode: {exc}"
            ) from None

    async def output(self, delta: pb.RunDelta) -> None:
        """Text and tool calls' arguments alike are output: counted as characters, and a delta carrying
        either (without token ids) is a token when the adapter streams a token a delta."""
        arguments = sum(len(call.arguments) for call in delta.tool_calls)
        self._tick(len(delta.text) + arguments)
        self._ids += len(delta.token_ids)
        produced = bool(delta.text) or bool(arguments)
        self._untokenized = self._untokenized or (produced and not delta.token_ids)
        self._deltas += produced and not delta.token_ids
        await self._wire.output(delta)

    def _tick(self, chars: int) -> None:
        """Time this output (first token, or since the last one) and count its characters."""
        now = time.monotonic()
        if self._last:
            self._metrics.inter_token.observe(now - self._last)
        else:
            self._record.first_token_at = _now()
            self._metrics.time_to_first_token.observe(now - self._started)
        self._last = now
        self._chars += chars

    async def complete(
        self,
        finish_reason: pb.FinishReason.ValueType,
        usage: pb.Usage | None = None,
        timings: pb.Timings | None = None,
    ) -> None:
        usage = usage or self.estimated_usage()
        self._record_usage(usage)
        self._record.finish_reason = pb.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_").lower()
        self.completed = True
        await self._wire.complete(finish_reason, usage, self._timings(timings))

    async def counted(self, tokens: int) -> None:
        self._record_usage(pb.Usage())
        self._record.finish_reason = "stop"
        self.completed = True
        await self._wire.complete(pb.FINISH_REASON_STOP, pb.Usage(), self._timings(None), counted_tokens=tokens)

    def estimated_usage(self) -> pb.Usage:
        """Usage counted on the node: the prompt as the backend counted it (:meth:`counting`), else at ~4
        characters a token; and the output streamed so far: its token ids when every delta carried them,
        one token a delta when the adapter said so, none when there was none, else its text at ~4
        characters a token. Estimated only when one of the two is."""
        prompt = self._prompt
        if self._ids and not self._untokenized:
            completion: int | None = self._ids
        elif self._per_delta and not self._ids:
            completion = self._deltas  # one token a delta of text
        elif not self._chars and not self._ids:
            completion = 0  # nothing streamed: nothing to estimate
        else:
            completion = None
        return pb.Usage(
            prompt_tokens=_estimate(len(self._spec.prompt_text())) if prompt is None else prompt,
            completion_tokens=_estimate(self._chars) if completion is None else completion,
            estimated=prompt is None or completion is None,
        )

    def record_unfinished(self) -> None:
        """A run that ends without ``complete`` (failed, cancelled) still records what it streamed."""
        if not self.completed:
            self._record_usage(self.estimated_usage())

    def _record_usage(self, usage: pb.Usage) -> None:
        record = self._record
        record.prompt_tokens, record.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        record.usage_estimated = usage.estimated

    def annotate(self, key: str, value: str) -> None:
        """``value`` in the run record under ``key``; ``schema_bounded`` ("<what>: <bound>") is counted too."""
        if key == "schema_bounded":
            self._metrics.schema_bounded.labels(value.rpartition(": ")[2]).inc()
        if key == "stderr_tail":
            self._record.stderr_tail = value
        else:
            self._record.extra[key] = value

    def _timings(self, reported: pb.Timings | None) -> pb.Timings:
        """The backend's timings where it reported them, the node's own measurements otherwise.

        Each reported field replaces the node's whole (MergeFrom would merge the Durations' fields,
        keeping the node's seconds beside the backend's nanoseconds)."""
        record, timings = self._record, pb.Timings()
        assert record.received_at is not None and record.started_at is not None
        timings.queued.FromTimedelta(record.started_at - record.received_at)
        if record.first_token_at is not None:
            timings.time_to_first_token.FromTimedelta(record.first_token_at - record.started_at)
        timings.generation.FromTimedelta(_now() - record.started_at)
        if reported is not None:
            for field, value in reported.ListFields():
                getattr(timings, field.name).CopyFrom(value)
        return timings


def _used(record: RunRecord) -> pb.Usage:
    """What a run that ended without completing used, for its terminal error: what it streamed
    (``MeteredSink.record_unfinished``), or nothing when it never started."""
    if record.started_at is None:
        return pb.Usage()
    return pb.Usage(
        prompt_tokens=record.prompt_tokens,
        completion_tokens=record.completion_tokens,
        estimated=record.usage_estimated,
    )


def _estimate(chars: int) -> int:
    """Tokens in ``chars`` characters of text, by the usual ~4 characters per token."""
    return (chars + 3) // 4


class Node:
    """Executes runs; implements the wire's Handler for every connection it serves."""

    def __init__(
        self,
        *,
        node_id: str,
        router: Router,
        adapters: Mapping[str, Adapter],
        store: RunStore,
        metrics: NodeMetrics,
        version: str,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.node_id = node_id
        self.draining = False
        self._router, self._store, self._metrics = router, store, metrics
        self.adapters = dict(adapters)
        self._version, self._labels = version, dict(labels or {})
        self._listeners: list[Callable[[], None]] = []
        self._running: dict[asyncio.Task[Any], WireSink] = {}
        self._shutting_down: set[asyncio.Task[Any]] = set()
        self._adapter_of = {r.model: self.adapters[r.adapter_key] for r in router.routes}
        self.admissions = {r.model: self._admission(r) for r in router.routes}
        self._held: dict[asyncio.Task[Any], Admission] = {}
        """Run -> the admission of the route it was resolved to (from then to its end)."""
        self._retiring: set[Admission] = set()
        """Admissions of routes a reload removed or replaced, while runs hold them."""
        self._removed: dict[str, float] = {}
        """Model a reload removed -> until when (loop time) its runs are refused retryably."""
        self._retirements: set[asyncio.Task[None]] = set()
        self._released = asyncio.Event()
        self.generation = 0
        """Route tables served so far, less one: each reload that switches the table adds one."""
        self._idle = asyncio.Event()
        self._idle.set()

    def _admission(self, route: RouteSettings) -> Admission:
        return Admission(route.model, route.max_concurrency, route.queue_size, self._load_changed)

    # -- the wire Handler --------------------------------------------------------------------

    async def run(self, request: pb.RunRequest, sink: WireSink) -> None:
        """Execute one run and record it; errors propagate to the wire as error events."""
        record = RunRecord(
            run_id=request.run_id,
            node_id=self.node_id,
            model=request.model,
            status=RunStatus.RUNNING,
            # Identity is the certificate's; a named caller only from a role that acts for others.
            caller=acting_caller(sink.peer, request.caller.id),
            peer=sink.peer.name,
            connection=sink.connection_id,
            received_at=_now(),
        )
        task = asyncio.current_task()
        assert task is not None
        self._running[task] = sink
        try:
            await self._run(request, sink, record)
            record.status = RunStatus.COMPLETED
        except asyncio.CancelledError:
            reason = sink.cancel_reason or "cancelled"
            self._finish(record, RunStatus.CANCELLED, _CANCELLED, reason)
            if task in self._shutting_down:  # ended by a drain: tell the client to go elsewhere
                raise IopError(pb.ERROR_CODE_SHUTTING_DOWN, sink.cancel_reason, usage=_used(record)) from None
            # The wire would say CANCELLED too, without what the run used.
            raise IopError(pb.ERROR_CODE_CANCELLED, reason, usage=_used(record)) from None
        except IopError as exc:
            self._finish(record, RunStatus.FAILED, exc.name, exc.message)
            if exc.usage is None:
                exc.usage = _used(record)
            raise
        except Exception as exc:
            _log.exception("run failed unexpectedly", node_id=self.node_id, run_id=request.run_id)
            internal = IopError(pb.ERROR_CODE_INTERNAL, "internal error in the node", usage=_used(record))
            self._finish(record, RunStatus.FAILED, internal.name, f"internal error: {type(exc).__name__}")
            raise internal from exc
        finally:
            self._running.pop(task, None)
            self._shutting_down.discard(task)
            routed = self._held.pop(task, None) is not None
            self._released.set()
            record.finished_at = _now()
            try:
                await self._store.record_end(record)
            except RuntimeError:  # the store closed while this run was still stopping (shutdown)
                _log.warning("run outcome not recorded", node_id=self.node_id, run_id=record.run_id)
            label = record.model if routed else "(unrouted)"  # bounded label values: routed models only
            self._metrics.runs.labels(label, record.status.value).inc()
            _log.debug("run finished", node_id=self.node_id, run_id=record.run_id, status=record.status.value)

    async def _run(self, request: pb.RunRequest, sink: WireSink, record: RunRecord) -> None:
        try:
            if self.draining:
                raise IopError(pb.ERROR_CODE_SHUTTING_DOWN, f"node {self.node_id} is draining; send the run elsewhere")
            self._refuse_removed(request.model)
            spec = self._router.resolve(request)
            # In the same step as resolving: the run keeps this table's route to its end.
            adapter, admission = self._adapter_of[request.model], self.admissions[request.model]
            task = asyncio.current_task()
            assert task is not None
            self._held[task] = admission
        finally:
            await self._store.record_start(record)
        record.adapter = spec.adapter
        seconds = None
        if spec.deadline is not None:
            seconds = (spec.deadline - _now()).total_seconds()
            if seconds <= 0:
                raise IopError(pb.ERROR_CODE_DEADLINE_EXCEEDED, "the run's deadline passed before it started")
        try:
            async with asyncio.timeout(seconds) as scope:  # None: no limit
                await self._execute(spec, adapter, admission, sink, record)
        except TimeoutError:
            if not scope.expired():
                raise  # a timeout of the adapter's own
            raise IopError(pb.ERROR_CODE_DEADLINE_EXCEEDED, "the run's deadline passed") from None

    async def _execute(
        self, spec: ExecutionSpec, adapter: Adapter, admission: Admission, sink: WireSink, record: RunRecord
    ) -> None:
        await admission.acquire(spec.request.priority)
        try:
            record.started_at = _now()
            await sink.start(node_id=self.node_id, model=spec.target_model, adapter=spec.adapter)
            metered = MeteredSink(sink, spec, record, self._metrics.model(spec.request.model))
            try:
                await adapter.execute(spec, metered)
            finally:
                metered.record_unfinished()
            if not metered.completed:
                raise IopError(pb.ERROR_CODE_INTERNAL, f"adapter {spec.adapter} ended without completing the run")
        finally:
            admission.release()

    def _finish(self, record: RunRecord, status: RunStatus, code: str, message: str) -> None:
        record.status, record.error_code, record.error_message = status, code, message
        if status is RunStatus.FAILED and record.adapter:
            self._metrics.adapter_errors.labels(record.adapter, code).inc()

    async def recorded(self, run_id: str) -> RunRecord | None:
        """This node's record of the run ``run_id`` (the id its requester sent), once written; None if it
        has none (a run store shared by several nodes holds theirs too: only this node's answer)."""
        record = await self._store.get(run_id)
        return record if record is not None and record.node_id == self.node_id else None

    async def capabilities(self) -> pb.CapabilityResponse:
        """What this node serves now."""
        response = pb.CapabilityResponse(
            node_id=self.node_id,
            version=self._version,
            max_concurrency=sum(a.capacity for a in self.admissions.values()),
            labels=self._labels,
        )
        for adapter in list(self.adapters.values()):
            # An instance a reload kept for its other routes still knows the models it no longer serves.
            models = [model for model in await adapter.capabilities() if self._adapter_of.get(model.name) is adapter]
            for model in models:
                admission = self.admissions.get(model.name)
                model.max_concurrency = admission.capacity if admission else 0
            response.adapters.add(name=adapter.name, models=models)
        return response

    def drain(self, grace: float | None = None) -> None:
        """Stop taking runs; after ``grace`` seconds, end the runs still going retryably."""
        self.draining = True
        self._load_changed()
        if grace is not None:
            asyncio.get_running_loop().call_later(
                grace, self._end_running, "the node was drained and its grace ran out"
            )

    def _end_running(self, reason: str, holding: Collection[Admission] | None = None) -> int:
        """End the runs going (only those holding one of ``holding``, when given) retryably; how many."""
        ended = 0
        for task, sink in list(self._running.items()):
            if holding is None or self._held.get(task) in holding:
                sink.cancel_reason = reason
                self._shutting_down.add(task)
                task.cancel()
                ended += 1
        return ended

    # -- reload ------------------------------------------------------------------------------

    @property
    def routes(self) -> list[RouteSettings]:
        """The route table in force."""
        return self._router.routes

    def replace_routes(self, changes: RouteChanges, built: Mapping[str, Adapter], grace: float) -> int:
        """Serve ``changes.routes`` from now on, in one step: ``built`` (by adapter key) serves the added and
        replaced routes, the unchanged ones keep their adapter and admission. Runs of removed and replaced
        routes finish on their old adapters within ``grace`` seconds, then end retryably; an instance no
        route uses any more is closed once its runs ended. Returns how many runs are finishing so."""
        kept = set(changes.unchanged)
        adapter_of = {
            route.model: self._adapter_of[route.model] if route.model in kept else built[route.adapter_key]
            for route in changes.routes
        }
        admissions = {
            route.model: self.admissions[route.model] if route.model in kept else self._admission(route)
            for route in changes.routes
        }
        retired = {admission for model, admission in self.admissions.items() if model not in kept}
        in_use = {id(adapter) for adapter in adapter_of.values()}
        unused = [adapter for adapter in self.adapters.values() if id(adapter) not in in_use]
        self.adapters = {key: adapter for key, adapter in self.adapters.items() if id(adapter) in in_use}
        self.generation += 1
        for key, adapter in built.items():  # an old instance may still hold the key while it retires
            self.adapters[key if key not in self.adapters else f"{key}@{self.generation}"] = adapter
        self._router = Router(changes.routes, self._router.limits)
        self._adapter_of, self.admissions = adapter_of, admissions
        self._forget_removed(changes)
        self._removed.update(dict.fromkeys(changes.removed, asyncio.get_running_loop().time() + grace))
        self._retiring |= retired
        finishing = sum(1 for admission in self._held.values() if admission in retired)
        task = asyncio.create_task(self._retire(frozenset(retired), unused, grace), name="iop-retire-routes")
        self._retirements.add(task)
        task.add_done_callback(self._retirements.discard)
        self._load_changed()
        return finishing

    def _forget_removed(self, changes: RouteChanges) -> None:
        """Routed again, or past the time they were refused retryably: unknown from now on, like any model."""
        now, routed = asyncio.get_running_loop().time(), {route.model for route in changes.routes}
        for model in [model for model, until in self._removed.items() if model in routed or until <= now]:
            del self._removed[model]

    def _refuse_removed(self, model: str) -> None:
        """A run of a model a reload just removed: retryable, so that the control-plane, which may not have
        seen this node's new status yet, places it on another node."""
        until = self._removed.get(model)
        if until is not None and asyncio.get_running_loop().time() < until:
            raise IopError(
                pb.ERROR_CODE_UNAVAILABLE,
                f"model {model!r} is no longer served on node {self.node_id} (removed by a reload);"
                " send the run elsewhere",
                retryable=True,
            )

    async def _retire(self, admissions: frozenset[Admission], adapters: list[Adapter], grace: float) -> None:
        """Let the runs holding ``admissions`` finish within ``grace``, end the rest, then close ``adapters``."""
        try:
            try:
                await asyncio.wait_for(self._until_released(admissions), grace)
            except TimeoutError:
                reason = f"its route was removed or replaced by a reload and the reload's grace ({grace:g}s) ran out"
                ended = self._end_running(reason, holding=admissions)
                self._metrics.reload_grace_ended.inc(ended)
                _log.warning("reload grace ran out", node_id=self.node_id, runs_ended=ended, grace=grace)
                await self._until_released(admissions)
        finally:  # also when the node stops meanwhile: the instances are closed once
            self._retiring -= admissions
            self._load_changed()
            for adapter in adapters:
                try:
                    await adapter.aclose()
                except Exception:  # noqa: BLE001 - one adapter failing to close must not keep the others open
                    _log.exception("adapter close failed", node_id=self.node_id, adapter=adapter.name)
            if adapters:
                _log.info("retired adapters closed", node_id=self.node_id, adapters=[a.name for a in adapters])

    async def _until_released(self, admissions: frozenset[Admission]) -> None:
        while any(admission in admissions for admission in self._held.values()):
            self._released.clear()
            await self._released.wait()

    async def stop_retiring(self) -> None:
        """End the retirements still waiting (the node stops): their adapters are closed."""
        for task in list(self._retirements):
            task.cancel()
        await asyncio.gather(*self._retirements, return_exceptions=True)

    # -- load --------------------------------------------------------------------------------

    def status(self) -> pb.NodeStatus:
        """The node's load now."""
        models = [
            pb.ModelLoad(
                model=a.model,
                in_flight=a.in_flight,
                queued=a.queued,
                capacity=a.capacity,
                available=self._adapter_of[a.model].available(a.model),
                served=self._adapter_of[a.model].served(a.model),
            )
            for a in self.admissions.values()
        ]
        return pb.NodeStatus(
            node_id=self.node_id,
            models=models,
            in_flight=sum(m.in_flight for m in models),
            queued=sum(m.queued for m in models),
            capacity=sum(m.capacity for m in models),
            draining=self.draining,
        )

    @property
    def busy(self) -> int:
        """Runs executing or queued, all models (also those of routes a reload removed, until they end)."""
        admissions = [*self.admissions.values(), *self._retiring]
        return sum(a.in_flight + a.queued for a in admissions)

    def on_load_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever in-flight or queued counts change."""
        self._listeners.append(listener)

    def _load_changed(self, admission: Admission | None = None) -> None:
        # A replaced route's old admission is not its model's any more: the new one's counts are shown.
        if admission is not None and self.admissions.get(admission.model, admission) is admission:
            gauges = self._metrics.model(admission.model)
            gauges.in_flight.set(admission.in_flight)
            gauges.queued.set(admission.queued)
        if self.busy:
            self._idle.clear()
        else:
            self._idle.set()
        for listener in self._listeners:
            listener()

    async def wait_idle(self) -> None:
        """Wait until no run is executing or queued."""
        await self._idle.wait()
