"""One model's candidates, indexed for each policy so that a decision never sorts all nodes.

A candidate is a ready node that serves the model, has it available and has a capacity. The
pool keeps them three ways, each updated as loads and states change:

- a heap by load / capacity (least-loaded): stale entries are skipped, and the heap is
  compacted when they outnumber the live ones;
- a list in arrival order with a cursor (round-robin);
- a consistent-hash ring (session affinity); a pool of the nodes with some labels walks the
  ring of the model's whole pool, skipping the others, so a node's place never depends on labels.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from heapq import heapify, heappop, heappush

from iop_control_plane.ring import HashRing
from iop_control_plane.views import ModelView

__all__ = ["Accept", "ModelPool"]

Accept = Callable[[ModelView], bool] | None
"""Which candidates a decision may take (not the nodes a failover already tried); None takes them all."""

_Entry = tuple[float, int, str]
"""(load / capacity, update order, node id): among equal loads the longest unchanged goes first."""

_order = itertools.count()
_REACH = 32  # candidates round-robin looks at before it takes the least loaded


class ModelPool:
    """The candidates for one model."""

    def __init__(self, vnodes: int = 100, *, within: ModelPool | None = None) -> None:
        self.views: dict[str, ModelView] = {}
        """Candidates by node id."""
        self._within, self._vnodes = within, vnodes
        self._ring: HashRing | None = None
        """Made on first use, all nodes in one sort (0.45 s for 1,000 nodes on a loaded 2-core host,
        most of it hashing their points), which pools no session-affinity decision asks for never pay."""
        self._heap: list[_Entry] = []
        self._live: dict[str, _Entry] = {}
        self._turn: list[str] = []
        self._cursor = 0

    def __len__(self) -> int:
        return len(self.views)

    @property
    def ring(self) -> HashRing:
        """The consistent-hash ring: this pool's own, or that of the pool ``within`` (whose nodes include these)."""
        if self._within is not None:
            return self._within.ring
        if self._ring is None:
            self._ring = HashRing(self._vnodes)
            self._ring.add(*self._turn)
        return self._ring

    def update(self, view: ModelView) -> None:
        """Add ``view``'s node, or take its new load into account."""
        node_id = view.node.node_id
        if node_id not in self.views:
            self.views[node_id] = view
            self._turn.append(node_id)
            if self._ring is not None:
                self._ring.add(node_id)
        share = view.load / view.capacity
        live = self._live.get(node_id)
        if live is not None and live[0] == share:
            return  # an unchanged report (every idle node, every second): the heap stays as it is
        entry = (share, next(_order), node_id)
        self._live[node_id] = entry
        heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live.values())
            heapify(self._heap)

    def discard(self, node_id: str) -> None:
        """Drop ``node_id`` from the candidates (nothing if it is not one)."""
        if self.views.pop(node_id, None) is None:
            return
        del self._live[node_id]
        index = self._turn.index(node_id)
        del self._turn[index]
        if index < self._cursor:
            self._cursor -= 1
        if self._ring is not None:
            self._ring.remove(node_id)

    def least_loaded(self, accept: Accept) -> ModelView | None:
        """The accepted candidate with the lowest load / capacity; None when none is accepted."""
        heap, live = self._heap, self._live
        while heap:
            entry = heap[0]
            if live.get(entry[2]) is entry:
                view = self.views[entry[2]]
                return view if accept is None or accept(view) else self._least_accepted(accept)
            heappop(heap)  # stale: the node's load changed or it left
        return None

    def _least_accepted(self, accept: Callable[[ModelView], bool]) -> ModelView | None:
        """``least_loaded`` when the least loaded is not accepted: the heap's top entries are taken
        off until one is, and put back."""
        heap, live, skipped = self._heap, self._live, []
        found = None
        while heap:
            entry = heappop(heap)
            if live.get(entry[2]) is not entry:
                continue  # stale
            skipped.append(entry)
            view = self.views[entry[2]]
            if accept(view):
                found = view
                break
        for entry in skipped:
            heappush(heap, entry)
        return found

    def next_in_turn(self, accept: Accept) -> ModelView | None:
        """The next accepted candidate with a free slot after the last one taken.

        When none is free this is the least loaded (busy); when the free ones are over ``_REACH``
        steps apart in turn (nearly all full), the least loaded of them: a decision stays short.
        """
        least = self.least_loaded(accept)
        if least is None or not least.free:
            return least
        turn, count = self._turn, len(self._turn)
        for step in range(min(count, _REACH)):
            index = (self._cursor + step) % count
            view = self.views[turn[index]]
            if view.free and (accept is None or accept(view)):
                self._cursor = index + 1
                return view
        return least

    def home(self, key: str, accept: Accept) -> ModelView | None:
        """The first accepted candidate clockwise from ``key`` on the ring."""
        for node_id in self.ring.walk(key):
            view = self.views.get(node_id)
            if view is not None and (accept is None or accept(view)):
                return view
        return None
