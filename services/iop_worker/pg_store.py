"""The job store in PostgreSQL: for workers on several machines sharing the work.

``lease`` picks lines with ``SELECT ... FOR UPDATE SKIP LOCKED``: concurrent workers skip the
lines another is taking instead of waiting for them, and never take the same line. Lease expiry
is set and judged by the server's clock (``statement_timestamp()``), so workers on machines whose
clocks disagree still agree on when a lease has lapsed. The schema is created if missing, under
an advisory lock so workers starting together do not race; its version is kept in
``iop_worker_schema``. A file's content is written one chunk per statement (``bytea``), so an
upload holds neither a long transaction nor a large buffer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any

import asyncpg

from iop_wire.pg import Connection, commit_once, on_fresh_sessions, shown_url
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

__all__ = ["SCHEMA_VERSION", "PgJobStore"]

_RESULTS_PAGE = 500  # finished lines read per query by results()
_SCHEMA_LOCK = 0x10B_3070  # the advisory lock key held while creating the schema
_NOW = "extract(epoch from statement_timestamp())::float8"  # unix seconds by the server's clock, one per statement

# The SQL below names columns from the records' fields, never input, so S608 does not apply.
_FILES = f"SELECT {', '.join(FILE_COLUMNS)} FROM files "  # noqa: S608
_BATCHES = f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches "  # noqa: S608
_PAGE = (
    "AND ($1::text IS NULL OR (created_at, id) < (SELECT created_at, id FROM {table} WHERE id = $1)) "
    "ORDER BY created_at DESC, id DESC LIMIT $2"
)
_IN_PROGRESS = (
    "SELECT id FROM batches WHERE status = 'in_progress' AND ($1::text IS NULL OR id = $1) ORDER BY created_at, id"
)
# One batch's next lines to do, along the partial index lines_open, skipping those another worker is taking.
_LEASE = f"""
WITH picked AS (
    SELECT batch_id, line, status AS was_status, lease_owner AS was_owner FROM lines
    WHERE batch_id = $2 AND status IN ('pending', 'leased') AND (status = 'pending' OR lease_expires < {_NOW})
        AND EXISTS (SELECT FROM batches WHERE id = $2 AND status = 'in_progress')
    ORDER BY line LIMIT $3
    FOR UPDATE SKIP LOCKED
)
UPDATE lines SET status = 'leased', lease_owner = $1, lease_expires = {_NOW} + $4, attempts = lines.attempts + 1
FROM picked WHERE lines.batch_id = picked.batch_id AND lines.line = picked.line
RETURNING {", ".join(f"lines.{name}" for name in LINE_COLUMNS)}, picked.was_status, picked.was_owner
"""  # noqa: S608
_KEYS = (  # the lines named by two arrays, $1 of batch ids and $2 of line numbers
    "FROM unnest($1::text[], $2::bigint[]) AS k(batch_id, line) "
    "WHERE lines.batch_id = k.batch_id AND lines.line = k.line"
)
_FINISH = """
UPDATE lines SET status = $1, result = $2, lease_expires = NULL
WHERE batch_id = $3 AND line = $4 AND status = 'leased' AND lease_owner = $5
"""
_ADD_USAGE = """
UPDATE batches SET prompt_tokens = prompt_tokens + $1, completion_tokens = completion_tokens + $2,
    total_tokens = total_tokens + $3
WHERE id = $4
"""
_COUNTS = """
SELECT count(*), count(*) FILTER (WHERE status = 'completed'), count(*) FILTER (WHERE status = 'failed'),
    count(*) FILTER (WHERE status = 'cancelled')
