"""The admission queue: runs waiting for a free slot, per model, by priority then fair share (no I/O).

A run whose candidates are all full (``all_busy``) waits here, in a bounded queue per model
(the name the request gave: a model, an alias or a route), higher priority first. Within a
priority, the policy's ``fairness`` of the model picks: ``tokens`` (the default), the earliest
waiter of the caller with the least weighted service so far (:mod:`iop_control_plane.fairness`);
``fifo``, the earliest waiter. Within one caller, arrival order. :meth:`AdmissionQueue.admit`
picks waiters in that order and asks a ``place`` callback for each; the first that finds every
candidate still full (``None``) stops that model's picks, so no waiter overtakes the one due the slot.
One exception: a waiter whose ``place`` answers :data:`HOLD` waits for one node in particular (the
``prefix`` policy's holder of its prompt, full) while others have room, and the waiters behind it,
its caller's too, are picked meanwhile: at most :data:`HOLDS_PER_PASS` such waiters a model per
pick (each costs a decision), past which the pass ends and ``on_holds_bound`` is told.

A full queue refuses a new run, except under ``tokens``: a newcomer whose caller holds less than
an equal share of the queue's places takes the place of the newest waiter, of no higher priority,
of the caller holding the most (two or more than the newcomer's; of equals, the most served), and
``on_displaced`` is told. Places, not service, decide: a caller that was just served may be ahead
on service by one run, yet still be under its share. So a flooding caller cannot fill the queue
against the others.

Per-caller limits: a caller with ``limit(caller)`` runs in progress (:meth:`started` /
:meth:`ended`) waits in the queue; its waiters are skipped, not blocking others, until one of
its runs ends. Time is passed in (``now``, monotonic seconds), so everything here is testable
without a loop; the service wakes waiters and enforces deadlines.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections import Counter, deque
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from iop_control_plane.fairness import ServiceCounters
from iop_control_plane.policy import Fairness

__all__ = ["HOLD", "HOLDS_PER_PASS", "AdmissionQueue", "Hold", "Waiter"]

T = TypeVar("T")
_WINDOW = 10.0
"""Seconds of admissions the retry-after hint reads the drain rate from."""


class Hold(enum.Enum):
    """The type of :data:`HOLD` (an enum of one: ``is HOLD`` narrows a type)."""

    HOLD = "hold"


HOLD = Hold.HOLD
"""What ``place`` answers for a waiter that waits for one node in particular, full, while others have room."""
HOLDS_PER_PASS = 16
"""Waiters a model's pick passes over because they hold for their node: each costs a decision (about 50 us
under ``prefix``), so a queue of them does not make every freed slot cost one per waiter."""


@dataclass(eq=False, slots=True)
class Waiter(Generic[T]):
    """One queued run."""

    model: str
    """The name the request gave (its queue)."""
    caller: str
    """Who the run is for (per-caller limits, fair share)."""
    priority: int = 0
    """Higher first."""
    since: float = 0.0
    """When it was queued (monotonic seconds)."""
    counted: bool = False
    """Already counted as in progress for its caller (a failover waiting for another node): no limit check,
    and its prompt is not charged again."""
    prompt_tokens: int = 0
    """Its prompt's estimated tokens, charged to its caller when it is admitted."""
    key: tuple[int, int] = field(default=(0, 0), init=False)
    """Its place in the queue: (-priority, arrival)."""
    outcome: T | None = field(default=None, init=False)
    """What ``place`` gave it when admitted; None while it waits."""
    displaced: bool = field(default=False, init=False)
    """Taken out of a full queue to make room for a caller under its share."""


