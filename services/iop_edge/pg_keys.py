"""The key store in PostgreSQL (``store.url``): every edge, and ``iop keys``, share one.

Times are the server's (``statement_timestamp()``), so edges whose clocks disagree still agree
on a budget's window and a slot's lapse. A budget take or a slot hold locks its key's row
(``pg_advisory_xact_lock`` on the key's name), so concurrent edges never grant one unit twice.
The schema is created and migrated under an advisory lock, in one transaction, as the worker's.
Sessions the server ended (a database restart) are replaced and the operation runs again
(``iop_wire.pg``): each operation says why running it again applies nothing twice, or commits once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import asyncpg

from iop_edge.key_storage import (
    MIGRATIONS,
    SCHEMA_VERSION,
    USAGE_WRITES_KEPT,
    ApiKey,
    Grant,
    KeyInfo,
    UsageRow,
    UsageTotal,
    api_key,
    check_version,
    key_info,
    name_taken,
    retry_after,
)
from iop_wire.pg import Connection, commit_once, on_fresh_sessions, shown_url

__all__ = ["PgKeyStorage"]

_SCHEMA_LOCK = 0x1ED6_E4E7  # the advisory lock key held while migrating
_NOW = "extract(epoch from statement_timestamp())::float8"
_BUMP = "UPDATE key_changes SET version = version + 1"
_LOCK_KEY = "SELECT pg_advisory_xact_lock(hashtext('iop_edge_key:' || $1))"
_LIST = (
    "SELECT name, key_id, created_at, revoked_at, rpm, tpm, max_concurrent, admin FROM keys ORDER BY created_at, name"
)
_ACTIVE = "SELECT hash, name, key_id, rpm, tpm, max_concurrent, admin FROM keys WHERE revoked_at IS NULL"
_INSERT = f"""
INSERT INTO keys (name, key_id, hash, created_at, revoked_at, rpm, tpm, max_concurrent, admin)
VALUES ($1, $2, $3, {_NOW}, NULL, $4, $5, $6, $7)
"""  # noqa: S608 - no input in the SQL
_ADD_USAGE = """
INSERT INTO key_usage VALUES ($1, $2, $3, $4, $5) ON CONFLICT (name, edge, minute) DO UPDATE
SET requests = key_usage.requests + excluded.requests, tokens = key_usage.tokens + excluded.tokens
"""
# Notes a usage batch as the edge's last; changes nothing (INSERT 0 0) when it already was.
_NOTE_BATCH = f"""
INSERT INTO key_usage_writes VALUES ($1, $2, {_NOW}) ON CONFLICT (edge) DO UPDATE
SET batch = excluded.batch, at = excluded.at WHERE key_usage_writes.batch != excluded.batch
"""  # noqa: S608 - no input in the SQL
_HOLD = f"""
INSERT INTO key_slots VALUES ($1, $2, $3, {_NOW}) ON CONFLICT (name, edge)
DO UPDATE SET slots = excluded.slots, at = excluded.at
"""  # noqa: S608 - no input in the SQL


class PgKeyStorage:
    """The key store in a PostgreSQL database; conforms to ``key_storage.KeyStorage``."""

    def __init__(self, url: str, *, max_connections: int = 4, timeout: float = 2.0) -> None:
        """``url``: ``postgresql://user@host:port/database``; ``timeout``: seconds a statement or connect may take."""
        self.url = url
        self.name = shown_url(url)
        self._max = max_connections
        self._timeout = timeout
        self.sessions_lost = 0  # operations that met sessions the server had ended, and ran again
        self._pool: asyncpg.Pool[asyncpg.Record] | None = None

    async def open(self) -> None:
        """Connect, and create or migrate the tables."""
        pool = await asyncpg.create_pool(
            self.url, min_size=1, max_size=self._max, timeout=self._timeout, command_timeout=self._timeout
        )
        try:
            async with pool.acquire() as conn, conn.transaction():
                await _migrate(conn, self.name)
        except BaseException:
            await pool.close()
            raise
        self._pool = pool

    async def aclose(self) -> None:
        """Close the connections (at once: a store that went away must not hold up a stopping edge)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()

    @property
    def pool(self) -> asyncpg.Pool[asyncpg.Record]:
        """The open pool."""
        if self._pool is None:
            raise RuntimeError(f"the key store {self.name} is not open")
        return self._pool

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
        """Add a key; ValueError if ``name`` was ever used, revoked keys' included (once: run again after it committed,
        it would find the key it added)."""

        async def add(conn: Connection) -> None:
            await conn.execute(_LOCK_KEY, name)
            revoked = await conn.fetchrow("SELECT revoked_at FROM keys WHERE name = $1", name)
            if revoked is not None:
                raise ValueError(name_taken(name, revoked=revoked[0] is not None))
            await conn.execute(
                _INSERT,
                name,
                f"key_{digest[:12]}",
                digest,
                rpm,
                tpm,
                max_concurrent,
                admin,
            )
            await conn.execute(_BUMP)

        await commit_once(self, "create", add)

    async def revoke(self, name: str) -> bool:
        """Revoke the active key ``name``; whether there was one (once: run again after it committed,
        it would find none)."""

        async def revoke(conn: Connection) -> str:
            status: str = await conn.execute(
                f"UPDATE keys SET revoked_at = {_NOW} WHERE name = $1 AND revoked_at IS NULL",  # noqa: S608
                name,
            )
            await conn.execute(_BUMP)
            return status

        return await commit_once(self, "revoke", revoke) != "UPDATE 0"

    @on_fresh_sessions  # a read
    async def list_keys(self) -> list[KeyInfo]:
        """Every key, oldest first."""
        return [key_info(tuple(row)) for row in await self.pool.fetch(_LIST)]

    @on_fresh_sessions  # a read
    async def changes(self) -> object:
        """The change counter."""
        return await self.pool.fetchval("SELECT version FROM key_changes")

    @on_fresh_sessions  # a read
    async def active(self) -> dict[str, ApiKey]:
        """The active keys by digest."""
        return {row[0]: api_key(tuple(row)[1:]) for row in await self.pool.fetch(_ACTIVE)}

    @on_fresh_sessions  # a batch sent again is found written, not added twice
    async def add_usage(self, rows: Sequence[UsageRow], edge: str, batch: str) -> None:
        """Add the rows, in one transaction, unless ``batch`` was the last written."""
        async with self.pool.acquire() as conn, conn.transaction():
            if await conn.execute(_NOTE_BATCH, edge, batch) == "INSERT 0 0":
                return
            await conn.execute(f"DELETE FROM key_usage_writes WHERE at < {_NOW} - $1", USAGE_WRITES_KEPT)  # noqa: S608
            await conn.executemany(_ADD_USAGE, [(row.name, edge, row.minute, row.requests, row.tokens) for row in rows])

    @on_fresh_sessions  # a read
    async def usage(self) -> Mapping[str, UsageTotal]:
        """Recorded usage per key."""
        rows = await self.pool.fetch(
            "SELECT name, sum(requests)::bigint, sum(tokens)::bigint FROM key_usage GROUP BY name"
        )
        return {row[0]: UsageTotal(row[1], row[2]) for row in rows}

    async def take(self, name: str, kind: str, edge: str, *, want: int, debt: int, limit: int, window: float) -> Grant:
        """Grant up to ``want`` units within ``limit`` per ``window``, and record ``debt`` (once: a
        grant is a new row)."""

        async def grant(conn: Connection) -> Grant:
            await conn.execute(_LOCK_KEY, name)
            now: float = await conn.fetchval(f"SELECT {_NOW}")
            await conn.execute(
                "DELETE FROM key_grants WHERE name = $1 AND kind = $2 AND at <= $3", name, kind, now - window
            )
            rows = await conn.fetch(
                "SELECT at, units FROM key_grants WHERE name = $1 AND kind = $2 ORDER BY at", name, kind
            )
            grants = [(row[0], row[1]) for row in rows]
            granted = max(0, min(want, limit - debt - sum(units for _, units in grants)))
            grant_id = None
            if granted + debt > 0:
                grant_id = await conn.fetchval(
                    "INSERT INTO key_grants (name, kind, edge, at, units) VALUES ($1, $2, $3, $4, $5) RETURNING id",
                    name,
                    kind,
                    edge,
                    now,
                    granted + debt,
                )
                grants.append((now, granted + debt))
            wait = retry_after(grants, limit, now, window) if granted < want else 0.0
            return Grant(grant_id, granted, wait)

        return await commit_once(self, "take", grant)

    async def give_back(self, returns: Sequence[tuple[int, int]]) -> None:
        """Take unused units off their grants (once: they are subtracted)."""
        sql = "UPDATE key_grants SET units = greatest(units - $1, 0) WHERE id = $2"
        values = [(units, grant_id) for grant_id, units in returns]
        await commit_once(self, "give_back", lambda conn: conn.executemany(sql, values))

    @on_fresh_sessions  # the edge's row is set to what it holds, not added to
    async def hold_slots(self, name: str, edge: str, *, want: int, limit: int, ttl: float) -> int:
        """Hold up to ``want`` of the ``limit`` slots not held by other edges."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(_LOCK_KEY, name)
            await conn.execute(f"DELETE FROM key_slots WHERE name = $1 AND at <= {_NOW} - $2", name, ttl)  # noqa: S608
            others = await conn.fetchval(
                "SELECT coalesce(sum(slots), 0)::bigint FROM key_slots WHERE name = $1 AND edge != $2", name, edge
            )
            held = max(0, min(want, limit - int(others)))
            await conn.execute(_HOLD, name, edge, held)
        return held

    @on_fresh_sessions  # a time set, not added to
    async def heartbeat(self, edge: str, *, ttl: float) -> int:
        """Note ``edge`` alive; the edges seen within ``ttl`` seconds."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                f"INSERT INTO key_edges VALUES ($1, {_NOW}) ON CONFLICT (edge) DO UPDATE SET at = excluded.at",  # noqa: S608
                edge,
            )
            await conn.execute(f"DELETE FROM key_edges WHERE at <= {_NOW} - $1", 10 * ttl)  # noqa: S608
            count = await conn.fetchval(f"SELECT count(*) FROM key_edges WHERE at > {_NOW} - $1", ttl)  # noqa: S608
        return int(count)


async def _migrate(conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record], store: str) -> None:
    await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
    await conn.execute("CREATE TABLE IF NOT EXISTS edge_schema_version (version integer NOT NULL)")
    version = await conn.fetchval("SELECT version FROM edge_schema_version")
    if version is None:
        await conn.execute("INSERT INTO edge_schema_version (version) VALUES (0)")
        version = 0
    check_version(version, store)
    for step in MIGRATIONS[version:]:
        for statement in step:
            await conn.execute(statement.format(real="double precision", id="BIGSERIAL PRIMARY KEY"))
    if version < SCHEMA_VERSION:
        await conn.execute("UPDATE edge_schema_version SET version = $1", SCHEMA_VERSION)
