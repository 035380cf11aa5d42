"""The shared limits' arithmetic against an in-memory store: grants ahead of need, debts, units
given back, slots, and each edge's share while the store is away."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest

from iop_edge.key_storage import ApiKey, Grant, KeyInfo, UsageRow, UsageTotal
from iop_edge.limits import LimitExceeded
from iop_edge.shared import MAX_HOLD, SharedLimits


class _Store:
    """A key store's budget half, in memory, with one window that never moves; ``away`` fails every call."""

    name = "memory"
    sessions_lost = 0

    def __init__(self) -> None:
        self.grants: dict[int, tuple[str, str, int]] = {}
        self.slots: dict[tuple[str, str], int] = {}
        self.calls = 0
        self.away = False

    def _call(self) -> None:
        self.calls += 1
        if self.away:
            raise ConnectionRefusedError("the store is away")

    def used(self, name: str, kind: str) -> int:
        return sum(units for n, k, units in self.grants.values() if (n, k) == (name, kind))

    async def take(self, name: str, kind: str, edge: str, *, want: int, debt: int, limit: int, window: float) -> Grant:
        self._call()
        granted = max(0, min(want, limit - debt - self.used(name, kind)))
        grant_id = len(self.grants) + 1
        self.grants[grant_id] = (name, kind, granted + debt)
        return Grant(grant_id, granted, 0.0 if granted == want else 30.0)

    async def give_back(self, returns: Sequence[tuple[int, int]]) -> None:
        self._call()
        for grant_id, units in returns:
            name, kind, held = self.grants[grant_id]
            self.grants[grant_id] = (name, kind, held - units)

    async def hold_slots(self, name: str, edge: str, *, want: int, limit: int, ttl: float) -> int:
        self._call()
        others = sum(slots for (n, e), slots in self.slots.items() if n == name and e != edge)
        self.slots[name, edge] = max(0, min(want, limit - others))
        return self.slots[name, edge]

    async def heartbeat(self, edge: str, *, ttl: float) -> int:
        self._call()
        return 2

    # not used by the limits
    async def open(self) -> None: ...
    async def aclose(self) -> None: ...
    async def create(
        self, name: str, digest: str, *, rpm: int | None, tpm: int | None, max_concurrent: int | None
    ) -> None: ...
    async def revoke(self, name: str) -> bool: ...  # type: ignore[empty-body]
    async def list_keys(self) -> list[KeyInfo]: ...  # type: ignore[empty-body]
    async def changes(self) -> object: ...
    async def active(self) -> dict[str, ApiKey]: ...  # type: ignore[empty-body]
    async def add_usage(self, rows: Sequence[UsageRow], edge: str, batch: str) -> None: ...
    async def usage(self) -> Mapping[str, UsageTotal]: ...  # type: ignore[empty-body]


def _key(**limits: int) -> ApiKey:
    return ApiKey("alice", "key_test", limits.get("rpm"), limits.get("tpm"), limits.get("max_concurrent"))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_requests_spend_a_grant_and_the_next_is_taken_ahead_of_need() -> None:
    store = _Store()
    limits = SharedLimits(store, "e1")
    key = _key(rpm=1000)  # grants of 20
    for _ in range(200):
        (await limits.acquire(key)).release()
        await _settle()
    assert store.calls <= 12 and limits.waits == 1  # only the first request waited
    assert store.used("alice", "rpm") <= 200 + 20 + 20


async def test_two_edges_never_admit_past_the_limit_and_refuse_with_retry_after() -> None:
    store = _Store()
    edges = [SharedLimits(store, "e1"), SharedLimits(store, "e2")]
    admitted, refused = 0, []
    for turn in range(400):
        try:
            await edges[turn % 2].acquire(_key(rpm=100))
            admitted += 1
        except LimitExceeded as exc:
            refused.append(exc)
        await _settle()
    assert admitted == 100 and len(refused) == 300
    assert {exc.limit for exc in refused} == {"rpm"} and all(exc.retry_after > 1 for exc in refused)


async def test_tokens_past_the_grant_are_a_debt_paid_with_the_next_take() -> None:
    store = _Store()
    limits = SharedLimits(store, "e1")
    held = await limits.acquire(_key(tpm=1000))  # a grant of 20 tokens
    held.release(tokens=300)
    await limits.tick(0.0)
    await _settle()
    assert store.used("alice", "tpm") >= 300


async def test_units_held_past_max_hold_are_given_back() -> None:
    store = _Store()
    limits = SharedLimits(store, "e1")
    (await limits.acquire(_key(rpm=1000))).release()
    await _settle()
    before = store.used("alice", "rpm")
    await limits.tick(asyncio.get_running_loop().time() + 1000 * MAX_HOLD)  # monotonic clock: far ahead
    assert store.used("alice", "rpm") <= 1 < before


async def test_slots_are_held_across_edges() -> None:
    store = _Store()
    one, two = SharedLimits(store, "e1"), SharedLimits(store, "e2")
    key = _key(max_concurrent=3)
    held = [await one.acquire(key), await one.acquire(key)]
    held.append(await two.acquire(key))
    with pytest.raises(LimitExceeded, match="max_concurrent"):
        await two.acquire(key)
    del held


async def test_while_the_store_is_away_each_edge_keeps_its_share_counting_what_it_admitted() -> None:
    store = _Store()
    limits = SharedLimits(store, "e1")
    limits.edges = 2
    key = _key(rpm=100)
    for _ in range(30):
        await limits.acquire(key)
        await _settle()
    store.away = True
    admitted = 0
    for _ in range(100):
        try:
            await limits.acquire(key)
        except LimitExceeded:
            break
        admitted += 1
    assert limits.failing and admitted <= 50 - 30 + 2 * 2  # its share (100 / 2 edges) less the 30 it admitted
