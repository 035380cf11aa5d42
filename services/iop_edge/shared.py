"""A key's rpm, tpm and max_concurrent held across every edge sharing a store, without a store
round trip per request: each edge leases a share of the key's budget ahead of need.

- **rpm and tpm** are budgets of units per 60-second window. An edge takes a grant of
  ``limit / SHARE`` units (``KeyStorage.take``; the store never grants past the limit within a
  window), spends it locally (a request 1 rpm unit when admitted; its tokens at its end), takes
  the next grant in the background once less than half a grant is left, and gives back what a
  grant still holds after ``MAX_HOLD`` seconds. Tokens spent past the grant (a request's length
  is known only at its end) are a debt, recorded with the next take.
- **max_concurrent** is a number of slots: an edge holds as many as it has requests in
  progress plus a small headroom (``KeyStorage.hold_slots``), renews them while in use and
  lets the surplus go; a dead edge's slots lapse after ``SLOT_TTL`` seconds.
- A request waits for the store only when its edge's share ran out before the background take
  came back (a key's first request on an edge, a burst), and then at most ``WAIT`` seconds; a
  key whose limit is under SHARE a minute takes per request, which at under one a second is free.
- **While the store is away** each edge falls back to its own :class:`limits.Limiter`, with the
  key's limits divided by the edges seen in the last ``EDGE_TTL`` seconds; requests keep being
  served, and the shared budgets are used again once the store answers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import math
import time
from typing import Protocol

import structlog

from iop_edge.key_storage import STORE_ERRORS, ApiKey, KeyStorage
from iop_edge.limits import Limiter, LimitExceeded

__all__ = ["EDGE_TTL", "MAX_HOLD", "SHARE", "Held", "SharedLimits"]

_log = structlog.get_logger("iop.edge.limits")

SHARE = 50
"""A grant is 1/SHARE of the key's limit (at least 1): 2%, so N edges strand at most ~3N% of it."""
MAX_HOLD = 1.0
"""Seconds an edge keeps units of a grant before giving them back."""
WAIT = 3.0
"""Most seconds a request waits on a take under way before its edge limits it alone. A store
that refuses connections is noticed at once; this bounds one that hangs, and is longer than the
store's own statement timeout (2 s): a store that is merely slow is waited for, since an edge
limiting alone grants its share again (measured: grants of one unit, so a take per request,
timed out at 1 s under 100 concurrent requests and let 944 of 2,000 through a 600 rpm key)."""
RECHECK = 0.5
"""Seconds a key found at its limit is refused without asking the store again."""
SLOT_TTL = 10.0
"""Seconds an edge's concurrency slots outlive its last renewal."""
EDGE_TTL = 5.0
"""An edge not heard from for this long no longer counts in the shares used while the store is away."""
_TICK = 0.25  # seconds between the background passes (give back, pay debts, renew slots)
_WINDOW = 60.0 + MAX_HOLD  # a unit is counted from its grant, so a whole minute from its use
_FAIL_BACKOFF = 1.0  # seconds without asking the store after it failed
_IDLE = 10.0  # seconds a key's share is kept after its last request


class Held(Protocol):
    """One admitted request; released when it ends (with its tokens)."""

    def release(self, tokens: int = 0) -> None:
        """Free its slot and count its tokens."""


@dataclasses.dataclass(slots=True)
class _Grant:
    grant_id: int | None
    at: float
    units: int


