"""Prompt prefixes: which node recently saw the leading part of a run's prompt (``prefix`` policy).

A run's prompt becomes prefix hashes once per run (:func:`prompt_prefixes`), never kept as text:

- chat: one per message boundary, a cumulative hash of messages[0..i] (each message as its
  protobuf serialization: role, content, name, tool calls);
- completion: one per leading block of ``BLOCK_CHARS`` characters of the prompt.

Both stop at ``MAX_PREFIXES``: beyond, a prompt is told apart from others by its first ones only.
The hashes are Python's (SipHash, seeded per process): the index lives in one process only.

:class:`PrefixIndex` remembers, per node and model, prefixes of the runs placed there: a node's
backend keeps the computed prompt prefixes (KV cache) of its recent runs, so a run that starts
like one of them is prefilled faster there. A run records its landmarks only: the prefixes 1, 2,
4, ... 64 messages (blocks) long, and its whole prompt (at most 8): a conversation's next turn
matches the whole of its last, and one that branches matches a landmark before the branch,
while a long conversation costs no more memory than a short one. A run placed on a node that
held part of its prompt uses again only the longest landmark held (the part its backend reused)
and adds the landmarks past it: the shorter ones age from their last use as the longest, and a
conversation's next turn touches 2-3 entries, not all 8. Memory is bounded twice, LRU
each time: entries per node (its own least recently used go first) and entries in all (the
least recently used of any node); a prefix keeps its ``HOLDERS`` most recent nodes. A node that
leaves loses its entries.
"""

from __future__ import annotations

from collections.abc import Iterator
from heapq import heapify, heappop, heappush, heapreplace
from itertools import islice
from typing import Literal, NamedTuple

import structlog

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.logs import RateLimitedLog

__all__ = ["BLOCK_CHARS", "HOLDERS", "MAX_PREFIXES", "Prefix", "PrefixIndex", "PrefixReason", "prompt_prefixes"]

BLOCK_CHARS = 256
"""Characters per block of a completion prompt."""
MAX_PREFIXES = 64
"""Prefixes of one prompt, at most (64 messages, or 16,384 characters of a completion prompt)."""
HOLDERS = 8
"""Nodes remembered per prefix, the most recent: placement looks at no more than these."""

PrefixReason = Literal["hit", "imbalance", "miss"]
"""hit: the chosen node held a prefix of the prompt; imbalance: another candidate held one, but
was loaded past the bound, full or already tried; miss: no candidate held any."""

_log = structlog.get_logger("iop.control_plane")
_LANDMARKS = [
    tuple(at for at in range(count) if not (at + 1) & at or at == count - 1) for count in range(MAX_PREFIXES + 1)
]
"""The positions a prompt of ``count`` prefixes records: lengths that are powers of two, and the whole."""


class Prefix(NamedTuple):
    """One leading part of a prompt (a tuple: a frozen dataclass costs 4x as much to make)."""

    hash: int
    """64-bit hash of the part (cumulative: it covers everything before it too)."""
    size: int
    """Its length in bytes (of a completion prompt in UTF-8; of a chat's messages serialized)."""


def prompt_prefixes(request: pb.RunRequest) -> tuple[Prefix, ...]:
    """The prefixes of ``request``'s prompt, shortest first; none for an embedding or an empty prompt."""
    if request.kind == pb.RUN_KIND_EMBEDDING:
        return ()
    if request.kind == pb.RUN_KIND_COMPLETION:
        text = "\x00".join(request.prompt)[: BLOCK_CHARS * MAX_PREFIXES]
        parts = [text[at : at + BLOCK_CHARS].encode() for at in range(0, len(text), BLOCK_CHARS)]
    else:
        parts = [message.SerializeToString() for message in request.messages[:MAX_PREFIXES]]
    found, cumulative, size = [], 0, 0
    for part in parts:
        cumulative = hash((cumulative, part))  # the boundary is part of it: (ab, c) is not (a, bc)
        size += len(part)
        found.append(Prefix(cumulative, size))
    return tuple(found)


