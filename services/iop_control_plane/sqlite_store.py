"""The control-plane's state in one SQLite file (:class:`iop_control_plane.state.StateStore`).

One connection, used by one thread at a time (each call is one hop to a thread and one short
transaction); runs.list reads from a read-only connection of its own, so a long query never
waits for the writer (WAL). For one control-plane: replicas share a PostgreSQL store instead.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

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

__all__ = ["SqliteStore"]

_T = TypeVar("_T")
_DIALECT = Dialect(
    real="REAL", int="INTEGER", serial="INTEGER PRIMARY KEY", floor="CAST(%s AS INTEGER)", clustered=" WITHOUT ROWID"
)
_UPSERT_NODE = """
INSERT INTO nodes (node_id, labels, address, models, first_seen, last_seen) VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (node_id) DO UPDATE SET labels = excluded.labels, address = excluded.address,
    models = excluded.models, last_seen = excluded.last_seen
"""
_POLICY = "SELECT version, text, source, applied_by, applied_at FROM policies"
_OPEN = (
    "INSERT INTO open_runs (run_id, requester, connection, caller, model, received_at, owner) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_PLACED = "UPDATE open_runs SET node_id = ?, node_model = ?, attempt = ?, placed_after = ? WHERE id = ?"
_RUN = f"INSERT INTO runs ({ledger.RUN_COLUMNS}) VALUES ({', '.join('?' * 19)})"  # noqa: S608 - fixed columns
_RUN_BY_ID = f"SELECT {ledger.RUN_COLUMNS} FROM runs WHERE id = ?"  # noqa: S608 - fixed columns
_USAGE = [(usage.upsert_sql(table, lambda _: "?"), width) for table, width in usage.TABLES]
_ADD_USAGE = {table: usage.upsert_sql(table, lambda _: "?") for table, _ in usage.TABLES}
_SETTLE_RUN = ledger.settle_run_sql(lambda _: "?")
_SETTLE_ATTEMPT = ledger.settle_attempt_sql(lambda _: "?")
_ATTEMPT = f"INSERT INTO run_attempts ({ledger.ATTEMPT_COLUMNS}) VALUES ({', '.join('?' * 12)})"  # noqa: S608


class SqliteStore:
    """The state in the SQLite file ``path``."""

    shared = False
    sessions_lost = 0  # a file has no sessions for a server to end

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path)
        self._owner = ""
        self._db: sqlite3.Connection | None = None
        self._lock = asyncio.Lock()

    async def open(self, owner: str) -> None:
        """Create or migrate the file; StoreTooNew when a newer control-plane wrote it."""
        self._owner = owner
        self._db = await asyncio.to_thread(self._connect)

    async def aclose(self) -> None:
        """Close the file."""
        if self._db is not None:
            db, self._db = self._db, None
            async with self._lock:
                await asyncio.to_thread(db.close)

    # -- audit and ledger ---------------------------------------------------------------------

    async def commit(self, batch: Sequence[Write], touched: Mapping[str, float]) -> None:
        """Write the batch in one transaction."""
        await self._call(lambda db: self._commit(db, batch, touched))

    def _commit(self, db: sqlite3.Connection, batch: Sequence[Write], touched: Mapping[str, float]) -> None:
        ending = {id(write) for write in batch if isinstance(write, LedgerEntry)}
        runs: list[tuple[object, ...]] = []
        with db:
            for write in batch:
                match write:
                    case LedgerEntry():
                        runs.append(run := ledger.run_row(write))
                        cursor = db.execute(_RUN, run)
                        db.executemany(_ATTEMPT, [(cursor.lastrowid, *row) for row in ledger.attempt_rows(write)])
                        if write.open_row is not None:
                            db.execute("DELETE FROM open_runs WHERE id = ?", (write.open_row,))
                    case Opened(entry) if id(entry) not in ending:  # a run that ends in this batch needs none
                        entry.open_row = db.execute(_OPEN, ledger.open_row(entry, self._owner)).lastrowid
                    case Placed(entry, number, attempt) if id(entry) not in ending and entry.open_row is not None:
                        db.execute(_PLACED, (*ledger.placed_row(entry, number, attempt), entry.open_row))
                    case NodeSeen(node_id, labels, address, models, at):
                        db.execute(_UPSERT_NODE, (node_id, labels, address, models, at, at))
                    case StateChanged(node_id, at, state, reason):
                        sql = "INSERT INTO node_events (node_id, at, state, reason) VALUES (?, ?, ?, ?)"
                        db.execute(sql, (node_id, at, state, reason))
                    case _:
                        pass
            sql = "UPDATE nodes SET last_seen = ? WHERE node_id = ?"
            db.executemany(sql, [(at, node_id) for node_id, at in touched.items()])
            _add_usage(db, runs)

    async def recover(self, stale_after: float) -> list[LeftOpen]:
        """Move open runs of control-planes silent for ``stale_after`` s (0: every other) to the ledger."""
        return await self._call(lambda db: _recover(db, self._owner, time.time() - stale_after))

    async def settle(self, left: LeftOpen, found: pb.LedgerRun) -> bool:
        """Put the node's record ``found`` in place of the interrupted run ``left``; False when the row is
        no longer interrupted (settled before) or names another node."""
        run, attempt = ledger.settled_rows(left, found)

        def settle(db: sqlite3.Connection) -> bool:
            with db:
                before = db.execute(_RUN_BY_ID, (left.row,)).fetchone()
                if db.execute(_SETTLE_RUN, run).rowcount == 0:
                    return False
                db.execute(_SETTLE_ATTEMPT, attempt)
                after = db.execute(_RUN_BY_ID, (left.row,)).fetchone()
                for sql, width in _USAGE:  # the run's tokens and status move into the rollup
                    db.execute(sql, usage.delta(before, after, width))
                return True

        return await self._call(settle)

    async def heartbeat(self) -> None:
        """Note this control-plane alive."""
        sql = (
            "INSERT INTO replicas (owner, seen_at) VALUES (?, ?) "
            "ON CONFLICT (owner) DO UPDATE SET seen_at = excluded.seen_at"
        )
        await self._write(sql, (self._owner, time.time()))

    async def prune(self, max_runs: int, max_events: int) -> None:
        """Delete all but the newest runs and state changes."""

        def prune(db: sqlite3.Connection) -> None:
            with db:
                (newest,) = db.execute("SELECT COALESCE(MAX(id), 0) FROM runs").fetchone()
                if (cut := newest - max_runs) > 0:
                    db.execute("DELETE FROM run_attempts WHERE run <= ?", (cut,))
                    db.execute("DELETE FROM runs WHERE id <= ?", (cut,))
                sql = "DELETE FROM node_events WHERE rowid <= (SELECT MAX(rowid) FROM node_events) - ?"
                db.execute(sql, (max_events,))

        await self._call(prune)

    async def nodes(self) -> list[tuple[str, float, str]]:
        """Every node seen: (id, first seen, models JSON)."""
        return await self._rows("SELECT node_id, first_seen, models FROM nodes")

    async def events(self, node_id: str) -> list[tuple[str, str]]:
        """(state, reason) of a node's changes, oldest first."""
        return await self._rows("SELECT state, reason FROM node_events WHERE node_id = ? ORDER BY at", (node_id,))

    async def runs(self, request: pb.RunsList) -> pb.RunsListed:
        """Runs from the ledger, read on a connection of its own."""
        return await asyncio.to_thread(ledger.query, self.path, request)

    async def usage(self, request: pb.UsageList) -> pb.UsageListed:
        """Token usage per bucket, read on a connection of its own."""
        return await asyncio.to_thread(_usage, self.path, request)

    async def changes(self) -> dict[str, int]:
        """Each change kind's counter."""
        return dict(await self._rows("SELECT kind, serial FROM changes"))

    # -- policy and drains --------------------------------------------------------------------

    async def add_policy(self, text: str, sha256: str, source: str, applied_by: str) -> PolicyRecord:
        """Record a policy put in force."""
        now = time.time()

        def add(db: sqlite3.Connection) -> int:
            with db:
                sql = "INSERT INTO policies (text, sha256, source, applied_by, applied_at) VALUES (?, ?, ?, ?, ?)"
                version = db.execute(sql, (text, sha256, source, applied_by, now)).lastrowid
                db.execute("UPDATE changes SET serial = serial + 1 WHERE kind = 'policy'")
            assert version is not None
            return version

        return PolicyRecord(await self._call(add), text, source, applied_by, now)

    async def newest_policy(self) -> PolicyRecord | None:
        """The policy in force, if any."""
        rows = await self._rows(_POLICY + " ORDER BY version DESC LIMIT 1")
        return PolicyRecord(*rows[0]) if rows else None

    async def policies(self) -> list[PolicyRecord]:
        """Every applied policy, newest first."""
        return [PolicyRecord(*row) for row in await self._rows(_POLICY + " ORDER BY version DESC")]

    async def set_drain(self, node_id: str, reason: str, drained_by: str, *, drained: bool) -> None:
        """Drain or undrain a node."""

        def drain(db: sqlite3.Connection) -> None:
            with db:
                if drained:
                    sql = "INSERT OR REPLACE INTO drains (node_id, reason, drained_by, at) VALUES (?, ?, ?, ?)"
                    db.execute(sql, (node_id, reason, drained_by, time.time()))
                else:
                    db.execute("DELETE FROM drains WHERE node_id = ?", (node_id,))
                db.execute("UPDATE changes SET serial = serial + 1 WHERE kind = 'drains'")

        await self._call(drain)

    async def drains(self) -> dict[str, str]:
        """Drained node id -> reason."""
        return dict(await self._rows("SELECT node_id, reason FROM drains"))

    # -- identity -----------------------------------------------------------------------------

    async def add_token(self, row: TokenRow) -> None:
        """Store a new join token."""
        await self._write("INSERT INTO join_tokens VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)

    async def tokens(self, token_id: str | None = None) -> list[TokenRow]:
        """Every token (or one), newest first."""
        if token_id is None:
            return await self._rows("SELECT * FROM join_tokens ORDER BY created_at DESC")
        return await self._rows("SELECT * FROM join_tokens WHERE id = ?", (token_id,))

    async def revoke_token(self, token_id: str, at: float) -> bool:
        """Mark a token revoked."""
        sql = "UPDATE join_tokens SET revoked_at = coalesce(revoked_at, ?) WHERE id = ?"
        return await self._write(sql, (at, token_id)) > 0

    async def use_token(self, token_id: str) -> bool:
        """Count one use."""
        return await self._write("UPDATE join_tokens SET used = used + 1 WHERE id = ? AND used < uses", (token_id,)) > 0

    async def add_attempt(self, at: float, token_id: str, address: str, name: str, outcome: str) -> None:
        """Record one join attempt."""
        await self._write("INSERT INTO join_audit VALUES (?, ?, ?, ?, ?)", (at, token_id, address, name, outcome))

    async def attempts(self) -> list[tuple[str, str, str, str]]:
        """Join attempts, oldest first."""
        return await self._rows("SELECT token_id, address, name, outcome FROM join_audit ORDER BY at")

    async def issue(self, node_id: str, serial: str, not_after: float, at: float) -> None:
        """Record a certificate issued."""
        sql = "INSERT OR REPLACE INTO node_certificates VALUES (?, ?, ?, ?, NULL, '')"
        await self._write(sql, (serial, node_id, at, not_after))

    async def revoke_node(self, node_id: str, reason: str, at: float, also: tuple[str, float] | None) -> list[str]:
        """Revoke a node's certificates; the serials."""

        def revoke(db: sqlite3.Connection) -> list[str]:
            with db:
                if also is not None:
                    sql = "INSERT OR IGNORE INTO node_certificates VALUES (?, ?, ?, ?, NULL, '')"
                    db.execute(sql, (also[0], node_id, at, also[1]))
                query = "SELECT serial FROM node_certificates WHERE node_id = ? AND revoked_at IS NULL"
                serials = [serial for (serial,) in db.execute(query, (node_id,))]
                db.execute(
                    "UPDATE node_certificates SET revoked_at = ?, reason = ? WHERE node_id = ? AND revoked_at IS NULL",
                    (at, reason, node_id),
                )
                if serials:
                    db.execute("UPDATE changes SET serial = serial + 1 WHERE kind = 'revocations'")
            return serials

        return await self._call(revoke)

    async def revoked(self) -> set[str]:
        """Every revoked serial."""
        return {
            serial
            for (serial,) in await self._rows("SELECT serial FROM node_certificates WHERE revoked_at IS NOT NULL")
        }

    # -- plumbing -----------------------------------------------------------------------------

    async def _write(self, sql: str, params: tuple[object, ...]) -> int:
        def write(db: sqlite3.Connection) -> int:
            with db:
                return db.execute(sql, params).rowcount

        return await self._call(write)

    async def _rows(self, sql: str, params: tuple[object, ...] = ()) -> list[Any]:
        return await self._call(lambda db: db.execute(sql, params).fetchall())

    async def _call(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        if self._db is None:
            raise sqlite3.ProgrammingError("the state store is not open")
        db = self._db
        async with self._lock:  # one statement at a time on the one connection
            return await asyncio.to_thread(work, db)

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, timeout=10, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")  # readers (runs.list) never wait for the writer
            db.execute("PRAGMA synchronous=NORMAL")  # WAL: a commit survives a crash of the process
            _migrate(db)
        except BaseException:
            db.close()
            raise
        db.isolation_level = "DEFERRED"  # `with db:` opens a transaction again
        return db


def _migrate(db: sqlite3.Connection) -> None:
    """Bring the file to SCHEMA_VERSION in one transaction (a file without a version table is 0 or 1:
    version 1's steps create only what is missing)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("CREATE TABLE IF NOT EXISTS control_plane_schema (version INTEGER NOT NULL)")
        row = db.execute("SELECT max(version) FROM control_plane_schema").fetchone()
        version = row[0] or 0
        for sql in steps(version, _DIALECT):
            db.execute(sql)
        if version < SCHEMA_VERSION:
            db.execute("DELETE FROM control_plane_schema")
            db.execute("INSERT INTO control_plane_schema (version) VALUES (?)", (SCHEMA_VERSION,))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


_ENDED_ELSEWHERE = "SELECT EXISTS (SELECT 1 FROM runs WHERE run_id = ? AND requester = ? AND caller = ?)"


def _recover(db: sqlite3.Connection, owner: str, silent_since: float) -> list[LeftOpen]:
    """Move the open runs of owners other than ``owner`` not seen since ``silent_since`` to the ledger;
    those recorded interrupted (not those another control-plane ran to their end)."""
    with db:
        alive = "SELECT owner FROM replicas WHERE seen_at >= ?"
        where = f"owner != ? AND owner NOT IN ({alive})"
        select = f"SELECT {ledger.OPEN_COLUMNS} FROM open_runs WHERE {where} ORDER BY id"  # noqa: S608 - fixed clauses
        recorded, runs = [], []
        for row in db.execute(select, (owner, silent_since)).fetchall():
            if db.execute(_ENDED_ELSEWHERE, row[:2] + row[3:4]).fetchone()[0]:
                continue  # opened again through another control-plane and ended there: that row is its record
            run, tried = ledger.interrupted(row)
            runs.append(run)
            cursor = db.execute(_RUN, run)
            assert cursor.lastrowid is not None
            if tried is not None:
                db.execute(_ATTEMPT, (cursor.lastrowid, *tried))
            recorded.append(ledger.left_open(cursor.lastrowid, row))
        _add_usage(db, runs)
        db.execute(f"DELETE FROM open_runs WHERE {where}", (owner, silent_since))  # noqa: S608
        db.execute("DELETE FROM replicas WHERE owner != ? AND seen_at < ?", (owner, silent_since))
    return recorded


def _add_usage(db: sqlite3.Connection, runs: list[tuple[object, ...]]) -> None:
    """Add ``runs`` (``runs`` rows being written) to the usage rollup: one upsert per key, in this transaction."""
    if runs:
        for table, rows in usage.rollup(runs):
            db.executemany(_ADD_USAGE[table], rows)


def _usage(path: Path, request: pb.UsageList) -> pb.UsageListed:
    """usage.list from a read-only connection of its own to the SQLite file ``path``."""
    sql, params = usage.select(request, lambda _: "?")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return usage.listed(db.execute(sql, params).fetchall())
    finally:
        db.close()
