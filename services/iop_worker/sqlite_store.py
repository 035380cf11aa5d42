"""The job store in one SQLite file (WAL): the default, for a worker on one machine.

Several store instances, in one process or several, may share the file: every change runs in a
``BEGIN IMMEDIATE`` transaction, so two leases never take the same line, and SQLite's busy
timeout makes the others wait their turn. Within an instance one connection serves all
coroutines, one transaction at a time (``_lock``). A file's content is written one chunk per
transaction, so an upload never holds the write lock for long; until its last chunk is in, the
file is hidden (status ``uploading``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
import time
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiosqlite
import structlog

from iop_worker.store import (
    BATCH_COLUMNS,
    FILE_COLUMNS,
    LINE_COLUMNS,
    OPEN_BATCH_STATUSES,
    SCHEMA,
    SCHEMA_VERSION,
    UPLOADING,
    BatchRecord,
    BatchStatus,
    FileRecord,
    LineKey,
    LineRecord,
    LineStatus,
    Outcome,
    RequestCounts,
    Usage,
    batch_from_row,
    batch_row,
    encode_fields,
    file_from_row,
    line_from_row,
    line_row,
    migrations,
    rechunk,
)

__all__ = ["SCHEMA_VERSION", "SqliteJobStore"]

_log = structlog.get_logger("iop.worker.store")

_RESULTS_PAGE = 500  # finished lines read per query by results()
_CANCEL_PER_WRITE = 1000  # lines cancel_pending marks per transaction
_CANCEL_SLICE = (
    "UPDATE lines SET status = 'cancelled', lease_expires = NULL WHERE batch_id = ? AND line IN ("
    "SELECT line FROM lines WHERE batch_id = ? "
    "AND (status = 'pending' OR (status = 'leased' AND lease_expires < ?)) LIMIT ?)"
)

# The SQL below names columns from the records' fields, never input, so S608 does not apply.
_FILES = f"SELECT {', '.join(FILE_COLUMNS)} FROM files "  # noqa: S608
_BATCHES = f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches "  # noqa: S608
_IN_PROGRESS = (
    "SELECT id FROM batches WHERE status = 'in_progress' AND (:batch_id IS NULL OR id = :batch_id) "
    "ORDER BY created_at, id"
)
# One batch's next lines to do, along the partial index lines_open (its condition, repeated, lets SQLite use it).
_CANDIDATES = f"""
SELECT {", ".join(LINE_COLUMNS)} FROM lines
WHERE batch_id = :batch_id AND status IN ('pending', 'leased')
  AND (status = 'pending' OR lease_expires < :now)
ORDER BY line LIMIT :limit
"""  # noqa: S608
_FINISH = """
UPDATE lines SET status = :status, result = :result, lease_expires = NULL
WHERE batch_id = :batch_id AND line = :line AND status = 'leased' AND lease_owner = :owner
"""
_ADD_USAGE = """
UPDATE batches SET prompt_tokens = prompt_tokens + ?, completion_tokens = completion_tokens + ?,
    total_tokens = total_tokens + ?
WHERE id = ?
"""
_COUNTS = """
SELECT count(*), coalesce(sum(status = 'completed'), 0), coalesce(sum(status = 'failed'), 0),
    coalesce(sum(status = 'cancelled'), 0)