class PrefixIndex:
    """Per node, the prompt prefixes of runs recently placed there; bounded, least recently used out.

    An entry's key is the prefix's hash mixed with its model's: a node's cache is per model.
    """

    def __init__(self, *, per_node: int = 4096, limit: int = 100_000) -> None:
        self.per_node, self.limit = per_node, limit
        self._holders: dict[int, tuple[str, ...]] = {}
        """Nodes holding each prefix, the one it was most recently placed on last."""
        self._by_node: dict[str, dict[int, int]] = {}
        """Each node's prefixes -> the tick of their last use, the least recently used first (a plain
        dict, used again by taking the key out and putting it back: no linked node per entry to miss
        in the cache, nothing for the garbage collector to walk, as a dict of ints only is not tracked)."""
        self._fronts: list[tuple[int, str]] = []
        """The global bound's order, one entry per node: a heap of (a tick no later than the last use of
        the node's least recently used prefix, the node), so the oldest entry of all is found without
        a table of all entries to update at every use (a tick falls behind as the node's least recently
        used is used again or dropped, and is brought up to date when it comes to the top)."""
        self._queued: dict[str, int] = {}
        """Each node of ``_by_node`` -> the tick of its one live entry in ``_fronts`` (others are stale)."""
        self._tick = 0
        self._size = 0
        self.evicted = {"node": 0, "global": 0}
        """Entries dropped by each bound since start."""
        self._bound_log = RateLimitedLog(every=60.0)

    def __len__(self) -> int:
        return self._size

    def nodes(self) -> int:
        """Nodes holding at least one entry."""
        return len(self._by_node)

    def holders(self, model: str, prefixes: tuple[Prefix, ...]) -> Iterator[tuple[int, tuple[str, ...]]]:
        """(its position in ``prefixes``, the nodes holding it) for each prefix some node holds, the longest first."""
        holders, salt = self._holders, hash(model)
        for at in range(len(prefixes) - 1, -1, -1):
            found = holders.get(prefixes[at].hash ^ salt)
            if found:
                yield at, found

    def held(self, node_id: str, model: str, prefixes: tuple[Prefix, ...]) -> int:
        """Bytes of the longest of ``prefixes`` that ``node_id`` holds; 0 for none."""
        entries, salt = self._by_node.get(node_id), hash(model)
        if entries:
            for prefix in reversed(prefixes):
                if prefix.hash ^ salt in entries:
                    return prefix.size
        return 0

    def record(self, node_id: str, model: str, prefixes: tuple[Prefix, ...], *, held: int = 0) -> None:
        """``node_id`` was sent a run with ``prefixes``: it holds their landmarks, as its most recent.

        ``held``: the node is known to hold the first ``held`` of ``prefixes`` (placement just found
        it): of the landmarks among them only the longest, the part its backend reuses, is used
        again; the shorter ones keep their place in the orders (each index lookup of a table this
        size is a cache miss: a conversation's next turn touches 2-3 entries instead of 6-8).
        """
        if not prefixes:
            return
        entries = self._by_node.get(node_id)
        if entries is None:
            entries = self._by_node[node_id] = {}
        salt, all_holders, tick, added = hash(model), self._holders, self._tick, 0
        landmarks = _LANDMARKS[len(prefixes)]
        if held:
            landmarks = (held - 1, *(at for at in landmarks if at >= held))
        for at in landmarks:
            key, tick = prefixes[at].hash ^ salt, tick + 1
            holders = all_holders.get(key)
            if holders is None:
                all_holders[key] = (node_id,)
            elif node_id in holders:  # held: used again
                del entries[key]
                entries[key] = tick
                if holders[-1] != node_id:
                    all_holders[key] = (*[held for held in holders if held != node_id], node_id)
                continue
            else:
                all_holders[key] = (*holders, node_id)
                if len(holders) == HOLDERS:
                    self._drop(holders[0], key)
            entries[key] = tick
            added += 1
        self._tick, self._size = tick, self._size + added
        if node_id not in self._queued:  # new here
            self._queue(node_id, entries)
        if len(entries) > self.per_node:
            self._evict_own(node_id, entries)
        if self._size > self.limit:
            self._evict_oldest()

    def forget(self, node_id: str) -> None:
        """``node_id`` left: drop every entry it holds."""
        entries = self._by_node.pop(node_id, None)
        if entries is None:
            return
        del self._queued[node_id]
        self._size -= len(entries)
        for key in entries:
            self._unhold(node_id, key)
        self._prune_fronts()

    def _evict_own(self, node_id: str, entries: dict[int, int]) -> None:
        """``node_id`` is past its bound: its least recently used entries go."""
        over = len(entries) - self.per_node
        self._bounded("node", self.per_node, over)
        self._size -= over
        for key in list(islice(entries, over)):
            del entries[key]
            self._unhold(node_id, key)

    def _evict_oldest(self) -> None:
        """Past the global bound: the least recently used entries of any node go."""
        fronts, queued, by_node = self._fronts, self._queued, self._by_node
        over = self._size - self.limit
        self._bounded("global", self.limit, over)
        self._size = self.limit
        while over:
            tick, node_id = fronts[0]
            if queued.get(node_id) != tick:  # stale: the node was forgotten or emptied, or queued again
                heappop(fronts)
                continue
            entries = by_node[node_id]
            key = next(iter(entries))
            if entries[key] != tick:  # its least recently used was used again or dropped: its place is later
                queued[node_id] = entries[key]
                heapreplace(fronts, (entries[key], node_id))
                continue
            del entries[key]
            self._unhold(node_id, key)
            over -= 1
            if entries:
                queued[node_id] = following = next(iter(entries.values()))
                heapreplace(fronts, (following, node_id))
            else:
                del by_node[node_id], queued[node_id]
                heappop(fronts)

    def _queue(self, node_id: str, entries: dict[int, int]) -> None:
        """Put ``node_id``, new to the index, in the global order at its least recently used entry."""
        self._queued[node_id] = front = next(iter(entries.values()))
        heappush(self._fronts, (front, node_id))

    def _prune_fronts(self) -> None:
        """Drop the stale entries of nodes gone, when they are most of the heap (it stays within 2x the nodes)."""
        if len(self._fronts) > 2 * len(self._queued) + 64:
            self._fronts = [(tick, node_id) for node_id, tick in self._queued.items()]
            heapify(self._fronts)

    def _bounded(self, bound: Literal["node", "global"], limit: int, dropped: int) -> None:
        self.evicted[bound] += dropped
        self._bound_log.warning(
            bound, _log, "prefix index full; forgetting the least recently used", bound=bound, limit=limit
        )

    def _drop(self, node_id: str, key: int) -> None:
        entries = self._by_node[node_id]
        del entries[key]
        self._size -= 1
        if not entries:
            del self._by_node[node_id], self._queued[node_id]
            self._prune_fronts()
        self._unhold(node_id, key)

    def _unhold(self, node_id: str, key: int) -> None:
        holders = self._holders[key]
        if len(holders) == 1:  # most prefixes have one holder (a conversation stays on its node)
            del self._holders[key]
        else:
            self._holders[key] = tuple([held for held in holders if held != node_id])
