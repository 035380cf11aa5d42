"""One timer per event loop for every connection's heartbeats and liveness looks.

A connection asks to be looked at again at some time; the watchdog keeps those times in a heap
and one timer armed for the earliest. A timer per connection (or a task sleeping in a loop)
costs a wake-up each: a control-plane holding 1,000 node connections, each looked at twice a
second, would spend a tenth of a core waking up. Here times are rounded up to a grid
(:data:`GRAIN`, finer for short naps), so connections due together are looked at in one turn.

A connection looked at later than it was due by more than it meant to sleep was kept waiting
by this end's own event loop: it is excused that time and not judged this turn (what its peer
sent meanwhile is not read yet), as :class:`~iop_wire.liveness.Liveness` expects.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import weakref
from typing import Protocol

__all__ = ["GRAIN", "Watched", "watch"]

GRAIN = 0.1
"""Seconds the times asked for are rounded up to (a nap of under 4 grains: a quarter of the nap)."""
_EARLY = 0.001
"""A connection due this close to now is looked at now (the loop may fire a timer this early)."""


class Watched(Protocol):
    """What the watchdog looks at: a connection."""

    def look(self, now: float, *, judge: bool) -> float | None:
        """Beat if due, judge the peer when ``judge``; the loop time to look again, None when done."""

    def excuse(self, seconds: float) -> None:
        """This end's loop stood still for ``seconds``: not the peer's fault."""


class _Watchdog:
    """The heap of (due, order, connection, nap) of one event loop, and its timer.

    Only its armed timer keeps it alive, and the connections in it (an open connection may have
    no other owner than its tasks, which its socket alone does not keep): a loop that closes with
    connections still open drops them all, and no registry keeps the loop.
    """

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Watched, float]] = []
        self._order = itertools.count()
        self._armed_for = math.inf
        self._token = 0

    def add(self, watched: Watched, due: float, now: float) -> None:
        self._push(watched, due, now)
        if due < self._armed_for:
            self._arm()

    def _push(self, watched: Watched, due: float, now: float) -> None:
        heapq.heappush(self._due, (due, next(self._order), watched, due - now))

    def _arm(self) -> None:
        """Fire at the earliest due; a timer armed before for later fires as a no-op (cheaper than keeping it)."""
        self._token += 1
        self._armed_for = self._due[0][0]
        asyncio.get_running_loop().call_at(self._armed_for, self._fire, self._token)

    def _fire(self, token: int) -> None:
        if token != self._token:
            return
        self._armed_for = math.inf
        now = asyncio.get_running_loop().time()
        while self._due and self._due[0][0] <= now + _EARLY:
            due, _, watched, nap = heapq.heappop(self._due)
            # Woken later than it meant to sleep: this loop stood still (as a connection's own
            # timer would have found), and what the peer sent meanwhile is not read yet.
            stood_still = (late := now - due) > max(nap, _EARLY)
            if stood_still:
                watched.excuse(late)
            if (again := watched.look(now, judge=not stood_still)) is not None:
                self._push(watched, _on_grid(now, again), now)
        if self._due:
            self._arm()


def _on_grid(now: float, due: float) -> float:
    """``due`` rounded up to the grid, so that connections due about together share a turn."""
    grain = min(GRAIN, (due - now) / 4)
    return math.ceil(due / grain) * grain if grain > 0 else due


_watchdogs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.ref[_Watchdog]] = weakref.WeakKeyDictionary()
"""Each loop's watchdog while it has something to watch (its timer, held by the loop, keeps it)."""


def watch(watched: Watched, due: float) -> None:
    """Look at ``watched`` at loop time ``due`` (and whenever its look asks to again, until it says done)."""
    loop = asyncio.get_running_loop()
    known = _watchdogs.get(loop)
    watchdog = known() if known is not None else None
    if watchdog is None:
        watchdog = _Watchdog()
        _watchdogs[loop] = weakref.ref(watchdog)
    watchdog.add(watched, due, loop.time())