@dataclasses.dataclass(slots=True)
class _Budget:
    """One key's rpm or tpm as this edge holds it."""

    kind: str
    limit: int
    grants: collections.deque[_Grant] = dataclasses.field(default_factory=collections.deque)
    debt: int = 0
    refused_until: float = 0.0
    retry_at: float = 0.0
    pending: asyncio.Future[None] | None = None

    @property
    def chunk(self) -> int:
        return max(1, self.limit // SHARE)

    @property
    def balance(self) -> int:
        return sum(grant.units for grant in self.grants) - self.debt

    def spend(self, units: int) -> None:
        while units and self.grants:
            grant = self.grants[0]
            used = min(units, grant.units)
            grant.units -= used
            units -= used
            if not grant.units:
                self.grants.popleft()
        self.debt += units


@dataclasses.dataclass(slots=True)
class _Slots:
    limit: int
    held: int = 0
    in_progress: int = 0
    renewed: float = 0.0
    refused_until: float = 0.0
    pending: asyncio.Future[None] | None = None

    @property
    def headroom(self) -> int:
        return max(1, self.limit // SHARE)


@dataclasses.dataclass(slots=True)
class _Share:
    key: ApiKey
    rpm: _Budget | None
    tpm: _Budget | None
    slots: _Slots | None
    used: float

    @classmethod
    def of(cls, key: ApiKey, now: float) -> _Share:
        rpm = _Budget("rpm", key.rpm) if key.rpm is not None else None
        tpm = _Budget("tpm", key.tpm) if key.tpm is not None else None
        slots = _Slots(key.max_concurrent) if key.max_concurrent is not None else None
        return cls(key, rpm, tpm, slots, now)

    def idle(self, now: float) -> bool:
        budgets = [budget for budget in (self.rpm, self.tpm) if budget is not None]
        busy = any(budget.grants or budget.debt for budget in budgets) or (self.slots and self.slots.held)
        return not busy and now - self.used > _IDLE


class _SharedHeld:
    __slots__ = ("_local", "_share")

    def __init__(self, share: _Share, local: Held) -> None:
        self._share: _Share | None = share
        self._local = local

    def release(self, tokens: int = 0) -> None:
        share, self._share = self._share, None
        if share is None:
            return
        self._local.release(tokens)
        if share.slots is not None:
            share.slots.in_progress -= 1
        if share.tpm is not None and tokens > 0:
            share.tpm.spend(tokens)


class _Free:
    def release(self, tokens: int = 0) -> None:
        """Nothing to free."""


_FREE = _Free()


class _StoreAway(Exception):
    """The store failed or did not answer within WAIT: limit this request locally."""


class SharedLimits:
    """Per-key limits held across the edges of one store; :meth:`run` does the background work."""

    def __init__(self, storage: KeyStorage, edge: str) -> None:
        """``edge``: this edge's name in the store (unique per process)."""
        self.storage = storage
        self.edge = edge
        self.edges = 1
        """Edges seen within EDGE_TTL seconds (this one included), as of the last heartbeat."""
        self.fallback = Limiter()
        """The local limits used while the store is away."""
        self.takes = 0
        """Store round trips for budgets and slots: the figure that shows none is per request."""
        self.waits = 0
        """Requests that waited on a take."""
        self.failing = False
        self._retry_at = 0.0
        self._shares: dict[str, _Share] = {}

    async def acquire(self, key: ApiKey) -> Held:
        """Admit one request of ``key`` or raise LimitExceeded (429 with Retry-After)."""
        if not key.limited:
            return _FREE
        now = time.monotonic()
        if self.failing and now < self._retry_at:
            return self._local(key)
        share = self._shares.get(key.name)
        if share is None or share.key != key:
            share = self._shares[key.name] = _Share.of(key, now)
        share.used = now
        try:
            if share.slots is not None:
                await self._need_slot(share, share.slots)
            for budget in (share.rpm, share.tpm):
                if budget is not None:
                    await self._need_units(share, budget)
        except _StoreAway:
            return self._local(key)
        if share.slots is not None:
            share.slots.in_progress += 1
        if share.rpm is not None:
            share.rpm.spend(1)
        for budget in (share.rpm, share.tpm):
            low = budget is not None and budget.balance < budget.chunk / 2 + 1 and budget.pending is None
            if budget is not None and low and budget.refused_until <= time.monotonic():
                budget.pending = asyncio.ensure_future(self._take(share, budget))
        # Counted in the local windows too: should the store go away, this edge's own recent
        # requests count against the share it then keeps alone.
        return _SharedHeld(share, self.fallback.acquire(self._scaled(key), counted_only=True))

    def _local(self, key: ApiKey) -> Held:
        return self.fallback.acquire(self._scaled(key))

    def _scaled(self, key: ApiKey) -> ApiKey:
        """``key`` with this edge's share of each limit."""
        return dataclasses.replace(
            key,
            rpm=_part(key.rpm, self.edges),
            tpm=_part(key.tpm, self.edges),
            max_concurrent=_part(key.max_concurrent, self.edges),
        )

    async def _need_units(self, share: _Share, budget: _Budget) -> None:
        deadline = time.monotonic() + WAIT
        while budget.balance < 1:
            now = time.monotonic()
            if budget.refused_until > now:
                raise _refusal(share.key, budget, now)
            if budget.pending is None:
                budget.pending = asyncio.ensure_future(self._take(share, budget))
            self.waits += 1
            await self._wait(budget.pending, deadline)

    async def _need_slot(self, share: _Share, slots: _Slots) -> None:
        deadline = time.monotonic() + WAIT
        while slots.in_progress >= slots.held:
            now = time.monotonic()
            if slots.refused_until > now:
                raise LimitExceeded(
                    f"key {share.key.name!r} has {slots.limit} requests in progress across the edges, "
                    "its limit (max_concurrent)",
                    retry_after=1.0,
                    limit="max_concurrent",
                )
            if slots.pending is None:
                want = slots.in_progress + 1 + slots.headroom
                slots.pending = asyncio.ensure_future(self._hold(share, slots, want))
            self.waits += 1
            await self._wait(slots.pending, deadline)

    async def _wait(self, pending: asyncio.Future[None], deadline: float) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(pending), max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            self._away("a take took longer than its wait")
            raise _StoreAway from None
        if self.failing:
            raise _StoreAway

    async def _take(self, share: _Share, budget: _Budget) -> None:
        """One take for ``budget`` (its debts paid with it); the failure noted, never raised."""
        debt = budget.debt  # more may be spent while the take is under way
        try:
            self.takes += 1
            grant = await self.storage.take(
                share.key.name,
                budget.kind,
                self.edge,
                want=budget.chunk,
                debt=debt,
                limit=budget.limit,
                window=_WINDOW,
            )
        except STORE_ERRORS as exc:
            self._away(str(exc) or type(exc).__name__)
            return
        finally:
            budget.pending = None
        self._back()
        now = time.monotonic()
        budget.debt -= debt
        if grant.granted:
            budget.grants.append(_Grant(grant.grant_id, now, grant.granted))
        if grant.granted < budget.chunk:
            budget.retry_at = now + grant.retry_after
            budget.refused_until = now + min(grant.retry_after, RECHECK)

    async def _hold(self, share: _Share, slots: _Slots, want: int) -> None:
        try:
            self.takes += 1
            held = await self.storage.hold_slots(share.key.name, self.edge, want=want, limit=slots.limit, ttl=SLOT_TTL)
        except STORE_ERRORS as exc:
            self._away(str(exc) or type(exc).__name__)
            return
        finally:
            slots.pending = None
        self._back()
        now = time.monotonic()
        slots.held, slots.renewed = held, now
        if held < want:
            slots.refused_until = now + RECHECK

    def _away(self, error: str) -> None:
        if not self.failing:
            _log.error("key store unreachable: limits kept by each edge alone", error=error, edges=self.edges)
        self.failing = True
        self._retry_at = time.monotonic() + _FAIL_BACKOFF

    def _back(self) -> None:
        if self.failing:
            _log.info("key store reachable again: limits shared", edges=self.edges)
        self.failing = False

    async def heartbeat(self) -> None:
        """Count the edges now (before the first request needs this edge's share); errors are left to :meth:`run`."""
        with contextlib.suppress(*STORE_ERRORS):
            self.edges = max(1, await self.storage.heartbeat(self.edge, ttl=EDGE_TTL))

    async def run(self) -> None:
        """Give back, pay debts, renew and let go of slots, heartbeat; every quarter second, until cancelled."""
        beat = 0.0
        while True:
            await asyncio.sleep(_TICK)
            now = time.monotonic()
            with contextlib.suppress(*STORE_ERRORS):
                if now - beat >= 1.0:
                    beat = now
                    self.edges = max(1, await self.storage.heartbeat(self.edge, ttl=EDGE_TTL))
                    self._back()
            await self.tick(now)

    async def tick(self, now: float) -> None:
        """One background pass."""
        returns: list[tuple[int, int]] = []
        for name, share in list(self._shares.items()):
            for budget in (share.rpm, share.tpm):
                if budget is None:
                    continue
                while budget.grants and budget.grants[0].at < now - MAX_HOLD:
                    grant = budget.grants.popleft()
                    if grant.units and grant.grant_id is not None:
                        returns.append((grant.grant_id, grant.units))
                if budget.debt and budget.pending is None and not self.failing:
                    budget.pending = asyncio.ensure_future(self._take(share, budget))
            slots = share.slots
            if slots is not None and slots.pending is None and not self.failing:
                surplus = slots.held > slots.in_progress + slots.headroom
                if surplus or (slots.held and now - slots.renewed > SLOT_TTL / 4):
                    want = slots.in_progress + (slots.headroom if slots.in_progress else 0)
                    slots.pending = asyncio.ensure_future(self._hold(share, slots, want))
            if share.idle(now):
                del self._shares[name]
        if returns:
            try:
                await self.storage.give_back(returns)
            except STORE_ERRORS as exc:  # the units lapse with their window instead
                self._away(str(exc) or type(exc).__name__)

    async def aclose(self) -> None:
        """Give back every unit and slot held (best effort: they lapse anyway)."""
        returns = [
            (grant.grant_id, grant.units)
            for share in self._shares.values()
            for budget in (share.rpm, share.tpm)
            if budget is not None
            for grant in budget.grants
            if grant.units and grant.grant_id is not None
        ]
        with contextlib.suppress(*STORE_ERRORS):
            if returns:
                await self.storage.give_back(returns)
            for share in self._shares.values():
                if share.slots is not None and share.slots.held:
                    await self.storage.hold_slots(share.key.name, self.edge, want=0, limit=1, ttl=SLOT_TTL)


def _part(limit: int | None, edges: int) -> int | None:
    return None if limit is None else max(1, math.ceil(limit / edges))


def _refusal(key: ApiKey, budget: _Budget, now: float) -> LimitExceeded:
    wait = max(budget.retry_at - now, 0.05)
    if budget.kind == "rpm":
        message = f"key {key.name!r} is at its limit of {key.rpm} requests per minute (rpm) across the edges"
    else:
        message = f"key {key.name!r} is at its limit of {key.tpm} tokens per minute (tpm) across the edges"
    return LimitExceeded(message, retry_after=wait, limit=budget.kind)
