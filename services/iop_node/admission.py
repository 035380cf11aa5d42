"""Admission: at most ``capacity`` runs of a model at once; a bounded queue, by priority then FIFO."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.errors import IopError

__all__ = ["Admission"]


class Admission:
    """Slots for one model's runs."""

    def __init__(self, model: str, capacity: int, queue_size: int, on_change: Callable[[Admission], None]) -> None:
        self.model = model
        self.capacity = capacity
        self.queue_size = queue_size
        self.in_flight = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._on_change = on_change

    @property
    def queued(self) -> int:
        """Runs waiting for a slot."""
        return len(self._waiting)

    async def acquire(self, priority: int) -> None:
        """Take a slot, waiting in the queue; RESOURCE_EXHAUSTED when the queue is full."""
        if self.in_flight < self.capacity and not self._waiting:
            self.in_flight += 1
            self._on_change(self)
            return
        if len(self._waiting) >= self.queue_size:
            raise IopError(
                pb.ERROR_CODE_RESOURCE_EXHAUSTED,
                f"model {self.model!r} is at capacity ({self.capacity} running, {self.queue_size} queued)",
                reason=pb.ERROR_REASON_QUEUE_FULL,
            )
        entry = (-priority, next(self._order), asyncio.get_running_loop().create_future())
        heapq.heappush(self._waiting, entry)
        self._on_change(self)
        try:
            await entry[2]
        except asyncio.CancelledError:
            self._leave(entry)
            raise

    def _leave(self, entry: tuple[int, int, asyncio.Future[None]]) -> None:
        """A cancelled waiter: drop it, or hand back the slot it was given as it was cancelled."""
        if entry[2].done() and not entry[2].cancelled():
            self.release()
            return
        if entry not in self._waiting:
            return  # release() already popped it (its future was cancelled with it)
        self._waiting.remove(entry)
        heapq.heapify(self._waiting)
        self._on_change(self)

    def release(self) -> None:
        """Give a slot back; the highest-priority waiter (earliest first) gets it."""
        self.in_flight -= 1
        while self._waiting:
            _, _, future = heapq.heappop(self._waiting)
            if not future.done():
                self.in_flight += 1
                future.set_result(None)
                break
        self._on_change(self)
