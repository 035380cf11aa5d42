"""The admission queue: runs waiting for a free slot, per model, by priority then arrival (no I/O).

A run whose candidates are all full (``all_busy``) waits here, in a bounded queue per model
(the name the request gave: a model, an alias or a route), higher priority first, then the
earlier arrival. :meth:`AdmissionQueue.admit` walks each model's waiters in that order and asks
a ``place`` callback for each; the first that finds every candidate still full (``None``) stops
that model's walk, so a later waiter never overtakes an earlier one for the same slot.

Per-caller limits: a caller with ``limit(caller)`` runs in progress (:meth:`started` /
:meth:`ended`) waits in the queue; its waiters are skipped, not blocking others, until one of
its runs ends. Time is passed in (``now``, monotonic seconds), so everything here is testable
without a loop; the service wakes waiters and enforces deadlines.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["AdmissionQueue", "Waiter"]

T = TypeVar("T")
_WINDOW = 10.0
"""Seconds of admissions the retry-after hint reads the drain rate from."""


@dataclass(eq=False, slots=True)
class Waiter(Generic[T]):
    """One queued run."""

    model: str
    """The name the request gave (its queue)."""
    caller: str
    """Who the run is for (per-caller limits)."""
    priority: int = 0
    """Higher first."""
    since: float = 0.0
    """When it was queued (monotonic seconds)."""
    counted: bool = False
    """Already counted as in progress for its caller (a failover waiting for another node): no limit check."""
    key: tuple[int, int] = field(default=(0, 0), init=False)
    """Its place in the queue: (-priority, arrival)."""
    outcome: T | None = field(default=None, init=False)
    """What ``place`` gave it when admitted; None while it waits."""


class AdmissionQueue(Generic[T]):
    """Waiting runs per model, and runs in progress per caller."""

    def __init__(self, size: int, limit: Callable[[str], int | None] = lambda _: None) -> None:
        self.size = size
        """Waiters a model's queue holds; one more is refused."""
        self.limit = limit
        """Runs a caller may have in progress; None: no limit."""
        self.running: Counter[str] = Counter()
        """Runs in progress per caller (admitted and not ended)."""
        self._queues: dict[str, list[Waiter[T]]] = {}
        self._arrivals = itertools.count()
        self._admitted: dict[str, deque[float]] = {}

    def offer(self, waiter: Waiter[T]) -> bool:
        """Queue ``waiter`` behind those of its priority; False when its model's queue is full."""
        queue = self._queues.setdefault(waiter.model, [])
        if len(queue) >= self.size:
            if not queue:
                del self._queues[waiter.model]
            return False
        waiter.key = (-waiter.priority, next(self._arrivals))
        bisect.insort(queue, waiter, key=lambda queued: queued.key)
        return True

    def withdraw(self, waiter: Waiter[T]) -> bool:
        """Take ``waiter`` out (cancelled, deadline passed); False if it was not queued."""
        queue = self._queues.get(waiter.model)
        if not queue or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
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

    def admit(self, place: Callable[[Waiter[T]], T | None], now: float) -> list[Waiter[T]]:
        """Give waiters what ``place`` finds for them, in order; those served leave the queue.

        ``place`` returns None when every candidate of the waiter's model is full: the rest of that
        model's queue waits. Waiters whose caller is at its limit are skipped.
        """
        served: list[Waiter[T]] = []
        for model in list(self._queues):
            queue = self._queues[model]
            for waiter in list(queue):
                if not (waiter.counted or self.may_start(waiter.caller)):
                    continue
                outcome = place(waiter)
                if outcome is None:
                    break
                waiter.outcome = outcome
                queue.remove(waiter)
                served.append(waiter)
                self._admitted.setdefault(model, deque(maxlen=64)).append(now)
            if not queue:
                del self._queues[model]
        return served

    def ahead(self, model: str, priority: int) -> bool:
        """Whether a waiter of ``model`` with ``priority`` or higher is queued (a new run goes behind it)."""
        queue = self._queues.get(model)
        return queue is not None and queue[0].priority >= priority  # an empty queue is deleted

    def depth(self, model: str) -> int:
        """Waiters in ``model``'s queue."""
        return len(self._queues.get(model, ()))

    def depths(self) -> dict[str, int]:
        """Waiters per model, for models with any."""
        return {model: len(queue) for model, queue in self._queues.items()}

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
