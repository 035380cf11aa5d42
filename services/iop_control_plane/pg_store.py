"""The control-plane's state in PostgreSQL (:class:`iop_control_plane.state.StateStore`), shared by
every control-plane given the same ``store.url``.

A pool of a few connections (asyncpg). The schema is created or migrated under an advisory lock,
so control-planes starting together do not race. Times that replicas compare (a control-plane's
last heartbeat, judged by another to recover its open runs) are the server's clock, so machines
whose clocks disagree still agree. A join token's use is one conditional UPDATE: two replicas
never admit more machines than it allows.

Sessions the server ended (a database restart) are replaced and the operation runs again
(``iop_wire.pg``): each operation says why running it again applies nothing twice, or commits once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg

from iop_control_plane import ledger, usage
from iop_control_plane.ledger import LedgerEntry, LeftOpen
from iop_control_plane.state import (
    SCHEMA_VERSION,
    Dialect,
    NodeSeen,
    Opened,
    Placed,
    PolicyRecord,
    StateChanged,
    TokenRow,
    Write,
    steps,
)
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.pg import Connection, commit_once, on_fresh_sessions, shown_url

__all__ = ["PgStore"]

_DIALECT = Dialect(
    real="double precision",
    int="bigint",
    serial="bigserial PRIMARY KEY",
    floor="CAST(floor(%s) AS bigint)",
    clustered="",
)
_SCHEMA_LOCK = 0x10B_C951  # the advisory lock key held while migrating
_NOW = "extract(epoch from statement_timestamp())::float8"
_POLICY = "SELECT version, text, source, applied_by, applied_at FROM policies"
_RUN = f"INSERT INTO runs ({ledger.RUN_COLUMNS}) VALUES ({', '.join(f'${n}' for n in range(1, 20))}) RETURNING id"  # noqa: S608
_RUN_BY_ID = f"SELECT {ledger.RUN_COLUMNS} FROM runs WHERE id = $1"  # noqa: S608 - fixed columns
_USAGE = [(usage.upsert_sql(table, lambda n: f"${n}"), width) for table, width in usage.TABLES]
_ADD_USAGE = {table: usage.upsert_sql(table, lambda n: f"${n}") for table, _ in usage.TABLES}
# A batch the writer sends again after its commit's outcome was unknown (the reply lost while the
# database went away) may hold runs and state changes already written. The same run, requester,
# connection, caller and receipt time is the same ledger entry (another control-plane's record of
# the run has its own connection and time); the same node, time and state is the same change.
_ENDED_RUN = (
    f"INSERT INTO runs ({ledger.RUN_COLUMNS}) SELECT {', '.join(f'${n}' for n in range(1, 20))} "  # noqa: S608
    "WHERE NOT EXISTS (SELECT FROM runs WHERE run_id = $1 AND requester = $2 AND connection = $3 AND caller = $4 "
    "AND received_at = $10) RETURNING id"
)
_STATE_CHANGED = (
    "INSERT INTO node_events (node_id, at, state, reason) SELECT $1, $2, $3, $4 "
    "WHERE NOT EXISTS (SELECT FROM node_events WHERE node_id = $1 AND at = $2 AND state = $3)"
)
_ATTEMPT = f"INSERT INTO run_attempts ({ledger.ATTEMPT_COLUMNS}) VALUES ({', '.join(f'${n}' for n in range(1, 13))})"  # noqa: S608
_OPEN = (
    "INSERT INTO open_runs (run_id, requester, connection, caller, model, received_at, owner) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id"
)
_PLACED = "UPDATE open_runs SET node_id = $1, node_model = $2, attempt = $3, placed_after = $4 WHERE id = $5"
_UPSERT_NODE = """
INSERT INTO nodes (node_id, labels, address, models, first_seen, last_seen) VALUES ($1, $2, $3, $4, $5, $5)
ON CONFLICT (node_id) DO UPDATE SET labels = excluded.labels, address = excluded.address,
    models = excluded.models, last_seen = excluded.last_seen
