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
from typing import Any, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter

from iop_edge.key_storage import STORE_ERRORS, KeyStorage
from iop_edge.pg_keys import PgKeyStorage
from iop_edge.settings import ResponsesSettings
from iop_edge.sqlite_keys import SqliteKeyStorage, _immediate
from iop_wire.openai.errors import ApiError

__all__ = ["Cap", "ResponseStorage", "ResponseStore", "StoredResponse", "storage_for"]

_log = structlog.get_logger("iop.edge.responses")
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_HELD = "SELECT count(*), coalesce(sum(size), 0) FROM responses WHERE owner = {p}"
_BY_AGE = "SELECT id, size FROM responses WHERE owner = {p} ORDER BY created_at, id"


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
    conversation: list[dict[str, Any]]
    """Every item a ``previous_response_id`` naming this response replays, oldest first."""


class ResponseStorage(Protocol):
    """Rows of the ``responses`` table."""

    async def put(self, row: StoredResponse, *, cap: Cap) -> int:
        """Store ``row``; drop its owner's oldest past ``cap``; how many were dropped."""

    async def get(self, owner: str, response_id: str, *, since: float) -> StoredResponse | None:
        """``owner``'s response made after ``since``, if any."""

    async def delete(self, owner: str, response_id: str) -> bool:
        """Delete ``owner``'s response; whether there was one."""

    async def sweep(self, before: float) -> int:
        """Delete every response made before ``before``; how many."""


@dataclasses.dataclass(frozen=True, slots=True)
class Cap:
    """What one owner may keep."""

    responses: int
    """Stored responses."""
    bytes: int
    """Their stored JSON, in bytes."""

    def overflow(self, by_age: list[tuple[str, int]]) -> list[str]:
        """The ids to drop, oldest first, for ``by_age`` (id, size; oldest first) to fit; the newest stays."""
        count, size = len(by_age), sum(item_size for _, item_size in by_age)
        dropped = []
        for response_id, item_size in by_age[:-1]:
            if count <= self.responses and size <= self.bytes:
                break
            dropped.append(response_id)
            count, size = count - 1, size - item_size
        return dropped


def _row(values: Any) -> StoredResponse:
    response_id, owner, created_at, body, items, conversation = values[:6]
    return StoredResponse(response_id, owner, created_at, json.loads(body), json.loads(items), json.loads(conversation))


def _values(row: StoredResponse) -> tuple[Any, ...]:
    texts = (_dumps(row.body), _dumps(row.input_items), _dumps(row.conversation))
    return (row.id, row.owner, row.created_at, *texts, sum(len(text.encode()) for text in texts))


class SqliteResponses:
    """``responses`` in the key file (statements short, run inline as the key store's)."""

    def __init__(self, storage: SqliteKeyStorage) -> None:
        self.storage = storage

    async def put(self, row: StoredResponse, *, cap: Cap) -> int:
        """Store ``row``, dropping the owner's oldest past ``cap``."""
        db = self.storage.db
        with _immediate(db):
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)", _values(row))
            count, size = db.execute(_HELD.format(p="?"), (row.owner,)).fetchone()
            if count <= cap.responses and size <= cap.bytes:
                return 0
            dropped = cap.overflow(db.execute(_BY_AGE.format(p="?"), (row.owner,)).fetchall())
            db.executemany("DELETE FROM responses WHERE id = ?", [(response_id,) for response_id in dropped])
        return len(dropped)

    async def get(self, owner: str, response_id: str, *, since: float) -> StoredResponse | None:
        """The row, if ``owner``'s and recent enough."""
        found = self.storage.db.execute(
            "SELECT * FROM responses WHERE id = ? AND owner = ? AND created_at > ?", (response_id, owner, since)
        ).fetchone()
        return None if found is None else _row(found)

    async def delete(self, owner: str, response_id: str) -> bool:
        """Delete the row if ``owner``'s."""
        with _immediate(self.storage.db):
            cursor = self.storage.db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return cursor.rowcount > 0

    async def sweep(self, before: float) -> int:
        """Delete the rows made before ``before``."""
        with _immediate(self.storage.db):
            return self.storage.db.execute("DELETE FROM responses WHERE created_at < ?", (before,)).rowcount


