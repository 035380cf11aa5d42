"""Fair share between the callers of a contended model: virtual token counters (no I/O).

VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): per model, each
caller has a counter of the service it received, ``prompt`` x prompt tokens plus ``completion`` x
completion tokens (:class:`TokenWeights`, 1 and 2 by default), divided by its weight (policy
``callers.NAME.weight``). When a slot frees, the admission queue gives it to the waiting caller
with the least counter, within a priority, in arrival order within one caller
(:mod:`iop_control_plane.admission`). A caller that becomes backlogged (had no run waiting) is
lifted to the least counter among the backlogged callers, or, when none is, to the greatest
counter the model has seen: service it did not ask for while idle is not banked, and a busy
period starts level.

When a run is charged: its prompt as it is admitted, estimated from the request's text (4
characters a token; nodes report usage only when a run ends), so the next pick already sees it;
its completion when its attempt ends, from the node's usage (else the deltas relayed), the prompt
then corrected to the node's count. Not per delta: the relay forwards a run's frames without
looking at each, and reading every running run's progress at each pick would cost the hot path
more than it buys. A caller's counter so lags by the output of its runs in progress; the run
whose end frees a slot is charged before that slot is given.

Memory is bounded: past ``max_callers`` (model, caller) counters, the one untouched longest that
has no run waiting is forgotten (it comes back lifted like any caller that becomes backlogged).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram

from iop_control_plane.policy import Fairness, Policy
from iop_control_plane.settings import FairnessSettings
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.logs import RateLimitedLog

__all__ = ["FairShare", "ServiceCounters", "TokenWeights", "estimated_prompt_tokens"]

_log = structlog.get_logger("iop.control_plane")

_CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class TokenWeights:
    """Service one token counts for, by kind."""

    prompt: float = 1.0
    completion: float = 2.0
    """Decoding a token costs a GPU more than prefilling one: VTC's default ratio."""


class ServiceCounters:
    """Weighted service per (model, caller), bounded."""

    def __init__(
        self,
        weights: TokenWeights = TokenWeights(),
        *,
        caller_weight: Callable[[str], float] = lambda _: 1.0,
        max_callers: int = 10_000,
        forgotten: Callable[[str, str], None] = lambda _model, _caller: None,
    ) -> None:
        self.weights = weights
        self.caller_weight = caller_weight
        """A caller's share (read at each charge: the policy may be reloaded)."""
        self.max_callers = max_callers
        self.forgotten = forgotten
        """Called with (model, caller) when the bound makes a counter go."""
        self.backlogged: Callable[[str, str], bool] = lambda _model, _caller: False
        """Whether a caller has a run waiting for the model (set by the queue): such counters are kept."""
        self._served: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._peak: dict[str, float] = {}

    @property
    def remembered(self) -> int:
        """(model, caller) counters held (at most ``max_callers``)."""
        return len(self._served)

    def of(self, model: str, caller: str) -> float:
        """``caller``'s counter for ``model`` (0 for a caller not seen, or forgotten)."""
        return self._served.get((model, caller), 0.0)

    def charge(self, model: str, caller: str, *, prompt: float = 0, completion: float = 0) -> None:
        """Count service ``caller`` received from ``model`` (a negative amount corrects an estimate)."""
        amount = self.weights.prompt * prompt + self.weights.completion * completion
        self._set(model, caller, self.of(model, caller) + amount / self.caller_weight(caller))

    def lift(self, model: str, caller: str, backlogged: Collection[str]) -> None:
        """``caller`` becomes backlogged: raise it to the least counter of ``backlogged`` (the others
        waiting), or to the model's greatest when none is."""
        floor = min((self.of(model, other) for other in backlogged), default=self._peak.get(model, 0.0))
        self._set(model, caller, max(self.of(model, caller), floor))

    def _set(self, model: str, caller: str, value: float) -> None:
        key = (model, caller)
        self._served[key] = value
        self._served.move_to_end(key)
        if value > self._peak.get(model, 0.0):
            self._peak[model] = value
        if len(self._served) > self.max_callers:
            self._forget_idlest()

    def _forget_idlest(self) -> None:
        for key in self._served:  # untouched longest first; backlogged callers are few (the queues are bounded)
            if not self.backlogged(*key):
                del self._served[key]
                self.forgotten(*key)
                return