FROM lines WHERE batch_id = $1
"""
_RESULTS = (
    f"SELECT {', '.join(LINE_COLUMNS)} FROM lines WHERE batch_id = $1 AND line > $2 "  # noqa: S608
    "AND status IN ('completed', 'failed') ORDER BY line LIMIT $3"
)


# Each operation below marked on_fresh_sessions is one transaction or one statement, so a session
# lost in it left nothing done, unless only COMMIT's reply was lost; run again then, it changes
# nothing the first run did not (release finds the lease gone and says so). Those whose second run
# would answer wrong after such a commit (create_batch failing on its id, lease taking more lines,
# finish saying the lease was gone) run through commit_once, which asks the server first.


class PgJobStore:
    """The job store in a PostgreSQL database; conforms to ``iop_worker.store.JobStore``."""

    def __init__(self, url: str, *, min_connections: int = 1, max_connections: int = 8) -> None:
        """``url``: ``postgresql://user@host:port/database``; the pool keeps between the two numbers of connections."""
        self.url = url
        self.name = shown_url(url)
        self.lease_takeovers = 0
        self.sessions_lost = 0  # operations that met sessions the server had ended, and ran again
        self._sizes = (min_connections, max_connections)
        self._pool: asyncpg.Pool[asyncpg.Record] | None = None

    async def open(self) -> None:
        """Connect, and create the tables if missing."""
        pool = await asyncpg.create_pool(self.url, min_size=self._sizes[0], max_size=self._sizes[1])
        try:
            await _create_schema(pool)
        except BaseException:
            await pool.close()
            raise
        self._pool = pool

    async def aclose(self) -> None:
        """Close the connections."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    @property
    def pool(self) -> asyncpg.Pool[asyncpg.Record]:
        """The open pool."""
        if self._pool is None:
            raise RuntimeError("the job store is not open")
        return self._pool

    async def put_file(self, record: FileRecord, chunks: AsyncIterable[bytes]) -> FileRecord:
        """Store a file's content as it arrives, one chunk per statement; the record with its size."""
        pool = self.pool
        marks = ", ".join(f"${index}" for index in range(1, len(FILE_COLUMNS) + 1))
        row = dataclasses.astuple(dataclasses.replace(record, bytes=0, status=UPLOADING))
        await pool.execute(f"INSERT INTO files ({', '.join(FILE_COLUMNS)}) VALUES ({marks})", *row)  # noqa: S608
        size = seq = 0
        try:
            async for chunk in rechunk(chunks):
                await pool.execute(
                    "INSERT INTO file_chunks (file_id, seq, data) VALUES ($1, $2, $3)", record.id, seq, chunk
                )
                size, seq = size + len(chunk), seq + 1
        except BaseException:
            await self.delete_file(record.id)
            raise
        await pool.execute("UPDATE files SET bytes = $1, status = $2 WHERE id = $3", size, record.status, record.id)
        return dataclasses.replace(record, bytes=size)

    @on_fresh_sessions
    async def get_file(self, file_id: str) -> FileRecord | None:
        """A stored file, or None (also while it is being written)."""
        row = await self.pool.fetchrow(_FILES + "WHERE id = $1 AND status != $2", file_id, UPLOADING)
        return None if row is None else file_from_row(row)

    @on_fresh_sessions
    async def list_files(
        self, *, after: str | None = None, limit: int = 20, purpose: str | None = None, caller: str | None = None
    ) -> tuple[list[FileRecord], bool]:
        """Files (of ``caller``; None: everyone's) newest first, after the file ``after``; and whether more follow."""
        where = "WHERE status != $3 AND ($4::text IS NULL OR purpose = $4) AND ($5::text IS NULL OR caller = $5) "
        sql = _FILES + where + _PAGE.format(table="files")
        rows = await self.pool.fetch(sql, after, limit + 1, UPLOADING, purpose, caller)
        return [file_from_row(row) for row in rows[:limit]], len(rows) > limit

    async def read_file(self, file_id: str) -> AsyncIterator[bytes]:
        """A file's content, chunk by chunk (nothing for an unknown file)."""
        if await self.get_file(file_id) is None:
            return
        pool, seq = self.pool, 0
        sql = "SELECT data FROM file_chunks WHERE file_id = $1 AND seq = $2"
        while (data := await pool.fetchval(sql, file_id, seq)) is not None:
            yield bytes(data)
            seq += 1

    @on_fresh_sessions
    async def drop_uploads(self, started_before: int) -> int:
        """Delete files still being written that were started before ``started_before``, with their content."""
        stale = "SELECT id FROM files WHERE status = $1 AND created_at < $2"
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(f"DELETE FROM file_chunks WHERE file_id IN ({stale})", UPLOADING, started_before)  # noqa: S608
            status = await conn.execute(
                "DELETE FROM files WHERE status = $1 AND created_at < $2", UPLOADING, started_before
            )
            return _changed(status)

    @on_fresh_sessions
    async def delete_file(self, file_id: str) -> bool:
        """Delete a file and its content; whether it existed."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("DELETE FROM file_chunks WHERE file_id = $1", file_id)
            return _changed(await conn.execute("DELETE FROM files WHERE id = $1", file_id)) > 0

    async def create_batch(self, batch: BatchRecord, lines: Sequence[LineRecord]) -> None:
        """Store a batch and its lines, in one transaction (the lines by COPY); once: run again after
        it committed, it would fail on the batch's id."""
        marks = ", ".join(f"${index}" for index in range(1, len(BATCH_COLUMNS) + 1))
        rows = [line_row(line) for line in lines]

        async def create(conn: Connection) -> None:
            await conn.execute(f"INSERT INTO batches ({', '.join(BATCH_COLUMNS)}) VALUES ({marks})", *batch_row(batch))  # noqa: S608
            await conn.copy_records_to_table("lines", records=rows, columns=LINE_COLUMNS)

        await commit_once(self, "create_batch", create)

    @on_fresh_sessions
    async def add_lines(self, lines: Sequence[LineRecord]) -> None:
        """Store more lines of a batch being validated, in one transaction; a line already stored is kept."""
        marks = ", ".join(f"${index}" for index in range(1, len(LINE_COLUMNS) + 1))
        sql = f"INSERT INTO lines ({', '.join(LINE_COLUMNS)}) VALUES ({marks}) ON CONFLICT DO NOTHING"  # noqa: S608
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.executemany(sql, [line_row(line) for line in lines])

    @on_fresh_sessions
    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        """A batch, or None."""
        row = await self.pool.fetchrow(_BATCHES + "WHERE id = $1", batch_id)
        return None if row is None else batch_from_row(row)

    @on_fresh_sessions
    async def list_batches(
        self, *, after: str | None = None, limit: int = 20, caller: str | None = None
    ) -> tuple[list[BatchRecord], bool]:
        """Batches (of ``caller``; None: everyone's) newest first, after ``after``; and whether more follow."""
        sql = _BATCHES + "WHERE ($3::text IS NULL OR caller = $3) " + _PAGE.format(table="batches")
        rows = await self.pool.fetch(sql, after, limit + 1, caller)
        return [batch_from_row(row) for row in rows[:limit]], len(rows) > limit

    @on_fresh_sessions
    async def update_batch(self, batch_id: str, **fields: Any) -> BatchRecord | None:
        """Set the named fields (``store.UPDATABLE``); the batch as it is now, or None."""
        values = encode_fields(fields)
        if not values:
            return await self.get_batch(batch_id)
        assignments = ", ".join(f"{name} = ${index}" for index, name in enumerate(values, start=2))
        sql = f"UPDATE batches SET {assignments} WHERE id = $1 RETURNING {', '.join(BATCH_COLUMNS)}"  # noqa: S608
        row = await self.pool.fetchrow(sql, batch_id, *values.values())
        return None if row is None else batch_from_row(row)

    @on_fresh_sessions
    async def transition(
        self, batch_id: str, from_statuses: Sequence[BatchStatus], to_status: BatchStatus, **fields: Any
    ) -> bool:
        """Set status (and fields) only if the status is one of ``from_statuses``, atomically."""
        values = encode_fields({**fields, "status": to_status})
        assignments = ", ".join(f"{name} = ${index}" for index, name in enumerate(values, start=3))
        sql = f"UPDATE batches SET {assignments} WHERE id = $1 AND status = ANY($2::text[])"  # noqa: S608
        status = await self.pool.execute(sql, batch_id, [str(s) for s in from_statuses], *values.values())
        return _changed(status) > 0

    async def lease(
        self, owner: str, *, limit: int, lease_seconds: float, batch_id: str | None = None
    ) -> list[LineRecord]:
        """Take up to ``limit`` pending or expired lines of batches in progress, oldest first; once:
        run again after it committed, it would lease more lines, the first ones idle till they expire."""

        async def take(conn: Connection) -> list[asyncpg.Record]:
            rows: list[asyncpg.Record] = []
            for (batch,) in await conn.fetch(_IN_PROGRESS, batch_id):
                taken = await conn.fetch(_LEASE, owner, batch, limit - len(rows), lease_seconds)
                rows += sorted(taken, key=lambda row: row["line"])  # RETURNING has no order
                if len(rows) == limit:
                    break
            return rows

        rows = await commit_once(self, "lease", take)
        self.lease_takeovers += sum(row["was_status"] == "leased" and row["was_owner"] != owner for row in rows)
        return [line_from_row(row[: len(LINE_COLUMNS)]) for row in rows]

    @on_fresh_sessions
    async def renew(self, owner: str, keys: Sequence[LineKey], lease_seconds: float) -> int:
        """Extend ``owner``'s leases on ``keys``; how many it still held."""
        batch_ids, lines = _unzip(keys)
        sql = f"UPDATE lines SET lease_expires = {_NOW} + $4 {_KEYS} AND status = 'leased' AND lease_owner = $3"  # noqa: S608
        return _changed(await self.pool.execute(sql, batch_ids, lines, owner, lease_seconds))

    async def finish(  # noqa: PLR0917 - the line's key, its outcome and usage: the order callers expect
        self, owner: str, batch_id: str, line: int, status: LineStatus, result: str, usage: Usage
    ) -> bool:
        """Record a line's outcome and add its usage to the batch, only if ``owner`` still leases it;
        once: run again after it committed, it would find the lease gone and say so."""
        if status not in (LineStatus.COMPLETED, LineStatus.FAILED):
            raise ValueError(f"a line finishes completed or failed, not {status}")

        async def record(conn: Connection) -> bool:
            if not _changed(await conn.execute(_FINISH, str(status), result, batch_id, line, owner)):
                return False
            await conn.execute(_ADD_USAGE, *Usage(*usage), batch_id)
            return True

        return await commit_once(self, "finish", record)

    async def finish_many(self, owner: str, outcomes: Sequence[Outcome]) -> list[bool]:
        """``finish`` for several lines in one transaction; for each, whether ``owner`` still leased it
        (once, as ``finish``)."""

        async def record(conn: Connection) -> list[bool]:
            written: list[bool] = []
            usage: dict[str, Usage] = {}
            for batch_id, line, status, result, used in outcomes:
                written.append(_changed(await conn.execute(_FINISH, str(status), result, batch_id, line, owner)) > 0)
                if written[-1]:
                    total = usage.get(batch_id, Usage())
                    usage[batch_id] = Usage(*(a + b for a, b in zip(total, used, strict=True)))
            await conn.executemany(_ADD_USAGE, [(*Usage(*used), batch_id) for batch_id, used in usage.items()])
            return written

        return await commit_once(self, "finish_many", record)

    @on_fresh_sessions
    async def release(self, owner: str, keys: Sequence[LineKey]) -> int:
        """Give ``owner``'s leases on ``keys`` back (pending again); how many."""
        batch_ids, lines = _unzip(keys)
        sql = (
            f"UPDATE lines SET status = 'pending', lease_owner = NULL, lease_expires = NULL {_KEYS} "  # noqa: S608
            "AND status = 'leased' AND lease_owner = $3"
        )
        return _changed(await self.pool.execute(sql, batch_ids, lines, owner))

    @on_fresh_sessions
    async def cancel_pending(self, batch_id: str) -> int:
        """Mark the batch's pending lines, and those with expired leases, cancelled; how many."""
        sql = (
            "UPDATE lines SET status = 'cancelled', lease_expires = NULL WHERE batch_id = $1 "  # noqa: S608
            f"AND (status = 'pending' OR (status = 'leased' AND lease_expires < {_NOW}))"
        )
        return _changed(await self.pool.execute(sql, batch_id))

    @on_fresh_sessions
    async def counts(self, batch_id: str) -> RequestCounts:
        """The batch's lines by outcome."""
        row = await self.pool.fetchrow(_COUNTS, batch_id)
        assert row is not None  # an aggregate always returns its one row
        return RequestCounts(*row)

    async def results(self, batch_id: str) -> AsyncIterator[LineRecord]:
        """The batch's completed and failed lines, in input order, read a page at a time."""
        pool, last = self.pool, -1
        while rows := await pool.fetch(_RESULTS, batch_id, last, _RESULTS_PAGE):
            for row in rows:
                yield line_from_row(row)
            last = rows[-1]["line"]

    @on_fresh_sessions
    async def unfinished_batches(self) -> list[BatchRecord]:
        """Batches in an open status (``store.OPEN_BATCH_STATUSES``), oldest first."""
        sql = _BATCHES + "WHERE status = ANY($1::text[]) ORDER BY created_at, id"
        rows = await self.pool.fetch(sql, [str(status) for status in OPEN_BATCH_STATUSES])
        return [batch_from_row(row) for row in rows]