"""
_RECOVER = f"""
DELETE FROM open_runs WHERE owner != $1 AND owner NOT IN (SELECT owner FROM replicas WHERE seen_at >= {_NOW} - $2)
RETURNING {ledger.OPEN_COLUMNS}
"""  # noqa: S608 - fixed columns

# A run left open by a control-plane that died may have been opened again through another (the edge's
# failover before output: the same run id, requester and caller) and ended there: that row is the
# run's record, and no interrupted one is added.
_ENDED_ELSEWHERE = "SELECT EXISTS (SELECT FROM runs WHERE run_id = $1 AND requester = $2 AND caller = $3)"
_SETTLE_RUN = ledger.settle_run_sql(lambda n: f"${n}")
_SETTLE_ATTEMPT = ledger.settle_attempt_sql(lambda n: f"${n}")


class PgStore:
    """The state in a PostgreSQL database."""

    shared = True

    def __init__(self, url: str, *, max_connections: int = 4, timeout: float = 5.0) -> None:
        """``url``: ``postgresql://user@host:port/database``; ``timeout``: seconds for one connection attempt
        and one statement, so a database that went away fails a write instead of holding it."""
        self.url = url
        self.name = shown_url(url)
        self._owner = ""
        self.sessions_lost = 0  # operations that met sessions the server had ended, and ran again
        self._max, self._timeout = max_connections, timeout
        self._pool: asyncpg.Pool[asyncpg.Record] | None = None

    async def open(self, owner: str) -> None:
        """Connect, and create or migrate the schema; StoreTooNew when a newer control-plane did."""
        self._owner = owner
        pool = await asyncpg.create_pool(
            self.url, min_size=1, max_size=self._max, timeout=self._timeout, command_timeout=self._timeout
        )
        try:
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
                await conn.execute("CREATE TABLE IF NOT EXISTS control_plane_schema (version integer NOT NULL)")
                version = await conn.fetchval("SELECT max(version) FROM control_plane_schema") or 0
                for sql in steps(version, _DIALECT):
                    await conn.execute(sql)
                if version < SCHEMA_VERSION:
                    await conn.execute("DELETE FROM control_plane_schema")
                    await conn.execute("INSERT INTO control_plane_schema (version) VALUES ($1)", SCHEMA_VERSION)
        except BaseException:
            await pool.close()
            raise
        self._pool = pool

    async def aclose(self) -> None:
        """Close the pool."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    @property
    def pool(self) -> asyncpg.Pool[asyncpg.Record]:
        """The open pool."""
        if self._pool is None:
            raise asyncpg.InterfaceError("the state store is not open")
        return self._pool

    # -- audit and ledger ---------------------------------------------------------------------

    async def commit(self, batch: Sequence[Write], touched: Mapping[str, float]) -> None:
        """Write the batch in one transaction. Rows of ``nodes`` are written first, in node id order:
        control-planes sharing the database write the same nodes' rows, and two transactions taking
        them in different orders deadlock (PostgreSQL aborts one: seen with two replicas). Committed
        once; a batch sent again by the writer adds no run or state change twice."""
        ending = {id(write) for write in batch if isinstance(write, LedgerEntry)}
        seen = sorted((w for w in batch if isinstance(w, NodeSeen)), key=lambda w: w.node_id)

        async def write_batch(conn: Connection) -> None:
            runs: list[tuple[object, ...]] = []
            for node in seen:  # the last report of a node wins, as in batch order (sorted() is stable)
                await conn.execute(_UPSERT_NODE, node.node_id, node.labels, node.address, node.models, node.at)
            if touched:
                sql = "UPDATE nodes SET last_seen = $1 WHERE node_id = $2"
                await conn.executemany(sql, [(touched[node_id], node_id) for node_id in sorted(touched)])
            for write in batch:
                match write:
                    case LedgerEntry():
                        row = ledger.run_row(write)
                        run = await conn.fetchval(_ENDED_RUN, *row)
                        if run is not None:  # else written before (and added to the usage then)
                            await conn.executemany(_ATTEMPT, [(run, *row) for row in ledger.attempt_rows(write)])
                            runs.append(row)
                        if write.open_row is not None:
                            await conn.execute("DELETE FROM open_runs WHERE id = $1", write.open_row)
                    case Opened(entry) if id(entry) not in ending:
                        entry.open_row = await conn.fetchval(_OPEN, *ledger.open_row(entry, self._owner))
                    case Placed(entry, number, attempt) if id(entry) not in ending and entry.open_row is not None:
                        await conn.execute(_PLACED, *ledger.placed_row(entry, number, attempt), entry.open_row)
                    case StateChanged(node_id, at, state, reason):
                        await conn.execute(_STATE_CHANGED, node_id, at, state, reason)
                    case _:  # NodeSeen: written above
                        pass
            await _add_usage(conn, runs)

        await commit_once(self, "commit", write_batch)

    @on_fresh_sessions
    async def recover(self, stale_after: float) -> list[LeftOpen]:
        """Move open runs of control-planes silent for ``stale_after`` s to the ledger (row locks: once);
        those recorded interrupted (not those another control-plane ran to their end). Run again, it
        finds the open runs it moved gone."""
        recorded, runs = [], []
        async with self.pool.acquire() as conn, conn.transaction():
            for row in await conn.fetch(_RECOVER, self._owner, stale_after):
                if await conn.fetchval(_ENDED_ELSEWHERE, row["run_id"], row["requester"], row["caller"]):
                    continue
                run, tried = ledger.interrupted(tuple(row))
                runs.append(run)
                number = await conn.fetchval(_RUN, *run)
                if tried is not None:
                    await conn.execute(_ATTEMPT, number, *tried)
                recorded.append(ledger.left_open(number, tuple(row)))
            await _add_usage(conn, runs)
            forget = f"DELETE FROM replicas WHERE owner != $1 AND seen_at < {_NOW} - $2"  # noqa: S608 - fixed clock
            await conn.execute(forget, self._owner, stale_after)
        return recorded

    @on_fresh_sessions
    async def settle(self, left: LeftOpen, found: pb.LedgerRun) -> bool:
        """Put the node's record ``found`` in place of the interrupted run ``left``; False when the row is
        no longer interrupted (settled before, by this or another replica) or names another node."""
        run, attempt = ledger.settled_rows(left, found)
        async with self.pool.acquire() as conn, conn.transaction():
            before = await conn.fetchrow(_RUN_BY_ID, left.row)
            if await conn.execute(_SETTLE_RUN, *run) == "UPDATE 0":
                return False
            await conn.execute(_SETTLE_ATTEMPT, *attempt)
            after = await conn.fetchrow(_RUN_BY_ID, left.row)
            assert before is not None and after is not None  # the row the UPDATE changed
            for sql, width in _USAGE:  # the run's tokens and status move into the rollup
                await conn.execute(sql, *usage.delta(tuple(before), tuple(after), width))
        return True

    @on_fresh_sessions
    async def heartbeat(self) -> None:
        """Note this control-plane alive, by the server's clock (a time set, not added to)."""
        sql = (
            f"INSERT INTO replicas (owner, seen_at) VALUES ($1, {_NOW}) "  # noqa: S608 - fixed clock
            "ON CONFLICT (owner) DO UPDATE SET seen_at = excluded.seen_at"
        )
        await self.pool.execute(sql, self._owner)

    @on_fresh_sessions
    async def prune(self, max_runs: int, max_events: int) -> None:
        """Delete all but the newest runs and state changes (a second run finds nothing more to delete)."""
        async with self.pool.acquire() as conn, conn.transaction():
            cut = await conn.fetchval("SELECT COALESCE(MAX(id), 0) FROM runs") - max_runs
            if cut > 0:
                await conn.execute("DELETE FROM run_attempts WHERE run <= $1", cut)
                await conn.execute("DELETE FROM runs WHERE id <= $1", cut)
            sql = "DELETE FROM node_events WHERE ctid IN (SELECT ctid FROM node_events ORDER BY at DESC OFFSET $1)"
            await conn.execute(sql, max_events)

    @on_fresh_sessions  # a read
    async def nodes(self) -> list[tuple[str, float, str]]:
        """Every node seen."""
        return [tuple(row) for row in await self.pool.fetch("SELECT node_id, first_seen, models FROM nodes")]

    @on_fresh_sessions  # a read
    async def events(self, node_id: str) -> list[tuple[str, str]]:
        """(state, reason) of a node's changes, oldest first."""
        rows = await self.pool.fetch("SELECT state, reason FROM node_events WHERE node_id = $1 ORDER BY at", node_id)
        return [(row[0], row[1]) for row in rows]

    @on_fresh_sessions  # a read
    async def runs(self, request: pb.RunsList) -> pb.RunsListed:
        """Runs from the ledger, newest first."""
        clauses, params, limit = ledger.filters(request, lambda n: f"${n}")
        marks = itertools.count(len(params) + 1)
        sql = f"SELECT id, {ledger.RUN_COLUMNS} FROM runs {clauses} ORDER BY {ledger.NEWEST_FIRST} LIMIT ${next(marks)}"  # noqa: S608
        attempts = (
            f"SELECT {ledger.ATTEMPT_COLUMNS} FROM run_attempts WHERE run = ANY($1::bigint[]) ORDER BY run, attempt"  # noqa: S608
        )
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(sql, *params, limit + 1)
            shown = rows[:limit]
            tried: dict[int, list[Any]] = {}
            for row in await conn.fetch(attempts, [row[0] for row in shown]):
                tried.setdefault(row[0], []).append(tuple(row))
        runs = [ledger.run_message(tuple(row), tried.get(row[0], [])) for row in shown]
        return pb.RunsListed(runs=runs, more=len(rows) > limit)

    @on_fresh_sessions  # a read
    async def usage(self, request: pb.UsageList) -> pb.UsageListed:
        """Token usage per bucket."""
        sql, params = usage.select(request, lambda n: f"${n}")
        return usage.listed(await self.pool.fetch(sql, *params))  # records unpack as tuples do

    @on_fresh_sessions  # a read
    async def changes(self) -> dict[str, int]:
        """Each change kind's counter."""
        return {row[0]: row[1] for row in await self.pool.fetch("SELECT kind, serial FROM changes")}

    # -- policy and drains --------------------------------------------------------------------

    async def add_policy(self, text: str, sha256: str, source: str, applied_by: str) -> PolicyRecord:
        """Record a policy put in force."""
        now = time.time()
        sql = (
            "INSERT INTO policies (text, sha256, source, applied_by, applied_at) "
            "VALUES ($1, $2, $3, $4, $5) RETURNING version"
        )

        async def add(conn: Connection) -> int:
            version: int = await conn.fetchval(sql, text, sha256, source, applied_by, now)
            await conn.execute("UPDATE changes SET serial = serial + 1 WHERE kind = 'policy'")
            return version

        version = await commit_once(self, "add_policy", add)  # a new version each time it runs
        return PolicyRecord(version, text, source, applied_by, now)

    @on_fresh_sessions  # a read
    async def newest_policy(self) -> PolicyRecord | None:
        """The policy in force, if any."""
        row = await self.pool.fetchrow(_POLICY + " ORDER BY version DESC LIMIT 1")
        return None if row is None else PolicyRecord(*row)

    @on_fresh_sessions  # a read
    async def policies(self) -> list[PolicyRecord]:
        """Every applied policy, newest first."""
        return [PolicyRecord(*row) for row in await self.pool.fetch(_POLICY + " ORDER BY version DESC")]

    @on_fresh_sessions
    async def set_drain(self, node_id: str, reason: str, drained_by: str, *, drained: bool) -> None:
        """Drain or undrain a node. Run again, it sets the same row; the counter's second step only
        makes replicas read the drains once more."""
        async with self.pool.acquire() as conn, conn.transaction():
            if drained:
                sql = """INSERT INTO drains (node_id, reason, drained_by, at) VALUES ($1, $2, $3, $4)
                    ON CONFLICT (node_id) DO UPDATE SET reason = excluded.reason, drained_by = excluded.drained_by,
                    at = excluded.at"""
                await conn.execute(sql, node_id, reason, drained_by, time.time())
            else:
                await conn.execute("DELETE FROM drains WHERE node_id = $1", node_id)
            await conn.execute("UPDATE changes SET serial = serial + 1 WHERE kind = 'drains'")

    @on_fresh_sessions  # a read
    async def drains(self) -> dict[str, str]:
        """Drained node id -> reason."""
        return {row[0]: row[1] for row in await self.pool.fetch("SELECT node_id, reason FROM drains")}

    # -- identity -----------------------------------------------------------------------------

    async def add_token(self, row: TokenRow) -> None:
        """Store a new join token (once: run again, its insert would fail on its id)."""
        sql = "INSERT INTO join_tokens VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
        await commit_once(self, "add_token", lambda conn: conn.execute(sql, *row))

    @on_fresh_sessions  # a read
    async def tokens(self, token_id: str | None = None) -> list[TokenRow]:
        """Every token (or one), newest first."""
        sql = "SELECT * FROM join_tokens WHERE $1::text IS NULL OR id = $1 ORDER BY created_at DESC"
        return [tuple(row) for row in await self.pool.fetch(sql, token_id)]

    @on_fresh_sessions
    async def revoke_token(self, token_id: str, at: float) -> bool:
        """Mark a token revoked (run again, it keeps the first time and still finds the token)."""
        sql = "UPDATE join_tokens SET revoked_at = coalesce(revoked_at, $1) WHERE id = $2"
        return _changed(await self.pool.execute(sql, at, token_id)) > 0

    async def use_token(self, token_id: str) -> bool:
        """Count one use (once: an increment)."""
        sql = "UPDATE join_tokens SET used = used + 1 WHERE id = $1 AND used < uses"
        return _changed(await commit_once(self, "use_token", lambda conn: conn.execute(sql, token_id))) > 0

    async def add_attempt(self, at: float, token_id: str, address: str, name: str, outcome: str) -> None:
        """Record one join attempt (once: an insert)."""
        sql = "INSERT INTO join_audit VALUES ($1, $2, $3, $4, $5)"
        await commit_once(self, "add_attempt", lambda conn: conn.execute(sql, at, token_id, address, name, outcome))

    @on_fresh_sessions  # a read
    async def attempts(self) -> list[tuple[str, str, str, str]]:
        """Join attempts, oldest first."""
        rows = await self.pool.fetch("SELECT token_id, address, name, outcome FROM join_audit ORDER BY at")
        return [(row[0], row[1], row[2], row[3]) for row in rows]

    @on_fresh_sessions
    async def issue(self, node_id: str, serial: str, not_after: float, at: float) -> None:
        """Record a certificate issued (an upsert to the same values)."""
        sql = """INSERT INTO node_certificates VALUES ($1, $2, $3, $4, NULL, '') ON CONFLICT (serial) DO UPDATE
            SET node_id = excluded.node_id, issued_at = excluded.issued_at, not_after = excluded.not_after,
            revoked_at = NULL, reason = ''"""
        await self.pool.execute(sql, serial, node_id, at, not_after)

    async def revoke_node(self, node_id: str, reason: str, at: float, also: tuple[str, float] | None) -> list[str]:
        """Revoke a node's certificates; the serials (once: run again, it would find them revoked
        and name none)."""

        async def revoke(conn: Connection) -> list[str]:
            if also is not None:
                sql = "INSERT INTO node_certificates VALUES ($1, $2, $3, $4, NULL, '') ON CONFLICT DO NOTHING"
                await conn.execute(sql, also[0], node_id, at, also[1])
            rows = await conn.fetch(
                "UPDATE node_certificates SET revoked_at = $1, reason = $2 WHERE node_id = $3 AND revoked_at IS NULL "
                "RETURNING serial",
                at,
                reason,
                node_id,
            )
            if rows:
                await conn.execute("UPDATE changes SET serial = serial + 1 WHERE kind = 'revocations'")
            return [row[0] for row in rows]

        return await commit_once(self, "revoke_node", revoke)

    @on_fresh_sessions  # a read
    async def revoked(self) -> set[str]:
        """Every revoked serial."""
        rows = await self.pool.fetch("SELECT serial FROM node_certificates WHERE revoked_at IS NOT NULL")
        return {row[0] for row in rows}


async def _add_usage(conn: Connection, runs: list[tuple[object, ...]]) -> None:
    """Add ``runs`` (``runs`` rows being written) to the usage rollup: one upsert per key, in this transaction."""
    if runs:
        for table, rows in usage.rollup(runs):
            await conn.executemany(_ADD_USAGE[table], rows)


def _changed(status: str) -> int:
    """The row count of a command status such as ``UPDATE 3``."""
    return int(status.rsplit(" ", 1)[-1])
