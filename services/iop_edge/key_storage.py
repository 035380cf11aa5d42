"""Where the edge's API keys, their usage and their shared limit budgets live: one interface
(:class:`KeyStorage`), two implementations (``sqlite_keys.SqliteKeyStorage``, the default, one
file; ``pg_keys.PgKeyStorage``, PostgreSQL, shared by every edge).

Both keep the same tables, created and migrated by the same ordered steps (:data:`MIGRATIONS`)
inside one transaction at open, the version in ``schema_version`` (one row). A key file written
before versions existed (a ``keys`` table and nothing else) is version 1. A store newer than
this edge refuses to open (:class:`SchemaTooNew`, one line naming the store).

- ``keys``: one row per key name, the SHA-256 of its secret, its limits, created/revoked times,
  whether it is an admin key (version 4).
- ``key_changes``: one counter, bumped by every create and revoke; edges poll it (every 0.5 s)
  and re-read the active keys when it moves.
- ``key_usage``: requests and tokens per key, edge and minute, added to in batches.
- ``key_usage_writes``: each edge's last usage batch written: a batch whose write may have
  committed unseen (its reply lost) is sent again under its id and not added twice.
- ``key_grants``: the rpm and tpm budget each edge took (``take``): a key's grants of the last
  window never sum past its limit, unused ones are given back (``give_back``).
- ``key_slots``: the concurrency slots each edge holds per key, renewed while in use, lapsing
  ``ttl`` seconds after an edge stops renewing them (a dead edge frees its slots).
- ``key_edges``: the edges seen recently, so that an edge cut off from the store knows its share.
- ``responses``: the Responses API's stored responses (version 5), by id, with their owner (the
  key's name), their input items and the conversation a ``previous_response_id`` continues
  (``iop_edge.stored_responses``); ``response_owners``: each owner's count and bytes of them, kept
  with every write so the per-key cap costs no scan.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import asyncpg

__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "STORE_ERRORS",
    "USAGE_WRITES_KEPT",
    "ApiKey",
    "Grant",
    "KeyInfo",
    "KeyStorage",
    "SchemaTooNew",
    "UsageRow",
    "UsageTotal",
    "api_key",
    "check_version",
    "key_info",
    "name_taken",
    "retry_after",
]


@dataclasses.dataclass(frozen=True, slots=True)
class ApiKey:
    """An active key as the edge sees it: who is calling and their limits."""

    name: str
    """Who the key is for; the run's caller."""
    key_id: str
    """Public id of the key (``key_`` and 12 hex digits), for logs."""
    rpm: int | None
    """Requests a minute; None: no limit."""
    tpm: int | None
    """Prompt + completion tokens a minute; None: no limit."""
    max_concurrent: int | None
    """Requests in progress at once; None: no limit."""
    admin: bool = False
    """An admin key: the console's platform-wide pages and actions, every caller's runs, usage and batches."""

    @property
    def limited(self) -> bool:
        """Whether any limit applies."""
        return self.rpm is not None or self.tpm is not None or self.max_concurrent is not None


@dataclasses.dataclass(frozen=True, slots=True)
class KeyInfo:
    """One key as ``iop keys ls`` shows it (never the secret)."""

    name: str
    """Who the key is for."""
    key_id: str
    """Public id of the key."""
    created_at: float
    """Unix seconds."""
    revoked_at: float | None
    """Unix seconds; None while active."""
    rpm: int | None
    """Requests a minute; None: no limit."""
    tpm: int | None
    """Tokens a minute; None: no limit."""
    max_concurrent: int | None
    """Requests in progress at once; None: no limit."""
    admin: bool = False
    """An admin key (see ``ApiKey.admin``)."""


def name_taken(name: str, *, revoked: bool) -> str:
    """Why ``name`` cannot be given to a new key (one line): it has a key, or had one."""
    if revoked:
        return (
            f"key name {name!r} was used by a revoked key; pick another name (records are kept by name:"
            " a new key under it would inherit the old one's runs, usage and files)"
        )
    return f"key {name!r} exists; pick another name"