FROM lines WHERE batch_id = ?
"""


class SqliteJobStore:
    """The job store in a SQLite file; conforms to ``iop_worker.store.JobStore``."""

    def __init__(self, path: Path, *, busy_timeout: float = 10.0) -> None:
        """``busy_timeout``: seconds a change waits for another connection's transaction."""
        self.path = path
        self.lease_takeovers = 0
        self._busy_timeout = busy_timeout
        self._db: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()  # one statement sequence at a time on the one connection

    async def open(self) -> None:
        """Open the file (created if missing) and create its tables."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = await aiosqlite.connect(self.path, isolation_level=None, timeout=self._busy_timeout)
        try:
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute("PRAGMA synchronous=NORMAL")
            await _create_schema(db)
        except BaseException:
            await db.close()
            raise
        self._db = db

    async def aclose(self) -> None:
        """Close the file."""
        db, self._db = self._db, None
        if db is not None:
            await db.close()

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        """One write transaction, taken at once (``BEGIN IMMEDIATE``): committed, or rolled back on error."""
        async with self._lock:
            db = self._connection()
            try:
                # Inside the try: a caller cancelled while BEGIN waits still has it rolled back after it.
                await db.execute("BEGIN IMMEDIATE")
                yield db
            except BaseException:
                await _rollback(db)
                raise
            await db.execute("COMMIT")

    async def _fetch(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[sqlite3.Row]:
        async with self._lock:
            return list(await self._connection().execute_fetchall(sql, params))

    def _connection(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("the job store is not open")
        return self._db

    async def put_file(self, record: FileRecord, chunks: AsyncIterable[bytes]) -> FileRecord:
        """Store a file's content as it arrives, one chunk per transaction; the record with its size."""
        placeholders = ", ".join("?" for _ in FILE_COLUMNS)
        row = dataclasses.astuple(dataclasses.replace(record, bytes=0, status=UPLOADING))
        async with self._transaction() as db:
            await db.execute(f"INSERT INTO files ({', '.join(FILE_COLUMNS)}) VALUES ({placeholders})", row)  # noqa: S608
        size = 0
        try:
            async for seq, chunk in _numbered(rechunk(chunks)):
                async with self._transaction() as db:
                    await db.execute(
                        "INSERT INTO file_chunks (file_id, seq, data) VALUES (?, ?, ?)", (record.id, seq, chunk)
                    )
                size += len(chunk)
        except BaseException:
            await self.delete_file(record.id)
            raise
        async with self._transaction() as db:
            await db.execute("UPDATE files SET bytes = ?, status = ? WHERE id = ?", (size, record.status, record.id))
        return dataclasses.replace(record, bytes=size)

    async def get_file(self, file_id: str) -> FileRecord | None:
        """A stored file, or None (also while it is being written)."""
        rows = await self._fetch(_FILES + "WHERE id = ? AND status != ?", (file_id, UPLOADING))
        return file_from_row(rows[0]) if rows else None

    async def list_files(
        self, *, after: str | None = None, limit: int = 20, purpose: str | None = None, caller: str | None = None
    ) -> tuple[list[FileRecord], bool]:
        """Files (of ``caller``; None: everyone's) newest first, after the file ``after``; and whether more follow."""
        where = "WHERE status != :uploading AND (:purpose IS NULL OR purpose = :purpose) "
        sql = _FILES + where + "AND (:caller IS NULL OR caller = :caller) " + _page("files")
        params = {"uploading": UPLOADING, "purpose": purpose, "caller": caller, "after": after, "limit": limit + 1}
        rows = [file_from_row(row) for row in await self._fetch(sql, params)]
        return rows[:limit], len(rows) > limit

    async def read_file(self, file_id: str) -> AsyncIterator[bytes]:
        """A file's content, chunk by chunk (nothing for an unknown file)."""
        if await self.get_file(file_id) is None:
            return
        seq = 0
        while rows := await self._fetch("SELECT data FROM file_chunks WHERE file_id = ? AND seq = ?", (file_id, seq)):
            yield bytes(rows[0][0])
            seq += 1

    async def drop_uploads(self, started_before: int) -> int:
        """Delete files still being written that were started before ``started_before``, with their content."""
        stale = "SELECT id FROM files WHERE status = ? AND created_at < ?"
        async with self._transaction() as db:
            await db.execute(f"DELETE FROM file_chunks WHERE file_id IN ({stale})", (UPLOADING, started_before))  # noqa: S608
            cursor = await db.execute(
                "DELETE FROM files WHERE status = ? AND created_at < ?", (UPLOADING, started_before)
            )
            return cursor.rowcount

    async def delete_file(self, file_id: str) -> bool:
        """Delete a file and its content; whether it existed."""
        async with self._transaction() as db:
            await db.execute("DELETE FROM file_chunks WHERE file_id = ?", (file_id,))
            cursor = await db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            return cursor.rowcount > 0

    async def create_batch(self, batch: BatchRecord, lines: Sequence[LineRecord]) -> None:
        """Store a batch and its lines, in one transaction."""
        batch_sql = f"INSERT INTO batches ({', '.join(BATCH_COLUMNS)}) VALUES ({', '.join('?' for _ in BATCH_COLUMNS)})"  # noqa: S608
        line_sql = f"INSERT INTO lines ({', '.join(LINE_COLUMNS)}) VALUES ({', '.join('?' for _ in LINE_COLUMNS)})"  # noqa: S608
        async with self._transaction() as db:
            await db.execute(batch_sql, batch_row(batch))
            await db.executemany(line_sql, [line_row(line) for line in lines])

    async def add_lines(self, lines: Sequence[LineRecord]) -> None:
        """Store more lines of a batch being validated, in one transaction; a line already stored is kept."""
        columns, marks = ", ".join(LINE_COLUMNS), ", ".join("?" for _ in LINE_COLUMNS)
        line_sql = f"INSERT OR IGNORE INTO lines ({columns}) VALUES ({marks})"  # noqa: S608
        async with self._transaction() as db:
            await db.executemany(line_sql, [line_row(line) for line in lines])

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        """A batch, or None."""
        rows = await self._fetch(_BATCHES + "WHERE id = ?", (batch_id,))
        return batch_from_row(rows[0]) if rows else None

    async def list_batches(
        self, *, after: str | None = None, limit: int = 20, caller: str | None = None
    ) -> tuple[list[BatchRecord], bool]:
        """Batches (of ``caller``; None: everyone's) newest first, after ``after``; and whether more follow."""
        sql = _BATCHES + "WHERE (:caller IS NULL OR caller = :caller) " + _page("batches")
        params = {"caller": caller, "after": after, "limit": limit + 1}
        rows = [batch_from_row(row) for row in await self._fetch(sql, params)]
        return rows[:limit], len(rows) > limit

    async def update_batch(self, batch_id: str, **fields: Any) -> BatchRecord | None:
        """Set the named fields (``store.UPDATABLE``); the batch as it is now, or None."""
        values = encode_fields(fields)
        async with self._transaction() as db:
            if values:
                assignments = ", ".join(f"{name} = :{name}" for name in values)
                await db.execute(f"UPDATE batches SET {assignments} WHERE id = :id", {**values, "id": batch_id})  # noqa: S608
            rows = list(await db.execute_fetchall(_BATCHES + "WHERE id = ?", (batch_id,)))
        return batch_from_row(rows[0]) if rows else None

    async def transition(
        self, batch_id: str, from_statuses: Sequence[BatchStatus], to_status: BatchStatus, **fields: Any
    ) -> bool:
        """Set status (and fields) only if the status is one of ``from_statuses``, atomically."""
        values = encode_fields({**fields, "status": to_status})
        assignments = ", ".join(f"{name} = ?" for name in values)
        marks = ", ".join("?" for _ in from_statuses)
        sql = f"UPDATE batches SET {assignments} WHERE id = ? AND status IN ({marks})"  # noqa: S608
        async with self._transaction() as db:
            cursor = await db.execute(sql, (*values.values(), batch_id, *map(str, from_statuses)))
            return cursor.rowcount > 0

    async def lease(
        self, owner: str, *, limit: int, lease_seconds: float, batch_id: str | None = None
    ) -> list[LineRecord]:
        """Take up to ``limit`` pending or expired lines of batches in progress, oldest first."""
        now = time.time()
        expires = now + lease_seconds
        taken: list[LineRecord] = []
        async with self._transaction() as db:
            for (batch,) in await db.execute_fetchall(_IN_PROGRESS, {"batch_id": batch_id}):
                params = {"batch_id": batch, "now": now, "limit": limit - len(taken)}
                taken += [line_from_row(row) for row in await db.execute_fetchall(_CANDIDATES, params)]
                if len(taken) == limit:
                    break
            await db.executemany(
                "UPDATE lines SET status = 'leased', lease_owner = ?, lease_expires = ?, attempts = attempts + 1 "
                "WHERE batch_id = ? AND line = ?",
                [(owner, expires, line.batch_id, line.line) for line in taken],
            )
        self.lease_takeovers += sum(line.status == LineStatus.LEASED and line.lease_owner != owner for line in taken)
        return [
            dataclasses.replace(
                line, status=LineStatus.LEASED, lease_owner=owner, lease_expires=expires, attempts=line.attempts + 1
            )
            for line in taken
        ]

    async def renew(self, owner: str, keys: Sequence[LineKey], lease_seconds: float) -> int:
        """Extend ``owner``'s leases on ``keys``; how many it still held."""
        expires = time.time() + lease_seconds
        async with self._transaction() as db:
            return await _each(
                db,
                "UPDATE lines SET lease_expires = ? "
                "WHERE batch_id = ? AND line = ? AND status = 'leased' AND lease_owner = ?",
                [(expires, batch_id, line, owner) for batch_id, line in keys],
            )

    async def finish(  # noqa: PLR0917 - the line's key, its outcome and usage: the order callers expect
        self, owner: str, batch_id: str, line: int, status: LineStatus, result: str, usage: Usage
    ) -> bool:
        """Record a line's outcome and add its usage to the batch, only if ``owner`` still leases it."""
        if status not in (LineStatus.COMPLETED, LineStatus.FAILED):
            raise ValueError(f"a line finishes completed or failed, not {status}")
        params = {"status": str(status), "result": result, "batch_id": batch_id, "line": line, "owner": owner}
        async with self._transaction() as db:
            cursor = await db.execute(_FINISH, params)
            if cursor.rowcount == 0:
                return False
            await db.execute(_ADD_USAGE, (*Usage(*usage), batch_id))
        return True

    async def finish_many(self, owner: str, outcomes: Sequence[Outcome]) -> list[bool]:
        """``finish`` for several lines in one transaction; for each, whether ``owner`` still leased it."""
        written: list[bool] = []
        usage: dict[str, Usage] = {}
        async with self._transaction() as db:
            for batch_id, line, status, result, used in outcomes:
                params = {"status": str(status), "result": result, "batch_id": batch_id, "line": line, "owner": owner}
                cursor = await db.execute(_FINISH, params)
                written.append(cursor.rowcount > 0)
                if written[-1]:
                    total = usage.get(batch_id, Usage())
                    usage[batch_id] = Usage(*(a + b for a, b in zip(total, used, strict=True)))
            await db.executemany(_ADD_USAGE, [(*Usage(*used), batch_id) for batch_id, used in usage.items()])
        return written

    async def release(self, owner: str, keys: Sequence[LineKey]) -> int:
        """Give ``owner``'s leases on ``keys`` back (pending again); how many."""
        async with self._transaction() as db:
            return await _each(
                db,
                "UPDATE lines SET status = 'pending', lease_owner = NULL, lease_expires = NULL "
                "WHERE batch_id = ? AND line = ? AND status = 'leased' AND lease_owner = ?",
                [(batch_id, line, owner) for batch_id, line in keys],
            )

    async def cancel_pending(self, batch_id: str) -> int:
        """Mark the batch's pending lines, and those with expired leases, cancelled; how many.

        A slice of lines per transaction: SQLite rewrites each row whole (its body too), and
        50,000 lines of 4 KB in one transaction held the store, and every request, for 11 s.
        """
        cancelled, now = 0, time.time()
        while True:
            async with self._transaction() as db:
                cursor = await db.execute(_CANCEL_SLICE, (batch_id, batch_id, now, _CANCEL_PER_WRITE))
            cancelled += cursor.rowcount
            if cursor.rowcount < _CANCEL_PER_WRITE:
                return cancelled

    async def counts(self, batch_id: str) -> RequestCounts:
        """The batch's lines by outcome."""
        ((total, completed, failed, cancelled),) = await self._fetch(_COUNTS, (batch_id,))
        return RequestCounts(total, completed, failed, cancelled)

    async def results(self, batch_id: str) -> AsyncIterator[LineRecord]:
        """The batch's completed and failed lines, in input order, read a page at a time."""
        sql = (
            f"SELECT {', '.join(LINE_COLUMNS)} FROM lines WHERE batch_id = ? AND line > ? "  # noqa: S608
            "AND status IN ('completed', 'failed') ORDER BY line LIMIT ?"
        )
        last = -1
        while rows := await self._fetch(sql, (batch_id, last, _RESULTS_PAGE)):
            for row in rows:
                yield line_from_row(row)
            last = rows[-1][1]

    async def unfinished_batches(self) -> list[BatchRecord]:
        """Batches in an open status (``store.OPEN_BATCH_STATUSES``), oldest first."""
        marks = ", ".join("?" for _ in OPEN_BATCH_STATUSES)
        sql = _BATCHES + f"WHERE status IN ({marks}) ORDER BY created_at, id"
        return [batch_from_row(row) for row in await self._fetch(sql, tuple(map(str, OPEN_BATCH_STATUSES)))]