class _ModelQueue(Generic[T]):
    """One model's waiters: per priority, per caller, in arrival order."""

    __slots__ = ("count", "levels", "places")

    def __init__(self) -> None:
        self.levels: dict[int, dict[str, list[Waiter[T]]]] = {}
        self.places: Counter[str] = Counter()
        """Waiters per caller (the backlogged callers)."""
        self.count = 0

    def add(self, waiter: Waiter[T]) -> None:
        waiters = self.levels.setdefault(waiter.priority, {}).setdefault(waiter.caller, [])
        bisect.insort(waiters, waiter, key=lambda queued: queued.key)
        self.places[waiter.caller] += 1
        self.count += 1

    def remove(self, waiter: Waiter[T]) -> bool:
        level = self.levels.get(waiter.priority, {})
        waiters = level.get(waiter.caller)
        if not waiters:
            return False
        try:
            waiters.remove(waiter)  # one scan, not a look and then a scan: it is mostly the first
        except ValueError:
            return False
        if not waiters:
            del level[waiter.caller]
            if not level:
                del self.levels[waiter.priority]
        self.places[waiter.caller] -= 1
        if not self.places[waiter.caller]:
            del self.places[waiter.caller]
        self.count -= 1
        return True

    def newest(self, caller: str, priority: int) -> Waiter[T] | None:
        """``caller``'s newest waiter of the lowest priority it has at ``priority`` or below."""
        for level in sorted(self.levels):
            if level > priority:
                break
            if waiters := self.levels[level].get(caller):
                return waiters[-1]
        return None