def key_info(row: Sequence[Any]) -> KeyInfo:
    """A key from a row of name, key_id, created_at, revoked_at, rpm, tpm, max_concurrent, admin."""
    name, key_id, created_at, revoked_at, rpm, tpm, max_concurrent, admin = row
    return KeyInfo(name, key_id, created_at, revoked_at, rpm, tpm, max_concurrent, admin=bool(admin))


def api_key(row: Sequence[Any]) -> ApiKey:
    """An active key from a row of name, key_id, rpm, tpm, max_concurrent, admin."""
    name, key_id, rpm, tpm, max_concurrent, admin = row
    return ApiKey(name, key_id, rpm, tpm, max_concurrent, admin=bool(admin))


@dataclasses.dataclass(frozen=True, slots=True)
class UsageRow:
    """Usage of one key through one edge in one minute, to be added to the store's."""

    name: str
    """The key's name."""
    minute: int
    """Unix seconds // 60 when the requests ended."""
    requests: int
    """Requests that ended."""
    tokens: int
    """Their prompt + completion tokens."""


@dataclasses.dataclass(frozen=True, slots=True)
class UsageTotal:
    """A key's recorded usage, all edges and minutes together."""

    requests: int
    """Requests recorded."""
    tokens: int
    """Prompt + completion tokens recorded."""


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    """What ``take`` gave: ``granted`` units of budget in the grant row ``grant_id``."""

    grant_id: int | None
    """The row holding the grant (and any debt paid with it); None when nothing was written."""
    granted: int
    """Units granted of those wanted (the debt is always recorded, never refused)."""
    retry_after: float
    """When less than wanted was granted: seconds until the window frees some budget; else 0."""


STORE_ERRORS: tuple[type[Exception], ...] = (
    sqlite3.Error,
    OSError,  # a refused or reset connection, a missing file
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,  # a connection closed under a query
    asyncpg.InternalClientError,  # a pooled connection the server dropped mid-operation
)
"""What a store that is away or broken raises: logged, and the edge carries on without it."""


class SchemaTooNew(RuntimeError):
    """The store was written by a newer edge: this one does not know its tables."""


class KeyStorage(Protocol):
    """The keys, usage and shared limits of the edges, in one store."""

    name: str
    """The store as shown in messages: the file's path or the URL without its password."""
    sessions_lost: int
    """Operations that met sessions the database server had ended, and ran again."""

    async def open(self) -> None:
        """Connect; create or migrate the tables. SchemaTooNew for a newer store."""

    async def aclose(self) -> None:
        """Close the connections."""

    async def create(
        self,
        name: str,
        digest: str,
        *,
        rpm: int | None,
        tpm: int | None,
        max_concurrent: int | None,
        admin: bool = False,
    ) -> None:
        """Add a key, an admin key with ``admin``; ValueError (:func:`name_taken`) if ``name`` was
        ever used, even by a revoked key: runs, usage and files are recorded by the key's name, so a
        name taken again would inherit another's records."""

    async def revoke(self, name: str) -> bool:
        """Revoke the active key ``name``; whether there was one."""

    async def list_keys(self) -> list[KeyInfo]:
        """Every key, revoked ones included, oldest first."""

    async def changes(self) -> object:
        """A token that differs whenever the keys may have changed (cheap: polled twice a second)."""

    async def active(self) -> dict[str, ApiKey]:
        """The active keys by the SHA-256 hex of their secrets."""

    async def add_usage(self, rows: Sequence[UsageRow], edge: str, batch: str) -> None:
        """Add the rows to the recorded usage, in one transaction, unless ``batch`` (an id new for
        each batch, kept when a failed write is sent again) was ``edge``'s last batch written."""

    async def usage(self) -> Mapping[str, UsageTotal]:
        """Recorded usage per key name."""

    async def take(self, name: str, kind: str, edge: str, *, want: int, debt: int, limit: int, window: float) -> Grant:
        """Grant up to ``want`` units of ``name``'s ``kind`` budget (``limit`` per ``window`` seconds),
        and record ``debt`` (units already spent) whatever is left."""

    async def give_back(self, returns: Sequence[tuple[int, int]]) -> None:
        """Give unused units back: ``(grant_id, units)`` pairs."""

    async def hold_slots(self, name: str, edge: str, *, want: int, limit: int, ttl: float) -> int:
        """Hold up to ``want`` of ``name``'s ``limit`` concurrency slots for ``ttl`` seconds; how many."""

    async def heartbeat(self, edge: str, *, ttl: float) -> int:
        """Note ``edge`` alive; how many edges were seen within ``ttl`` seconds (itself included)."""