class PgResponses:
    """``responses`` in the PostgreSQL key store, shared by every edge."""

    def __init__(self, storage: PgKeyStorage) -> None:
        self.storage = storage

    async def put(self, row: StoredResponse, *, cap: Cap) -> int:
        """Store ``row``, dropping the owner's oldest past ``cap`` (under the owner's lock)."""
        async with self.storage.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('iop_edge_responses:' || $1))", row.owner)
            await conn.execute(
                "INSERT INTO responses VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (id) DO NOTHING", *_values(row)
            )
            held = await conn.fetchrow(_HELD.format(p="$1"), row.owner)
            assert held is not None  # an aggregate: always one row
            count, size = held
            if count <= cap.responses and size <= cap.bytes:
                return 0
            by_age = [(item[0], item[1]) for item in await conn.fetch(_BY_AGE.format(p="$1"), row.owner)]
            dropped = cap.overflow(by_age)
            await conn.execute("DELETE FROM responses WHERE id = ANY($1::text[])", dropped)
        return len(dropped)

    async def get(self, owner: str, response_id: str, *, since: float) -> StoredResponse | None:
        """The row, if ``owner``'s and recent enough."""
        found = await self.storage.pool.fetchrow(
            "SELECT * FROM responses WHERE id = $1 AND owner = $2 AND created_at > $3", response_id, owner, since
        )
        return None if found is None else _row(tuple(found))

    async def delete(self, owner: str, response_id: str) -> bool:
        """Delete the row if ``owner``'s."""
        status = await self.storage.pool.execute(
            "DELETE FROM responses WHERE id = $1 AND owner = $2", response_id, owner
        )
        return bool(status != "DELETE 0")

    async def sweep(self, before: float) -> int:
        """Delete the rows made before ``before``."""
        status = await self.storage.pool.execute("DELETE FROM responses WHERE created_at < $1", before)
        return int(status.split()[-1])


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

    @property
    def _since(self) -> float:
        return time.time() - self.settings.retention_days * 86_400

    async def put(self, row: StoredResponse) -> None:
        """Store ``row``; the owner's oldest dropped past the cap; expired rows swept now and then.

        A store that is away loses the row (logged, counted as ``store_error``), not the answer: the
        run ran and its client gets it; only a later retrieve or ``previous_response_id`` misses it."""
        try:
            await self._put(row)
        except STORE_ERRORS as exc:
            self.dropped.labels("store_error").inc()
            _log.warning("a response could not be stored", response_id=row.id, owner=row.owner, error=str(exc))

    async def _put(self, row: StoredResponse) -> None:
        dropped = await self.storage.put(row, cap=self.cap)
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
        if time.monotonic() - self._swept >= self.settings.sweep_interval:
            self._swept = time.monotonic()
            if swept := await self.storage.sweep(self._since):
                self.dropped.labels("retention").inc(swept)
                _log.info(
                    "expired stored responses deleted", deleted=swept, retention_days=self.settings.retention_days
                )

    def put_soon(self, row: StoredResponse) -> None:
        """Store ``row`` in a task of its own (from a stream's end, which cannot wait)."""
        task = asyncio.ensure_future(self.put(row))
        self._writes[row.id] = task
        task.add_done_callback(lambda _: self._writes.pop(row.id, None))

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        """``owner``'s response, unless expired (after its write, when one is under way here); 503 when
        the store is away."""
        if (writing := self._writes.get(response_id)) is not None:
            await asyncio.shield(writing)
        try:
            return await self.storage.get(owner, response_id, since=self._since)
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
        """Wait for the writes under way."""
        await asyncio.gather(*self._writes.values(), return_exceptions=True)


def _away(exc: Exception) -> ApiError:
    _log.warning("the response store failed", error=str(exc) or type(exc).__name__)
    return ApiError(
        503,
        "stored responses cannot be read now: the edge's store is unavailable; retry shortly",
        code="service_unavailable",
        retry_after=1.0,
    )
