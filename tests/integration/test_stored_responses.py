"""Stored responses (the Responses API) in both key stores, a SQLite file and a real PostgreSQL:
owner-scoped reads and deletes, retention, the per-key cap with its metric, and two edges sharing one store."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from key_store_helpers import StorageFactory, factory, new_database
from prometheus_client import CollectorRegistry
from worker.pg_server import PgServer, pg_server, required_binaries

from iop_edge.key_storage import KeyStorage
from iop_edge.pg_keys import PgKeyStorage
from iop_edge.settings import ResponsesSettings
from iop_edge.sqlite_keys import SqliteKeyStorage
from iop_edge.stored_responses import Cap, ResponseStore, StoredResponse, storage_for
from iop_wire.openai.errors import ApiError


@pytest.fixture(scope="module")
def postgres() -> Iterator[PgServer]:
    """A PostgreSQL server for this module."""
    with pg_server(required_binaries()) as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres"])
async def make(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StorageFactory]:
    """Opens key stores on one fresh file or database (as several edges would); closes them after the test."""
    where: str | Path = tmp_path / "keys.db"
    if request.param == "postgres":
        where = await new_database(request.getfixturevalue("postgres"))
    build = factory(request.param, where)
    opened: list[KeyStorage] = []

    def make() -> KeyStorage:
        store = build()
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.aclose()


async def _store(make: StorageFactory, **settings: float) -> ResponseStore:
    return ResponseStore(storage_for(await _keys(make)), ResponsesSettings(**settings), CollectorRegistry())


async def _keys(make: StorageFactory) -> KeyStorage:
    keys = make()
    await keys.open()
    return keys


def _row(response_id: str, owner: str = "alice", created_at: float | None = None, text: str = "é") -> StoredResponse:
    output: list[dict[str, Any]] = [{"type": "message", "text": text}]
    body = {"id": response_id, "object": "response", "output": output}
    items = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    return StoredResponse(response_id, owner, created_at or time.time(), body, items, [*items, *output])


async def test_a_response_is_found_only_by_its_owner_and_deleted_once(make: StorageFactory) -> None:
    store = await _store(make)
    await store.put(_row("resp_a"))
    found = await store.get("alice", "resp_a")
    assert found == _row("resp_a", created_at=found.created_at) if found else False
    assert await store.get("bob", "resp_a") is None and await store.get("alice", "resp_missing") is None
    assert not await store.delete("bob", "resp_a")
    assert await store.delete("alice", "resp_a") and not await store.delete("alice", "resp_a")
    assert await store.get("alice", "resp_a") is None


async def test_an_expired_response_is_not_found_and_is_swept(make: StorageFactory) -> None:
    store = await _store(make, retention_days=1, sweep_interval=0.01)
    await store.storage.put(_row("resp_old", created_at=time.time() - 2 * 86_400), cap=Cap(10, 10**6))  # no sweep
    assert await store.get("alice", "resp_old") is None  # past retention: gone at once for readers
    await store.put(_row("resp_new"))  # the edge's first write sweeps
    assert store.dropped.labels("retention")._value.get() == 1
    assert await store.get("alice", "resp_new") is not None


async def test_past_the_per_key_cap_the_oldest_are_dropped_and_counted(make: StorageFactory) -> None:
    store = await _store(make, max_per_key=3)
    now = time.time()
    for index in range(5):
        await store.put(_row(f"resp_{index}", created_at=now + index))
    await store.put(_row("resp_bob", owner="bob"))
    kept = [index for index in range(5) if await store.get("alice", f"resp_{index}") is not None]
    assert kept == [2, 3, 4] and await store.get("bob", "resp_bob") is not None
    assert store.dropped.labels("max_per_key")._value.get() == 2 and store.stored._value.get() == 6


async def test_past_the_per_key_bytes_the_oldest_are_dropped_the_newest_kept(make: StorageFactory) -> None:
    store = await _store(make, max_bytes_per_key=1024)  # each row below is 400-500 bytes: two fit
    now = time.time()
    for index in range(4):
        await store.put(_row(f"resp_{index}", created_at=now + index, text="x" * 100))
    kept = [index for index in range(4) if await store.get("alice", f"resp_{index}") is not None]
    assert kept == [2, 3] and store.dropped.labels("max_per_key")._value.get() == 2
    assert Cap(10, 1).overflow([("a", 5), ("b", 5)]) == ["a"]  # over alone, the newest is kept


async def test_two_edges_on_one_store_share_their_responses(make: StorageFactory) -> None:
    one, two = await _store(make), await _store(make)
    one.put_soon(_row("resp_shared"))
    await one.aclose()
    found = await two.get("alice", "resp_shared")
    assert found is not None and found.conversation[-1] == {"type": "message", "text": "é"}


async def test_a_store_that_is_away_loses_the_row_not_the_answer(make: StorageFactory) -> None:
    keys = await _keys(make)
    store = ResponseStore(storage_for(keys), ResponsesSettings(), CollectorRegistry())
    if isinstance(keys, PgKeyStorage):
        keys.pool.terminate()
    else:
        assert isinstance(keys, SqliteKeyStorage)
        keys.db.close()
    await store.put(_row("resp_lost"))  # logged and counted, not raised: the client still gets its answer
    assert store.dropped.labels("store_error")._value.get() == 1
    with pytest.raises(ApiError) as caught:
        await store.get("alice", "resp_lost")
    assert caught.value.status == 503 and caught.value.retry_after == 1.0
