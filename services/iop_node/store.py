"""The node's run history: one SQLite file in WAL mode, written by one group-committing task.

``record_start`` and ``record_end`` only enqueue: they cost a list append, so recording adds
nothing a run waits for. A single writer task wakes a few milliseconds after the first write
queued, runs everything queued in one transaction and commits, so a burst of runs costs one
commit. A row is read off its RunRecord when it is written, so a start written late already
shows what the run did since. Readers flush first and so always see their own writes.

Nothing is lost silently. A commit the file refuses (locked, disk I/O error, disk full, read
only) is rolled back, logged at error level, counted, and retried with backoff, its writes kept
in order ahead of newer ones; they land once the file takes writes again. Meanwhile the backlog
is bounded (``max_backlog`` writes): beyond it the oldest writes are dropped, counted and logged
at error level. A row that can never be written (it cannot be encoded, or SQLite rejects the
statement itself) is dropped alone, logged and counted, and the writer goes on. ``aclose`` keeps
retrying for ``close_timeout`` seconds, then logs and counts what it could not write.

The file holds unix epoch seconds; :class:`RunRecord` holds tz-aware UTC datetimes. The key is
``(node_id, connection, run_id)``: a client picks run ids for its own connection only, so no
peer can reach another's row by reusing its id, and the file may be shared by several nodes.
A version 1 file (keyed by the caller a request named) is rebuilt on open (``_MIGRATE_V1``); a
version 2 file gains the ``usage_estimated`` column (``_ADD_USAGE_ESTIMATED``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import json
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

import aiosqlite
import structlog

from iop_node.domain import RunRecord, RunStatus
from iop_node.metrics import NodeMetrics

__all__ = ["INTERRUPTED_MESSAGE", "SCHEMA_VERSION", "SqliteRunStore"]

_log = structlog.get_logger("iop.node.store")

SCHEMA_VERSION = 3
INTERRUPTED_MESSAGE = "node stopped while the run was in progress"

_COLUMNS = tuple(field.name for field in dataclasses.fields(RunRecord))  # the SELECT order
_TIMES = ("received_at", "started_at", "first_token_at", "finished_at")

_TABLE = """
CREATE TABLE {name} (
    run_id TEXT NOT NULL, node_id TEXT NOT NULL,
    connection TEXT NOT NULL DEFAULT '',  -- the connection the request came on: the scope of run_id
    peer TEXT NOT NULL DEFAULT '',  -- the sender's certificate name
    caller TEXT NOT NULL DEFAULT '', model TEXT NOT NULL,
    adapter TEXT NOT NULL DEFAULT '', status TEXT NOT NULL,
    error_code TEXT NOT NULL DEFAULT '', error_message TEXT NOT NULL DEFAULT '',
    received_at REAL, started_at REAL, first_token_at REAL, finished_at REAL,  -- unix seconds, NULL when unknown
    prompt_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0,
    finish_reason TEXT NOT NULL DEFAULT '', stderr_tail TEXT NOT NULL DEFAULT '',
    extra TEXT NOT NULL DEFAULT '{{}}',  -- a JSON object of strings
    PRIMARY KEY (node_id, connection, run_id)
)
"""
_INDEXES = tuple(
    f"CREATE INDEX IF NOT EXISTS runs_{column} ON runs ({column})"
    for column in ("status", "model", "received_at", "run_id")
)
_CREATE_V2 = (_TABLE.format(name="runs"), *_INDEXES)
# Version 3: 1 when the node counted the run's tokens itself (the backend reported none).
_ADD_USAGE_ESTIMATED = "ALTER TABLE runs ADD COLUMN usage_estimated INTEGER NOT NULL DEFAULT 0"

# The SQL below names RunRecord's fields, never input, so S608 (SQL injection) does not apply.
_V1_COLUMNS = ", ".join(name for name in _COLUMNS if name not in ("connection", "peer", "usage_estimated"))
# A v1 row was keyed by (node_id, caller, run_id) and knew no peer: its caller is the best
# account of who sent it. Its connection is unknown (''), unless two callers shared the run
# id on one node: those rows keep apart under 'v1:<caller>'. rowid order is kept (get's tiebreak).
_MIGRATE_V1 = (
    _TABLE.format(name="runs_v2"),
    f"INSERT INTO runs_v2 (connection, peer, {_V1_COLUMNS}) "  # noqa: S608
    "SELECT CASE WHEN count(*) OVER (PARTITION BY node_id, run_id) > 1 THEN 'v1:' || caller ELSE '' END, "
    f"caller, {_V1_COLUMNS} FROM runs ORDER BY rowid",
    "DROP TABLE runs",  # and its indexes
    "ALTER TABLE runs_v2 RENAME TO runs",
    *_INDEXES,
)

_INSERT = (
    f"INSERT INTO runs ({', '.join(_COLUMNS)}) VALUES ({', '.join(':' + name for name in _COLUMNS)}) "  # noqa: S608
    "ON CONFLICT (node_id, connection, run_id) DO UPDATE SET "
)
# Neither write touches another peer's row, should a connection id ever come round again.
_SAME_PEER = " WHERE runs.peer = excluded.peer"
# A repeated start refreshes a running row but never touches one that already has its outcome.
_START = (
    _INSERT + "model = excluded.model, adapter = excluded.adapter, "
    "received_at = excluded.received_at, started_at = excluded.started_at" + _SAME_PEER + " AND runs.status = 'running'"
)
# An end inserts the whole row if its start was lost; otherwise it keeps times the end does not know.
_END = _INSERT + (
    "adapter = COALESCE(NULLIF(excluded.adapter, ''), runs.adapter), status = excluded.status, "
    "error_code = excluded.error_code, error_message = excluded.error_message, "
    "started_at = COALESCE(excluded.started_at, runs.started_at), "
    "first_token_at = COALESCE(excluded.first_token_at, runs.first_token_at), "
    "finished_at = COALESCE(excluded.finished_at, runs.finished_at), "
    "prompt_tokens = excluded.prompt_tokens, completion_tokens = excluded.completion_tokens, "
    "usage_estimated = excluded.usage_estimated, finish_reason = excluded.finish_reason, "
    "stderr_tail = excluded.stderr_tail, extra = excluded.extra" + _SAME_PEER
)
_MARK_INTERRUPTED = """
UPDATE runs SET status = 'interrupted', error_message = :message, finished_at = :now
WHERE node_id = :node_id AND status = 'running'
"""
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM runs "  # noqa: S608
_GET = _SELECT + "WHERE run_id = :run_id ORDER BY received_at DESC, rowid DESC LIMIT 1"
_LIST = _SELECT + (
    "WHERE (:status IS NULL OR status = :status) AND (:model IS NULL OR model = :model) "
    "AND (:since IS NULL OR received_at >= :since) ORDER BY received_at DESC, rowid DESC LIMIT :limit"
)


_WAL_RETRY_FOR = 1.0  # seconds an immediately refused switch to WAL is tried again
_COMMIT_WINDOW = 0.005  # seconds the writer gathers writes before it commits them
_RETRY_FIRST = 0.05  # seconds before the first retry of a refused commit; doubles up to retry_max
_DROP_LOG_EVERY = 1.0  # seconds between "writes dropped" log lines (a full backlog drops one per write)
# SQLite's primary result codes that say the file cannot take writes now, not that a row is wrong.
_FILE_REFUSED = frozenset(
    {
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_READONLY,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_PROTOCOL,
    }
)


@dataclasses.dataclass(frozen=True, slots=True)
class _Write:
    """One queued statement, with the record its parameters are read from."""

    sql: str
    record: RunRecord


# What wakes the writer: _WINDOW_ENDED, a future (a flush: resolve it once
# everything queued before it is committed) or None (commit what is queued, then stop).
_Wake: TypeAlias = "str | asyncio.Future[None] | None"
_WINDOW_ENDED = "window ended"


class SqliteRunStore:
    """The run history in a SQLite file; conforms to ``iop_node.ports.RunStore``."""

    def __init__(
        self,
        path: Path,
        node_id: str,
        *,
        max_backlog: int = 100_000,
        metrics: NodeMetrics | None = None,
        busy_timeout: float = 5.0,
        retry_max: float = 5.0,
        close_timeout: float = 10.0,
    ) -> None:
        """``max_backlog``: writes kept while the file refuses commits (beyond it the oldest are dropped);
        ``busy_timeout``: seconds SQLite waits for another connection's lock before a statement fails;
        ``retry_max``: longest pause between retries of a refused commit; ``close_timeout``: how long
        ``aclose`` keeps retrying before it gives up on what is left."""
        self.path = path
        self.node_id = node_id
        self._max_backlog, self._busy_timeout = max_backlog, busy_timeout
        self._retry_max, self._close_timeout = retry_max, close_timeout
        self._metrics = metrics
        self._db: aiosqlite.Connection | None = None
        self._queue: asyncio.Queue[_Wake] = asyncio.Queue()
        self._backlog: collections.deque[_Write] = collections.deque()
        self._committing = 0  # writes taken off the backlog for the transaction under way
        self._window: asyncio.TimerHandle | None = None
        self._writer: asyncio.Task[None] | None = None
        self._closing_by: float | None = None  # aclose's deadline (monotonic), once it was called
        self._commits = 0
        self._drops_unlogged, self._drops_logged_at = 0, -_DROP_LOG_EVERY
        if metrics is not None:
            metrics.history_backlog.set_function(lambda: len(self._backlog) + self._committing)

    async def open(self, *, mark_interrupted: bool = True) -> int:
        """Open (creating) the file; mark this node's leftover running rows interrupted and return how many."""
        if self._db is not None:
            raise RuntimeError("the run store is already open")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connecting = aiosqlite.connect(self.path, timeout=self._busy_timeout)
        # aiosqlite's worker thread is not a daemon: a store left open (a crash path, a bug)
        # would keep the process from ever exiting. _thread is private to aiosqlite 0.22 (pinned).
        connecting._thread.daemon = True
        try:
            db = await connecting
        except BaseException:
            # Let aiosqlite's thread finish before the caller's loop may close, or it posts its
            # result to a closed loop and prints a traceback after our one-line error.
            await asyncio.to_thread(connecting._thread.join, 1.0)
            raise
        try:
            await _prepare(db)
            marked = await self._mark_interrupted(db) if mark_interrupted else 0
        except BaseException:
            await db.close()
            raise
        self._db = db
        self._queue = asyncio.Queue()
        self._closing_by = None
        self._writer = asyncio.create_task(self._write_loop(db), name="iop-run-store-writer")
        return marked

    async def aclose(self) -> None:
        """Commit everything queued (retrying for up to ``close_timeout`` s), stop the writer, close the file."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self._closing_by = time.monotonic() + self._close_timeout
            self._queue.put_nowait(None)
            await writer
        if self._window is not None:
            self._window.cancel()
            self._window = None
        if self._db is not None:
            await self._db.close()
            self._db = None

    close = aclose  # the name callers used before the lifecycle port's

    async def record_start(self, record: RunRecord) -> None:
        """Queue the row of a received run; returns before it is on disk."""
        self._write(_Write(_START, record))

    async def record_end(self, record: RunRecord) -> None:
        """Queue the run's outcome; returns before it is on disk."""
        self._write(_Write(_END, record))

    async def flush(self) -> None:
        """Wait until everything queued so far is committed (while the file refuses commits, that waits for it)."""
        writer = self._writer
        if writer is None:
            return
        done = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(done)
        await asyncio.wait((done, writer), return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            raise RuntimeError("the run store's writer stopped")

    async def get(self, run_id: str) -> RunRecord | None:
        """The run with this id (on any node sharing the file; the newest if several)."""
        rows = await self._query(_GET, {"run_id": run_id})
        return _record(rows[0]) if rows else None

    async def _mark_interrupted(self, db: aiosqlite.Connection) -> int:
        params = {"message": INTERRUPTED_MESSAGE, "now": time.time(), "node_id": self.node_id}
        cursor = await db.execute(_MARK_INTERRUPTED, params)
        await db.commit()
        if cursor.rowcount:
            _log.warning("runs_marked_interrupted", node_id=self.node_id, count=cursor.rowcount)
        return cursor.rowcount

    def _write(self, write: _Write) -> None:
        if self._writer is None:
            raise RuntimeError("the run store is not open")
        self._backlog.append(write)
        if len(self._backlog) > self._max_backlog:
            self._drop_oldest()
        if self._window is None:
            # Gather what the next milliseconds bring: fewer commits, and neither the writer
            # nor SQLite's thread (which takes the GIL) wakes while a run waits for its first token.
            self._window = asyncio.get_running_loop().call_later(_COMMIT_WINDOW, self._window_ended)

    def _window_ended(self) -> None:
        self._window = None
        self._queue.put_nowait(_WINDOW_ENDED)

    def _drop_oldest(self) -> None:
        """Keep the backlog at ``max_backlog`` writes: drop the oldest, count them, say so (once a second)."""
        excess = len(self._backlog) - self._max_backlog
        for _ in range(excess):
            self._backlog.popleft()
        self._count_dropped(excess, "backlog_full")
        self._drops_unlogged += excess
        if time.monotonic() - self._drops_logged_at >= _DROP_LOG_EVERY:
            self._log_drops()

    def _log_drops(self) -> None:
        """Say how many writes the full backlog dropped since the last time it was said."""
        if self._drops_unlogged:
            _log.error(
                "run_history_writes_dropped",
                node_id=self.node_id,
                dropped=self._drops_unlogged,
                max_backlog=self._max_backlog,
                reason="the backlog of writes the history file has not taken is full: the oldest are lost",
            )
            self._drops_unlogged, self._drops_logged_at = 0, time.monotonic()

    def _count_dropped(self, writes: int, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.history_writes_dropped.labels(reason).inc(writes)

    async def _write_loop(self, db: aiosqlite.Connection) -> None:
        while True:
            wakes = [await self._queue.get()]
            while not self._queue.empty():
                wakes.append(self._queue.get_nowait())
            await self._write_backlog(db)
            for wake in wakes:
                if isinstance(wake, asyncio.Future) and not wake.done():
                    wake.set_result(None)
            if None in wakes:
                return

    async def _write_backlog(self, db: aiosqlite.Connection) -> None:
        """Commit the backlog; while the file refuses, keep it and retry with backoff (at close, until the deadline)."""
        delay: float | None = _RETRY_FIRST
        refused_since: float | None = None
        while self._backlog and delay is not None:
            batch, self._backlog = self._backlog, collections.deque()
            self._committing = len(batch)
            try:
                await self._commit(db, batch)
            except Exception as exc:  # noqa: BLE001 - whatever the file says, the writes are kept and the writer goes on
                await _rollback(db)
                self._put_back(batch)
                if refused_since is None:
                    refused_since = time.monotonic()
                delay = await self._after_refusal(exc, delay)
                continue
            self._committing = 0
            self._log_drops()  # the last of them, if the once-a-second limit held them back
            if refused_since is not None:
                refused_for = round(time.monotonic() - refused_since, 3)
                _log.warning("run_history_recovered", node_id=self.node_id, written=len(batch), refused_for=refused_for)
                delay, refused_since = _RETRY_FIRST, None

    def _put_back(self, batch: collections.deque[_Write]) -> None:
        """A refused batch goes back in front of the writes queued meanwhile, in order."""
        batch.extend(self._backlog)
        self._backlog, self._committing = batch, 0
        if len(batch) > self._max_backlog:
            self._drop_oldest()

    async def _after_refusal(self, exc: Exception, delay: float) -> float | None:
        """Log and count a refused commit, then wait ``delay``; the next delay, or None once aclose gave up."""
        if self._metrics is not None:
            self._metrics.history_commit_failures.inc()
        pending = len(self._backlog)
        closing_by = self._closing_by
        if closing_by is not None and time.monotonic() >= closing_by:
            self._log_drops()
            _log.error("run_history_lost", node_id=self.node_id, writes=pending, error=str(exc))
            self._count_dropped(pending, "closed")
            self._backlog.clear()
            return None
        _log.error("run_commit_failed", node_id=self.node_id, backlog=pending, retry_in=delay, error=str(exc))
        self._log_drops()
        if closing_by is not None:
            delay = min(delay, max(0.0, closing_by - time.monotonic()))
        await asyncio.sleep(delay)
        return min(delay * 2, self._retry_max)

    async def _commit(self, db: aiosqlite.Connection, writes: Sequence[_Write]) -> None:
        """Write ``writes`` in one transaction; raises when the file refuses (the caller rolls back).

        Rows go to SQLite's thread as a few ``executemany`` calls instead of one trip each: the
        writes are split into phases where each run appears at most once (a run's second write
        is in the next phase, so its own writes keep their order), and each phase sends its
        starts, then its ends. A batch SQLite rejects a row of, or an end that did not land, is
        written again row by row to name the row; both statements are upserts, so a row
        written twice is written once.
        """
        phases: list[dict[str, list[tuple[_Write, dict[str, Any]]]]] = []
        seen: dict[tuple[str, str, str], int] = {}
        for write in writes:
            try:
                params = _params(write.record)
            except (TypeError, ValueError) as exc:  # a field that cannot be encoded: this row never will be
                self._unwritable(write, exc)
                continue
            record = write.record
            key = (record.node_id, record.connection, record.run_id)
            phase = seen[key] = seen.get(key, -1) + 1
            if phase == len(phases):
                phases.append({_START: [], _END: []})
            phases[phase][write.sql].append((write, params))
        for phase_writes in phases:
            for sql, batch in phase_writes.items():
                if batch:
                    await self._batch(db, sql, batch)
        await db.commit()
        self._commits += 1

    async def _batch(self, db: aiosqlite.Connection, sql: str, batch: Sequence[tuple[_Write, dict[str, Any]]]) -> None:
        try:
            cursor = await db.executemany(sql, [params for _, params in batch])
        except Exception as exc:
            if _file_refused(exc):
                raise
            await self._row_by_row(db, batch)
            return
        if sql is _END and cursor.rowcount < len(batch):
            await self._row_by_row(db, batch)

    async def _row_by_row(self, db: aiosqlite.Connection, batch: Sequence[tuple[_Write, dict[str, Any]]]) -> None:
        """Write each row alone, naming those SQLite rejects and the ends that do not land."""
        for write, params in batch:
            try:
                cursor = await db.execute(write.sql, params)
            except Exception as exc:
                if _file_refused(exc):
                    raise
                self._unwritable(write, exc)  # SQLite rejects the statement itself, whatever the file's state
                continue
            if write.sql is _END and not cursor.rowcount:  # only _SAME_PEER keeps an end from landing
                _log.error(
                    "run_write_refused", node_id=self.node_id, run_id=write.record.run_id, peer=write.record.peer
                )

    def _unwritable(self, write: _Write, exc: Exception) -> None:
        _log.error("run_write_failed", node_id=self.node_id, run_id=write.record.run_id, error=str(exc))
        self._count_dropped(1, "unwritable")

    async def _query(self, sql: str, params: dict[str, Any]) -> Sequence[sqlite3.Row]:
        await self.flush()
        if self._db is None:
            raise RuntimeError("the run store is not open")
        return tuple(await self._db.execute_fetchall(sql, params))

    # Last: inside the class body, ``list`` names this method from here on.
    async def list(
        self,
        *,
        status: RunStatus | None = None,
        model: str | None = None,
        since: datetime.datetime | None = None,
        limit: int = 100,
    ) -> Sequence[RunRecord]:
        """Runs newest received first; the filters combine with AND."""
        params = {"status": status, "model": model, "since": _epoch(since), "limit": limit}
        return [_record(row) for row in await self._query(_LIST, params)]


async def _prepare(db: aiosqlite.Connection) -> None:
    """Set WAL and the schema, migrating an older file; a reader of a current file writes nothing."""
    await _wal(db)
    await db.execute("PRAGMA synchronous=NORMAL")
    if await _version(db) == SCHEMA_VERSION:
        return
    # One transaction, taken before looking again: nodes sharing the file may open it together,
    # and a failure midway leaves the file as it was.
    await db.execute("BEGIN IMMEDIATE")
    try:
        version = await _version(db)
        ((old,),) = await db.execute_fetchall("SELECT count(*) FROM sqlite_master WHERE name = 'runs'")
        for statement in _upgrade(version, table=bool(old)):
            await db.execute(statement)
        await db.commit()
    except BaseException:
        await _rollback(db)
        raise
    if old and version < SCHEMA_VERSION:
        _log.info("run_history_migrated", from_version=version, to_version=SCHEMA_VERSION)


async def _wal(db: aiosqlite.Connection) -> None:
    """Switch the file to WAL. Taking a file out of rollback mode needs it to itself, and SQLite may
    refuse at once rather than wait (no busy handler): nodes opening an older file together retry
    for up to 1 s. A refusal that came after the busy timeout (a long transaction elsewhere) stands."""
    started = time.monotonic()
    while True:
        try:
            await db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() - started > _WAL_RETRY_FOR:
                raise
            await asyncio.sleep(0.02)


def _upgrade(version: int, *, table: bool) -> tuple[str, ...]:
    """The statements that bring a file at ``version`` (with or without a runs table) to SCHEMA_VERSION."""
    if version >= SCHEMA_VERSION:
        return ()  # another node upgraded it while this one waited for the lock
    # A table below version 2 is version 1's (the only earlier one), even if its version was never written.
    to_v2 = () if version == 2 else _MIGRATE_V1 if table else _CREATE_V2
    return (*to_v2, _ADD_USAGE_ESTIMATED, f"PRAGMA user_version = {SCHEMA_VERSION}")


async def _version(db: aiosqlite.Connection) -> int:
    """The file's schema version; RuntimeError if a newer node wrote it."""
    ((version,),) = await db.execute_fetchall("PRAGMA user_version")
    if version > SCHEMA_VERSION:
        raise RuntimeError(f"run history schema version {version} is newer than this node's {SCHEMA_VERSION}")
    return int(version)


async def _rollback(db: aiosqlite.Connection) -> None:
    try:
        await db.rollback()
    except (sqlite3.Error, ValueError) as exc:
        _log.error("run_rollback_failed", error=str(exc))


def _file_refused(exc: Exception) -> bool:
    """Whether the file (locked, I/O error, full, read only) or the connection to it, not the row, failed."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return code is not None and (code & 0xFF) in _FILE_REFUSED  # the primary code of an extended one
    return isinstance(exc, ValueError)  # aiosqlite's "no active connection"


def _params(record: RunRecord) -> dict[str, Any]:
    params: dict[str, Any] = {name: getattr(record, name) for name in _COLUMNS}
    params.update({name: _epoch(params[name]) for name in _TIMES})
    params["status"] = str(record.status)
    params["extra"] = json.dumps(record.extra, sort_keys=True)
    return params


def _record(row: sqlite3.Row) -> RunRecord:
    values: dict[str, Any] = dict(zip(_COLUMNS, row, strict=True))
    values.update({name: _datetime(values[name]) for name in _TIMES})
    values["status"] = RunStatus(values["status"])
    values["usage_estimated"] = bool(values["usage_estimated"])
    extra = json.loads(values["extra"] or "{}")
    values["extra"] = {str(key): str(value) for key, value in extra.items()} if isinstance(extra, dict) else {}
    return RunRecord(**values)


def _epoch(moment: datetime.datetime | None) -> float | None:
    """Unix seconds; a naive datetime is taken as UTC."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def _datetime(epoch: float | None) -> datetime.datetime | None:
    return None if epoch is None else datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC)