async def _create_schema(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    """Create the tables of SCHEMA_VERSION, in one transaction; RuntimeError if a newer worker did."""
    async with pool.acquire() as conn, conn.transaction():
        await _create_tables(conn)


async def _create_tables(conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record]) -> None:
    await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
    await conn.execute("CREATE TABLE IF NOT EXISTS iop_worker_schema (version integer NOT NULL)")
    version = await conn.fetchval("SELECT max(version) FROM iop_worker_schema")
    if version is not None and version > SCHEMA_VERSION:
        raise RuntimeError(f"job store schema version {version} is newer than this worker's {SCHEMA_VERSION}")
    for statement in migrations(version or 0):
        await conn.execute(statement)
    for statement in SCHEMA:
        await conn.execute(statement.format(blob="bytea", real="double precision", int="bigint"))
    if version is None:
        await conn.execute("INSERT INTO iop_worker_schema (version) VALUES ($1)", SCHEMA_VERSION)
    elif version < SCHEMA_VERSION:
        await conn.execute("UPDATE iop_worker_schema SET version = $1", SCHEMA_VERSION)


def _changed(status: str) -> int:
    """The row count of a command status such as ``UPDATE 3``."""
    return int(status.rsplit(" ", 1)[-1])


def _unzip(keys: Sequence[LineKey]) -> tuple[list[str], list[int]]:
    return [batch_id for batch_id, _ in keys], [line for _, line in keys]
