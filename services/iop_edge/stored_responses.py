"""The Responses API's stored responses, in the edge's key store (the SQLite ``keys_path``, or
PostgreSQL ``store.url`` shared by every edge): table ``responses`` (key store version 5).

A row holds one response by id: its owner (the key's name, ``anonymous`` with ``auth: none``),
when it was made, the Response object, its input items (``GET .../input_items``) and the
conversation a later ``previous_response_id`` replays (the earlier responses' items, its input,
its output), so continuing a conversation reads one row, never a chain. A response is stored
only after its run ran, so a row is no larger than what one run carries.

Bounds (:class:`ResponseStore`): a response older than ``responses.retention_days`` is not
found, and is deleted by the sweep that runs with the first store after ``sweep_interval``;
storing past ``responses.max_per_key`` responses or ``max_bytes_per_key`` bytes drops the key's
oldest. Both are logged and counted (``iop_edge_responses_dropped_total{reason}``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, Literal, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter

from iop_edge.key_storage import STORE_ERRORS, KeyStorage
from iop_edge.pg_keys import PgKeyStorage
from iop_edge.settings import ResponsesSettings
from iop_edge.sqlite_keys import SqliteKeyStorage, _immediate
from iop_wire.openai.errors import ApiError

__all__ = ["Cap", "Column", "ResponseStorage", "ResponseStore", "StoredResponse", "storage_for"]

_log = structlog.get_logger("iop.edge.responses")
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

Column = Literal["body", "input_items", "conversation"]
"""What a read takes of a row: one JSON column, as stored (a retrieve sends it as it is)."""

_COLUMNS: tuple[Column, ...] = ("body", "input_items", "conversation")
_BATCH = 64
"""The oldest rows fetched at a time when a key is over its bytes (over its count: as many as it is over)."""

# {p1}, {p2}, ...: the backend's placeholders. The owner's totals change in the transaction that changes its rows.
_PUT = (
    "INSERT INTO responses (id, owner, created_at, body, input_items, conversation, size)"
    " VALUES ({p1}, {p2}, {p3}, {p4}, {p5}, {p6}, {p7}) ON CONFLICT (id) DO NOTHING"
)
_HELD = (
    "INSERT INTO response_owners (owner, responses, bytes) VALUES ({p1}, 1, {p2}) ON CONFLICT (owner) DO UPDATE"
    " SET responses = response_owners.responses + 1, bytes = response_owners.bytes + excluded.bytes"
    " RETURNING responses, bytes"
)
_FREED = "UPDATE response_owners SET responses = responses - {p2}, bytes = bytes - {p3} WHERE owner = {p1}"
_OLDEST = "SELECT id, size FROM responses WHERE owner = {p1} AND id <> {p2} ORDER BY created_at, id LIMIT {p3}{lock}"
_READ = "SELECT {column} FROM responses WHERE id = {p1} AND owner = {p2} AND created_at > {p3}"
_DELETE = "DELETE FROM responses WHERE id = {p1} AND owner = {p2} RETURNING size"
_SWEEP_BATCH = 500
"""Expired rows deleted per statement (and per transaction): a sweep after long downtime is many short ones."""
_SWEEP = (
    "DELETE FROM responses WHERE id IN (SELECT id FROM responses WHERE created_at < {p1} ORDER BY created_at"
    " LIMIT 500) RETURNING owner, size"  # _SWEEP_BATCH
)
# PostgreSQL: the owner's totals row locked first (as put locks it), then that owner's expired rows
_LOCK_OWNER = "SELECT 1 FROM response_owners WHERE owner = $1 FOR UPDATE"
_EXPIRED_OWNERS = "SELECT DISTINCT owner FROM responses WHERE created_at < $1 ORDER BY owner"
_PG_SWEEP = (
    "DELETE FROM responses WHERE id IN (SELECT id FROM responses WHERE owner = $1 AND created_at < $2"
    " ORDER BY created_at LIMIT 500 FOR UPDATE SKIP LOCKED) RETURNING size"  # _SWEEP_BATCH
)
_SQLITE = {f"p{n}": f"?{n}" for n in range(1, 8)}  # numbered: _FREED names them out of order
_PG = {f"p{n}": f"${n}" for n in range(1, 8)}


@dataclasses.dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response."""

    id: str
    owner: str
    """The key's name it belongs to: another key's requests do not find it."""
    created_at: float
    """Unix seconds."""
    body: dict[str, Any]
    """The Response object as returned."""
    input_items: list[dict[str, Any]]
    """The request's input items (with ids), as ``input_items`` lists them."""
    conversation: list[dict[str, Any]] | None
    """Every item a ``previous_response_id`` naming this response replays, oldest first; None (JSON
    ``null``) for a response that failed or was cancelled, whose cut output is not continued."""