def estimated_prompt_tokens(request: pb.RunRequest) -> int:
    """The request's prompt in tokens, estimated from its text: what is charged until the node counts it."""
    chars = sum(len(text) for text in request.prompt)
    chars += sum(len(part.text) for message in request.messages for part in message.content)
    return (chars + _CHARS_PER_TOKEN - 1) // _CHARS_PER_TOKEN


class FairShare:
    """The relay's side of fair share: the counters, per-caller metrics, a log line when a bound bites."""

    def __init__(self, settings: FairnessSettings, policy: Callable[[], Policy], registry: CollectorRegistry) -> None:
        self._policy = policy
        """The policy in force (read at each use: it may be reloaded)."""
        self.counters = ServiceCounters(
            TokenWeights(settings.prompt_weight, settings.completion_weight),
            caller_weight=lambda caller: policy().caller_weight(caller),
            max_callers=settings.max_callers,
            forgotten=self._forgotten,
        )
        self.labels = settings.caller_labels
        """Callers given their own label besides those the policy names, the first seen first; the rest: ``other``."""
        self._labelled: set[str] = set()
        self._log = RateLimitedLog(every=1.0)
        self.served = Counter(
            "iop_control_plane_caller_tokens_total",
            "Tokens served, by caller and kind (prompt, completion): the node's usage, else the estimate and the"
            " deltas relayed. Callers named in the policy and the first fairness.caller_labels others have a label;"
            " the rest are counted as other.",
            ["caller", "kind"],
            registry=registry,
        )
        self.waited = Histogram(
            "iop_control_plane_caller_queue_wait_seconds",
            "Time runs waited in the admission queue, by caller (labels as iop_control_plane_caller_tokens_total).",
            ["caller"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.displacements = Counter(
            "iop_control_plane_queue_displaced_total",
            "Waiting runs refused QUEUE_FULL to make room in a full queue for a caller under its fair share.",
            registry=registry,
        )
        self.forgettings = Counter(
            "iop_control_plane_fair_callers_forgotten_total",
            "Callers' service counters dropped at the bound fairness.max_callers (the one idle longest first).",
            registry=registry,
        )

    def fairness_for(self, model: str) -> Fairness:
        """The order within a priority of ``model``'s queue."""
        return self._policy().fairness_for(model)

    def label(self, caller: str) -> str:
        """``caller``'s label value on the per-caller metrics."""
        if caller in self._labelled or caller in self._policy().callers:
            return caller
        if len(self._labelled) < self.labels:
            self._labelled.add(caller)
            return caller
        return "other"

    def charge_served(self, model: str, caller: str, *, estimate: int, usage: pb.Usage | None, outputs: int) -> bool:
        """Charge ``caller`` for what an attempt served: the node's usage, else ``outputs`` (deltas relayed);
        the prompt's ``estimate`` charged at admission and not yet corrected (0 once it was: a later
        attempt is charged its whole prompt) is corrected to the node's count. Whether it served."""
        completion = usage.completion_tokens if usage is not None else outputs
        if usage is None and not completion:
            return False  # failed before any output: the estimate charged at admission stands
        prompt = usage.prompt_tokens if usage is not None and usage.prompt_tokens else estimate
        self.counters.charge(model, caller, prompt=prompt - estimate, completion=completion)
        label = self.label(caller)
        self.served.labels(label, "prompt").inc(prompt)
        self.served.labels(label, "completion").inc(completion)
        return True

    def observe_wait(self, caller: str, seconds: float) -> None:
        self.waited.labels(self.label(caller)).observe(seconds)

    def displaced(self, model: str, caller: str) -> None:
        """A waiter of ``caller`` gave its place in ``model``'s full queue to a caller under its share."""
        self.displacements.inc()
        self._log.warning(
            "displaced", _log, "queued run displaced by a caller under its share", model=model, caller=caller
        )

    def _forgotten(self, model: str, caller: str) -> None:
        self.forgettings.inc()
        self._log.warning(
            "forgotten",
            _log,
            "caller's service forgotten at the bound fairness.max_callers",
            model=model,
            caller=caller,
        )