def _page(table: str) -> str:
    """Newest first (created_at, then id), after the row with id :after, :limit rows."""
    return (
        f"AND (:after IS NULL OR (created_at, id) < (SELECT created_at, id FROM {table} WHERE id = :after)) "  # noqa: S608
        "ORDER BY created_at DESC, id DESC LIMIT :limit"
    )


async def _create_schema(db: aiosqlite.Connection) -> None:
    """Create the tables of SCHEMA_VERSION, in one transaction; RuntimeError if a newer worker wrote the file."""
    await db.execute("BEGIN IMMEDIATE")
    try:
        ((version,),) = await db.execute_fetchall("PRAGMA user_version")
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"job store schema version {version} is newer than this worker's {SCHEMA_VERSION}")
        for statement in migrations(version):
            await db.execute(statement)
        for statement in SCHEMA:
            await db.execute(statement.format(blob="BLOB", real="REAL", int="INTEGER"))
        await db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        await db.execute("COMMIT")
    except BaseException:
        await _rollback(db)
        raise


async def _rollback(db: aiosqlite.Connection) -> None:
    """Roll back, logging (not raising) a failure: the error that led here is the one to report."""
    try:
        await db.rollback()
    except (sqlite3.Error, ValueError) as exc:  # ValueError: aiosqlite's "no active connection"
        _log.error("job_store_rollback_failed", error=str(exc))


async def _each(db: aiosqlite.Connection, sql: str, rows: Sequence[tuple[Any, ...]]) -> int:
    """Run ``sql`` once per row; how many rows it changed in all."""
    changed = 0
    for row in rows:
        cursor = await db.execute(sql, row)
        changed += cursor.rowcount
    return changed


async def _numbered(chunks: AsyncIterable[bytes]) -> AsyncIterator[tuple[int, bytes]]:
    seq = 0
    async for chunk in chunks:
        yield seq, chunk
        seq += 1