class AdmissionQueue(Generic[T]):
    """Waiting runs per model, and runs in progress per caller."""

    def __init__(
        self,
        size: int,
        limit: Callable[[str], int | None] = lambda _: None,
        *,
        fairness: Callable[[str], Fairness] = lambda _: "tokens",
        counters: ServiceCounters | None = None,
    ) -> None:
        self.size = size
        """Waiters a model's queue holds; one more is refused (or displaces one, under ``tokens``)."""
        self.limit = limit
        """Runs a caller may have in progress; None: no limit."""
        self.fairness = fairness
        """A model's order within a priority (read at each pick: the policy may be reloaded)."""
        self.counters = counters if counters is not None else ServiceCounters()
        """Each caller's weighted service per model."""
        self.counters.backlogged = self._backlogged
        self.on_displaced: Callable[[Waiter[T]], None] = lambda _: None
        """Told of a waiter taken out of a full queue for a caller under its share."""
        self.on_holds_bound: Callable[[str], None] = lambda _: None
        """Told of a model whose pick ended at HOLDS_PER_PASS waiters holding for their node."""
        self.running: Counter[str] = Counter()
        """Runs in progress per caller (admitted and not ended)."""
        self._queues: dict[str, _ModelQueue[T]] = {}
        self._arrivals = itertools.count()
        self._admitted: dict[str, deque[float]] = {}

    def offer(self, waiter: Waiter[T]) -> bool:
        """Queue ``waiter`` behind those of its priority; False when its model's queue is full (and it
        displaces nobody)."""
        model = waiter.model
        queue = self._queues.get(model) or _ModelQueue[T]()
        if waiter.caller not in queue.places:
            self.counters.lift(model, waiter.caller, queue.places.keys())
        if queue.count >= self.size:
            victim = self._victim(queue, waiter) if self.fairness(model) == "tokens" else None
            if victim is None:
                return False
            queue.remove(victim)
            victim.displaced = True
            self.on_displaced(victim)
        waiter.key = (-waiter.priority, next(self._arrivals))
        queue.add(waiter)
        self._queues[model] = queue
        return True

    def _victim(self, queue: _ModelQueue[T], newcomer: Waiter[T]) -> Waiter[T] | None:
        """The waiter ``newcomer`` displaces from its full queue: if its caller holds less than an equal share
        of the places, the newest of no higher priority of the caller holding the most (then the most served)."""
        model, caller = newcomer.model, newcomer.caller
        held, callers = queue.places[caller], len(queue.places.keys() | {caller})
        if held + 1 > self.size / callers:
            return None
        over = [
            (places, self.counters.of(model, other), other)
            for other, places in queue.places.items()
            if other != caller and places > held + 1
        ]
        for *_, other in sorted(over, reverse=True):
            if (victim := queue.newest(other, newcomer.priority)) is not None:
                return victim
        return None

    def withdraw(self, waiter: Waiter[T]) -> bool:
        """Take ``waiter`` out (cancelled, deadline passed); False if it was not queued."""
        queue = self._queues.get(waiter.model)
        if queue is None or not queue.remove(waiter):
            return False
        if not queue.count:
            del self._queues[waiter.model]
        return True

    def may_start(self, caller: str) -> bool:
        """Whether ``caller`` is under its limit."""
        limit = self.limit(caller)
        return limit is None or self.running[caller] < limit

    def started(self, caller: str) -> None:
        """A run of ``caller`` is in progress."""
        self.running[caller] += 1

    def ended(self, caller: str) -> None:
        """A run of ``caller`` ended."""
        self.running[caller] -= 1
        if self.running[caller] <= 0:
            del self.running[caller]

    def admit(self, place: Callable[[Waiter[T]], T | Hold | None], now: float) -> list[Waiter[T]]:
        """Give waiters what ``place`` finds for them, in order; those served leave the queue, and their
        prompts are charged to their callers before the next pick.

        ``place`` returns None when every candidate of the waiter's model is full: the rest of that
        model's queue waits; :data:`HOLD` when the waiter waits for a node of its own: it is passed
        over this time. Waiters whose caller is at its limit are skipped.
        """
        served: list[Waiter[T]] = []
        for model in list(self._queues):
            queue = self._queues[model]
            fair = self.fairness(model) == "tokens"
            holding: set[Waiter[T]] = set()
            while (waiter := self._next(queue, fair, holding)) is not None:
                outcome = place(waiter)
                if outcome is HOLD:
                    holding.add(waiter)
                    if len(holding) >= HOLDS_PER_PASS:
                        self.on_holds_bound(model)
                        break
                    continue
                if outcome is None:
                    break
                waiter.outcome = outcome
                queue.remove(waiter)
                if not waiter.counted:
                    self.counters.charge(model, waiter.caller, prompt=waiter.prompt_tokens)
                served.append(waiter)
                self._admitted.setdefault(model, deque(maxlen=64)).append(now)
            if not queue.count:
                del self._queues[model]
        return served

    def _next(self, queue: _ModelQueue[T], fair: bool, holding: Set[Waiter[T]] = frozenset()) -> Waiter[T] | None:
        """The waiter due the next slot, passing over those ``holding`` for a node: of the highest priority
        with one that may start, the caller's earliest; of several callers, the least served (``fair``;
        of equals, the one with fewer runs in progress) else the earliest.

        Equals are common: a caller that becomes backlogged is lifted to exactly the least counter
        waiting. A counter lags by the output of its caller's runs in progress (charged as they end),
        so of two equal counters the one with more runs in progress has truly been served more: a
        light caller lifted level with a flooding one takes the next slot, not the one after it.
        """
        for priority in sorted(queue.levels, reverse=True):
            due: Waiter[T] | None = None
            due_key = (0.0, 0, 0)
            for caller, waiters in queue.levels[priority].items():
                may = self.may_start(caller)
                if may and not holding:
                    first: Waiter[T] | None = waiters[0]  # the common case: no generator made
                else:
                    first = next((w for w in waiters if (may or w.counted) and w not in holding), None)
                if first is None:
                    continue
                if fair:
                    key = (self.counters.of(first.model, caller), self.running[caller], first.key[1])
                else:
                    key = (0.0, 0, first.key[1])
                if due is None or key < due_key:
                    due, due_key = first, key
            if due is not None:
                return due
        return None

    def ahead(self, model: str, priority: int) -> bool:
        """Whether a waiter of ``model`` with ``priority`` or higher is queued (a new run goes behind it)."""
        queue = self._queues.get(model)
        return queue is not None and max(queue.levels) >= priority  # an empty queue is deleted

    def depth(self, model: str) -> int:
        """Waiters in ``model``'s queue."""
        queue = self._queues.get(model)
        return queue.count if queue else 0

    def depths(self) -> dict[str, int]:
        """Waiters per model, for models with any."""
        return {model: queue.count for model, queue in self._queues.items()}

    def _backlogged(self, model: str, caller: str) -> bool:
        queue = self._queues.get(model)
        return queue is not None and caller in queue.places

    def waiting(self) -> bool:
        """Whether any run waits."""
        return bool(self._queues)

    def retry_after(self, model: str, now: float) -> float:
        """Seconds a refused run should wait before trying again: the queue's depth over its drain rate.

        1 s when the queue drained fewer than 2 runs in the last 10 s; between 0.1 s and 60 s otherwise.
        """
        recent = [at for at in self._admitted.get(model, ()) if now - at <= _WINDOW]
        if len(recent) < 2:
            return 1.0
        rate = len(recent) / max(now - recent[0], 0.1)
        return min(max((self.depth(model) + 1) / rate, 0.1), 60.0)