class ResponseStorage(Protocol):
    """Rows of the ``responses`` table, and their owners' totals in ``response_owners``."""

    async def put(self, row: StoredResponse, *, cap: Cap) -> int | None:
        """Store ``row``; drop its owner's oldest past ``cap``; how many were dropped (None: the id was
        there already, nothing stored)."""

    async def read(self, owner: str, response_id: str, column: Column, *, since: float) -> str | None:
        """``column`` (JSON text) of ``owner``'s response made after ``since``, if any."""

    async def delete(self, owner: str, response_id: str) -> bool:
        """Delete ``owner``'s response; whether there was one."""

    async def sweep(self, before: float) -> int:
        """Delete every response made before ``before``, in batches of short transactions; how many."""


@dataclasses.dataclass(frozen=True, slots=True)
class Cap:
    """What one owner may keep."""

    responses: int
    """Stored responses."""
    bytes: int
    """Their stored JSON, in bytes."""

    def over(self, count: int, size: int) -> bool:
        """Whether ``count`` responses of ``size`` bytes are past the cap."""
        return count > self.responses or size > self.bytes

    def batch(self, count: int) -> int:
        """How many of the oldest to fetch next, ``count`` held."""
        return max(count - self.responses, _BATCH)

    def take(self, oldest: list[tuple[str, int]], count: int, size: int) -> tuple[list[str], int, int]:
        """The ids of ``oldest`` (id, size; oldest first) to drop until ``count`` and ``size`` fit; what is left."""
        dropped = []
        for response_id, item_size in oldest:
            if not self.over(count, size):
                break
            dropped.append(response_id)
            count, size = count - 1, size - item_size
        return dropped, count, size


def _values(row: StoredResponse) -> tuple[Any, ...]:
    texts = (_dumps(row.body), _dumps(row.input_items), _dumps(row.conversation))
    return (row.id, row.owner, row.created_at, *texts, sum(len(text.encode()) for text in texts))