SCHEMA_VERSION = 5

# Each step takes the tables from the version before it to its own; {real} and {id} are the
# backend's float type and auto-numbered key. Step 1 is the key file as it was before versions.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE IF NOT EXISTS keys (
            name TEXT PRIMARY KEY,
            key_id TEXT NOT NULL UNIQUE,
            hash TEXT NOT NULL UNIQUE,
            created_at {real} NOT NULL,
            revoked_at {real},
            rpm BIGINT CHECK (rpm IS NULL OR rpm >= 1),
            tpm BIGINT CHECK (tpm IS NULL OR tpm >= 1),
            max_concurrent BIGINT CHECK (max_concurrent IS NULL OR max_concurrent >= 1)
        )""",
    ),
    (
        "CREATE TABLE key_changes (version BIGINT NOT NULL)",
        "INSERT INTO key_changes (version) VALUES (1)",
        """CREATE TABLE key_usage (
            name TEXT NOT NULL, edge TEXT NOT NULL, minute BIGINT NOT NULL,
            requests BIGINT NOT NULL, tokens BIGINT NOT NULL,
            PRIMARY KEY (name, edge, minute)
        )""",
        """CREATE TABLE key_grants (
            id {id}, name TEXT NOT NULL, kind TEXT NOT NULL, edge TEXT NOT NULL,
            at {real} NOT NULL, units BIGINT NOT NULL
        )""",
        "CREATE INDEX key_grants_window ON key_grants (name, kind, at)",
        """CREATE TABLE key_slots (
            name TEXT NOT NULL, edge TEXT NOT NULL, slots BIGINT NOT NULL, at {real} NOT NULL,
            PRIMARY KEY (name, edge)
        )""",
        "CREATE TABLE key_edges (edge TEXT PRIMARY KEY, at {real} NOT NULL)",
    ),
    ("CREATE TABLE key_usage_writes (edge TEXT PRIMARY KEY, batch TEXT NOT NULL, at {real} NOT NULL)",),
    ("ALTER TABLE keys ADD COLUMN admin BOOLEAN NOT NULL DEFAULT FALSE",),  # keys made before it: not admin
    (
        """CREATE TABLE responses (
            id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at {real} NOT NULL,
            body TEXT NOT NULL, input_items TEXT NOT NULL, conversation TEXT NOT NULL, size BIGINT NOT NULL
        )""",
        "CREATE INDEX responses_owner ON responses (owner, created_at, id)",
        "CREATE INDEX responses_age ON responses (created_at)",
        """CREATE TABLE response_owners (
            owner TEXT PRIMARY KEY, responses BIGINT NOT NULL, bytes BIGINT NOT NULL
        )""",
    ),
)
assert len(MIGRATIONS) == SCHEMA_VERSION


USAGE_WRITES_KEPT = 86_400.0
"""Seconds an edge's last usage batch is remembered (an edge gone a day sends none again)."""


def check_version(found: int, store: str) -> None:
    """SchemaTooNew (one line naming ``store``) when ``found`` is past this edge's version."""
    if found > SCHEMA_VERSION:
        raise SchemaTooNew(
            f"the key store {store} is at schema version {found}, newer than this edge's {SCHEMA_VERSION}: "
            "upgrade this edge"
        )


def retry_after(grants: Sequence[tuple[float, int]], limit: int, now: float, window: float) -> float:
    """Seconds until the grants ``(at, units)`` of a window, oldest first, sum below ``limit``."""
    remaining = sum(units for _, units in grants)
    for at, units in grants:
        remaining -= units
        if remaining < limit:
            return max(at + window - now, 0.05)
    return window
