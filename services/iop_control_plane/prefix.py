"""Prompt prefixes: which node recently saw the leading part of a run's prompt (``prefix`` policy).

A run's prompt becomes prefix hashes once per run (:func:`prompt_prefixes`), never kept as text:

- chat: one per message boundary, a cumulative hash of messages[0..i] (each message as its
  deterministic protobuf serialization: role, content, name, tool calls);
- completion: one per leading block of ``BLOCK_CHARS`` characters of the prompt.

Both stop at ``MAX_PREFIXES``: beyond, a prompt is told apart from others by its first ones only.

:class:`PrefixIndex` remembers, per node and model, the prefixes of the runs placed there: a node's
backend keeps the computed prompt prefixes (KV cache) of its recent runs, so a run that starts
like one of them is prefilled faster there. Memory is bounded twice, LRU each time: entries per
node (its own least recently used go first) and entries in all (the least recently used of any
node); a hash keeps its ``HOLDERS`` most recent nodes. A node that leaves loses its entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from hashlib import blake2b
from typing import Literal

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
_Key = tuple[str, int]
"""(model, prefix hash)."""


@dataclass(frozen=True, slots=True)
class Prefix:
    """One leading part of a prompt."""

    hash: int
    """64-bit hash of the part (cumulative: it covers everything before it too)."""
    size: int
    """Its length in bytes (UTF-8 of a completion prompt; serialized messages of a chat)."""


def prompt_prefixes(request: pb.RunRequest) -> tuple[Prefix, ...]:
    """The prefixes of ``request``'s prompt, shortest first; none for an embedding or an empty prompt."""
    if request.kind == pb.RUN_KIND_EMBEDDING:
        return ()
    if request.kind == pb.RUN_KIND_COMPLETION:
        text = "\x00".join(request.prompt)
        parts = (text[at : at + BLOCK_CHARS].encode() for at in range(0, len(text), BLOCK_CHARS))
    else:
        parts = (message.SerializeToString(deterministic=True) for message in request.messages)
    hasher, size, found = blake2b(digest_size=8), 0, []
    for part in parts:
        hasher.update(len(part).to_bytes(4, "big"))  # message boundaries are part of what is hashed
        hasher.update(part)
        size += len(part)
        found.append(Prefix(int.from_bytes(hasher.digest(), "big"), size))
        if len(found) == MAX_PREFIXES:
            break
    return tuple(found)


class PrefixIndex:
    """Per node, the prompt prefixes of runs recently placed there; bounded, least recently used out."""

    def __init__(self, *, per_node: int = 4096, limit: int = 100_000) -> None:
        self.per_node, self.limit = per_node, limit
        self._holders: dict[_Key, dict[str, None]] = {}
        """Nodes holding each prefix, the most recently placed there last."""
        self._by_node: dict[str, OrderedDict[_Key, None]] = {}
        """Each node's prefixes, the least recently used first."""
        self._order: OrderedDict[tuple[str, _Key], None] = OrderedDict()
        """Every (node, prefix) entry, the least recently used first: the global bound's order."""
        self.evicted = {"node": 0, "global": 0}
        """Entries dropped by each bound since start."""
        self._bound_log = RateLimitedLog(every=60.0)

    def __len__(self) -> int:
        return len(self._order)

    def nodes(self) -> int:
        """Nodes holding at least one entry."""
        return len(self._by_node)

    def holders(self, model: str, prefixes: tuple[Prefix, ...]) -> Iterator[dict[str, None]]:
        """The nodes holding each of ``prefixes`` that some node holds, the longest prefix first."""
        holders = self._holders
        for prefix in reversed(prefixes):
            found = holders.get((model, prefix.hash))
            if found:
                yield found

    def held(self, node_id: str, model: str, prefixes: tuple[Prefix, ...]) -> int:
        """Bytes of the longest of ``prefixes`` that ``node_id`` holds; 0 for none."""
        entries = self._by_node.get(node_id)
        if entries:
            for prefix in reversed(prefixes):
                if (model, prefix.hash) in entries:
                    return prefix.size
        return 0

    def record(self, node_id: str, model: str, prefixes: tuple[Prefix, ...]) -> None:
        """``node_id`` was sent a run with ``prefixes``: it holds them, as its most recent."""
        if not prefixes:
            return
        entries = self._by_node.get(node_id)
        if entries is None:
            entries = self._by_node[node_id] = OrderedDict()
        for prefix in prefixes:
            key = (model, prefix.hash)
            if key in entries:
                entries.move_to_end(key)
                self._order.move_to_end((node_id, key))
                holders = self._holders[key]
                del holders[node_id]
                holders[node_id] = None
                continue
            entries[key] = None
            self._order[node_id, key] = None
            holders = self._holders.setdefault(key, {})
            holders[node_id] = None
            if len(holders) > HOLDERS:
                self._drop(next(iter(holders)), key)
        while len(entries) > self.per_node:
            self._evict("node", node_id, next(iter(entries)))
        while len(self._order) > self.limit:
            self._evict("global", *next(iter(self._order)))

    def forget(self, node_id: str) -> None:
        """``node_id`` left: drop every entry it holds."""
        for key in self._by_node.pop(node_id, ()):
            del self._order[node_id, key]
            self._unhold(node_id, key)

    def _evict(self, bound: Literal["node", "global"], node_id: str, key: _Key) -> None:
        self.evicted[bound] += 1
        limit = self.per_node if bound == "node" else self.limit
        self._bound_log.warning(
            bound, _log, "prefix index full; forgetting the least recently used", bound=bound, limit=limit
        )
        self._drop(node_id, key)

    def _drop(self, node_id: str, key: _Key) -> None:
        entries = self._by_node[node_id]
        del entries[key], self._order[node_id, key]
        if not entries:
            del self._by_node[node_id]
        self._unhold(node_id, key)

    def _unhold(self, node_id: str, key: _Key) -> None:
        holders = self._holders[key]
        del holders[node_id]
        if not holders:
            del self._holders[key]