def _freed(rows: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """(owner, responses, bytes) freed per owner by deleting ``rows`` (owner, size)."""
    totals: dict[str, list[int]] = {}
    for owner, size in rows:
        total = totals.setdefault(owner, [0, 0])
        total[0], total[1] = total[0] + 1, total[1] + size
    return [(owner, count, size) for owner, (count, size) in totals.items()]


def _read_sql(column: Column, placeholders: dict[str, str]) -> str:
    if column not in _COLUMNS:  # the one name put into SQL: from this fixed set only
        raise ValueError(f"no column {column!r} in responses")
    return _READ.format(column=column, **placeholders)


class SqliteResponses:
    """``responses`` in the key file (statements short, run inline as the key store's)."""

    def __init__(self, storage: SqliteKeyStorage) -> None:
        self.storage = storage

    async def put(self, row: StoredResponse, *, cap: Cap) -> int | None:
        """Store ``row``, dropping the owner's oldest past ``cap`` (read along the owner's index, O(dropped))."""
        db = self.storage.db
        values = _values(row)
        dropped: list[str] = []
        with _immediate(db):
            if db.execute(_PUT.format(**_SQLITE), values).rowcount == 0:
                return None  # the id is there already
            count, size = db.execute(_HELD.format(**_SQLITE), (row.owner, values[-1])).fetchone()
            held = size
            while cap.over(count, size):
                oldest = db.execute(
                    _OLDEST.format(lock="", **_SQLITE), (row.owner, row.id, cap.batch(count))
                ).fetchall()
                taken, count, size = cap.take(oldest, count, size)
                if not taken:
                    break  # the new row alone is over: it stays
                db.executemany("DELETE FROM responses WHERE id = ?", [(response_id,) for response_id in taken])
                dropped += taken
            if dropped:
                db.execute(_FREED.format(**_SQLITE), (row.owner, len(dropped), held - size))
        return len(dropped)

    async def read(self, owner: str, response_id: str, column: Column, *, since: float) -> str | None:
        """The column, if ``owner``'s and recent enough."""
        found = self.storage.db.execute(_read_sql(column, _SQLITE), (response_id, owner, since)).fetchone()
        return None if found is None else str(found[0])

    async def delete(self, owner: str, response_id: str) -> bool:
        """Delete the row if ``owner``'s."""
        db = self.storage.db
        with _immediate(db):
            found = db.execute(_DELETE.format(**_SQLITE), (response_id, owner)).fetchone()
            if found is not None:
                db.execute(_FREED.format(**_SQLITE), (owner, 1, found[0]))
        return found is not None

    async def sweep(self, before: float) -> int:
        """Delete the rows made before ``before``, a batch per transaction (other writes run between)."""
        db, swept = self.storage.db, 0
        while True:
            with _immediate(db):
                rows = db.execute(_SWEEP.format(**_SQLITE), (before,)).fetchall()
                db.executemany(_FREED.format(**_SQLITE), _freed(rows))
            swept += len(rows)
            if len(rows) < _SWEEP_BATCH:
                return swept
            await asyncio.sleep(0)


class PgResponses:
    """``responses`` in the PostgreSQL key store, shared by every edge."""

    def __init__(self, storage: PgKeyStorage) -> None:
        self.storage = storage

    async def put(self, row: StoredResponse, *, cap: Cap) -> int | None:
        """Store ``row``, dropping the owner's oldest past ``cap``: the owner's totals row is locked (by
        its upsert) before any of its rows, till the end. The new row, inserted first, is seen by no one
        else before the commit, so no other write waits on it."""
        values = _values(row)
        dropped: list[str] = []
        async with self.storage.pool.acquire() as conn, conn.transaction():
            if await conn.execute(_PUT.format(**_PG), *values) == "INSERT 0 0":
                return None  # the id is there already
            held = await conn.fetchrow(_HELD.format(**_PG), row.owner, values[-1])
            assert held is not None  # an upsert's RETURNING: always one row
            count, size = held
            freed, gone = 0, 0
            while cap.over(count, size):
                oldest = await conn.fetch(
                    _OLDEST.format(lock=" FOR UPDATE SKIP LOCKED", **_PG), row.owner, row.id, cap.batch(count)
                )
                taken, count, size = cap.take([(item[0], item[1]) for item in oldest], count, size)
                if not taken:
                    break  # the new row alone is over: it stays
                # what was deleted here, not what was read: a sweep on another edge may have taken some
                sizes = await conn.fetch("DELETE FROM responses WHERE id = ANY($1::text[]) RETURNING size", taken)
                dropped += taken
                freed, gone = freed + sum(item[0] for item in sizes), gone + len(sizes)
            if gone:
                await conn.execute(_FREED.format(**_PG), row.owner, gone, freed)
        return len(dropped)

    async def read(self, owner: str, response_id: str, column: Column, *, since: float) -> str | None:
        """The column, if ``owner``'s and recent enough."""
        found = await self.storage.pool.fetchval(_read_sql(column, _PG), response_id, owner, since)
        return None if found is None else str(found)

    async def delete(self, owner: str, response_id: str) -> bool:
        """Delete the row if ``owner``'s (the owner's totals row locked first, as put and the sweep do)."""
        async with self.storage.pool.acquire() as conn, conn.transaction():
            await conn.execute(_LOCK_OWNER, owner)
            size = await conn.fetchval(_DELETE.format(**_PG), response_id, owner)
            if size is not None:
                await conn.execute(_FREED.format(**_PG), owner, 1, size)
        return size is not None

    async def sweep(self, before: float) -> int:
        """Delete the rows made before ``before``: owner by owner (sorted), a batch per short transaction
        that locks the owner's totals row first."""
        swept = 0
        for (owner,) in await self.storage.pool.fetch(_EXPIRED_OWNERS, before):
            while True:
                async with self.storage.pool.acquire() as conn, conn.transaction():
                    await conn.execute(_LOCK_OWNER, owner)
                    sizes = await conn.fetch(_PG_SWEEP, owner, before)
                    if sizes:
                        await conn.execute(_FREED.format(**_PG), owner, len(sizes), sum(item[0] for item in sizes))
                swept += len(sizes)
                if len(sizes) < _SWEEP_BATCH:
                    break
        return swept


def storage_for(keys: KeyStorage) -> ResponseStorage:
    """The ``responses`` table of an open key store."""
    if isinstance(keys, PgKeyStorage):
        return PgResponses(keys)
    if isinstance(keys, SqliteKeyStorage):
        return SqliteResponses(keys)
    raise TypeError(f"no responses table in {type(keys).__name__}")


class ResponseStore:
    """Stored responses with their bounds: retention, the per-key cap, the sweep; their metrics and logs.

    A streamed response is stored as its stream ends, while its last events are on their way: a
    ``previous_response_id`` naming it that reaches this edge first waits for that write (:meth:`get`).
    """

    def __init__(self, storage: ResponseStorage, settings: ResponsesSettings, registry: CollectorRegistry) -> None:
        self.storage = storage
        self.settings = settings
        self.cap = Cap(settings.max_per_key, settings.max_bytes_per_key)
        self._swept = 0.0
        self._writes: dict[str, asyncio.Task[None]] = {}
        self._sweeping: asyncio.Task[None] | None = None
        """The sweep under way, if any: one at a time."""
        self.stored = Counter(
            "iop_edge_responses_stored_total",
            "Responses stored (store: true) for the Responses API.",
            registry=registry,
        )
        self.dropped = Counter(
            "iop_edge_responses_dropped_total",
            "Stored responses deleted before their owner did: max_per_key (a key's oldest, past responses.max_per_key"
            " or max_bytes_per_key),"
            " retention (older than responses.retention_days), store_error (never stored: the store was away).",
            ["reason"],
            registry=registry,
        )
        self.sweep_errors = Counter(
            "iop_edge_responses_sweep_errors_total",
            "Sweeps of expired stored responses that failed (the store was away); the next store after"
            " responses.sweep_interval tries again.",
            registry=registry,
        )

    @property
    def _since(self) -> float:
        return time.time() - self.settings.retention_days * 86_400

    async def put(self, row: StoredResponse) -> None:
        """Store ``row``; the owner's oldest dropped past the cap; a sweep of expired rows started now and then.

        A store that is away loses the row (logged, counted as ``store_error``), not the answer: the
        run ran and its client gets it; only a later retrieve or ``previous_response_id`` misses it."""
        try:
            await self._put(row)
        except STORE_ERRORS as exc:
            self.dropped.labels("store_error").inc()
            _log.warning("a response could not be stored", response_id=row.id, owner=row.owner, error=str(exc))

    async def _put(self, row: StoredResponse) -> None:
        dropped = await self.storage.put(row, cap=self.cap)
        if dropped is None:
            return  # the id was stored already (a stream's end and its client's leaving both store it)
        self.stored.inc()
        if dropped:
            self.dropped.labels("max_per_key").inc(dropped)
            _log.warning(
                "stored responses dropped: key over responses.max_per_key or max_bytes_per_key",
                owner=row.owner,
                dropped=dropped,
                max_per_key=self.cap.responses,
                max_bytes_per_key=self.cap.bytes,
            )
        if time.monotonic() - self._swept >= self.settings.sweep_interval and self._sweeping is None:
            self._swept = time.monotonic()
            self._sweeping = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        """Delete the expired rows, apart from any create (which neither waits for it nor fails by it)."""
        try:
            if swept := await self.storage.sweep(self._since):
                self.dropped.labels("retention").inc(swept)
                _log.info(
                    "expired stored responses deleted", deleted=swept, retention_days=self.settings.retention_days
                )
        except STORE_ERRORS as exc:
            self.sweep_errors.inc()
            _log.warning("the sweep of expired stored responses failed", error=str(exc) or type(exc).__name__)
        finally:
            self._sweeping = None

    def put_soon(self, row: StoredResponse) -> None:
        """Store ``row`` in a task of its own (from a stream's end, which cannot wait)."""
        task = asyncio.ensure_future(self.put(row))
        self._writes[row.id] = task

        def done(_: asyncio.Task[None]) -> None:
            if self._writes.get(row.id) is task:  # a later write of the same id is its own entry
                del self._writes[row.id]

        task.add_done_callback(done)

    async def get(self, owner: str, response_id: str, column: Column) -> str | None:
        """``column`` (JSON text) of ``owner``'s response, unless expired (after its write, when one is
        under way here); 503 when the store is away. One column: a retrieve never parses the
        conversation, a continuation never the Response."""
        if (writing := self._writes.get(response_id)) is not None:
            await asyncio.shield(writing)
        try:
            return await self.storage.read(owner, response_id, column, since=self._since)
        except STORE_ERRORS as exc:
            raise _away(exc) from None

    async def delete(self, owner: str, response_id: str) -> bool:
        """Delete ``owner``'s response; whether there was one; 503 when the store is away."""
        if (writing := self._writes.get(response_id)) is not None:
            await asyncio.shield(writing)
        try:
            return await self.storage.delete(owner, response_id)
        except STORE_ERRORS as exc:
            raise _away(exc) from None

    async def aclose(self) -> None:
        """Wait for the writes and the sweep under way."""
        await asyncio.gather(*self._writes.values(), return_exceptions=True)
        if self._sweeping is not None:
            await asyncio.gather(self._sweeping, return_exceptions=True)


def _away(exc: Exception) -> ApiError:
    _log.warning("the response store failed", error=str(exc) or type(exc).__name__)
    return ApiError(
        503,
        "stored responses cannot be read now: the edge's store is unavailable; retry shortly",
        code="service_unavailable",
        retry_after=1.0,
    )
