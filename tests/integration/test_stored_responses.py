"""Stored responses (the Responses API) in both key stores, a SQLite file and a real PostgreSQL:
owner-scoped reads of one column and deletes, retention, the per-key cap with its metric, the owners' totals
kept with every write, two edges sharing one store, and a PostgreSQL store upgraded from schema 4."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from key_store_helpers import StorageFactory, factory, new_database
from prometheus_client import CollectorRegistry
from worker.pg_server import PgServer, pg_server, required_binaries

from iop_edge.key_storage import MIGRATIONS, SCHEMA_VERSION, KeyStorage, SchemaTooNew
from iop_edge.pg_keys import PgKeyStorage
from iop_edge.settings import ResponsesSettings
from iop_edge.sqlite_keys import SqliteKeyStorage
from iop_edge.stored_responses import Cap, Column, ResponseStore, StoredResponse, storage_for
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


async def _get(store: ResponseStore, owner: str, response_id: str, column: Column = "body") -> Any:
    found = await store.get(owner, response_id, column)
    return None if found is None else json.loads(found)


async def _held(keys: KeyStorage, owner: str) -> tuple[int, int] | None:
    """``owner``'s totals in response_owners, and what its rows really hold (they must agree)."""
    totals = "SELECT responses, bytes FROM response_owners WHERE owner = {p}"
    actual = "SELECT count(*), coalesce(sum(size), 0) FROM responses WHERE owner = {p}"
    if isinstance(keys, PgKeyStorage):
        kept, real = (
            await keys.pool.fetchrow(totals.format(p="$1"), owner),
            await keys.pool.fetchrow(actual.format(p="$1"), owner),
        )
    else:
        assert isinstance(keys, SqliteKeyStorage)
        kept, real = (
            keys.db.execute(totals.format(p="?"), (owner,)).fetchone(),
            keys.db.execute(actual.format(p="?"), (owner,)).fetchone(),
        )
    assert real is not None  # an aggregate: always one row
    assert (tuple(kept) if kept else (0, 0)) == tuple(real)
    return None if kept is None else (kept[0], kept[1])


async def test_a_response_is_found_only_by_its_owner_and_deleted_once(make: StorageFactory) -> None:
    store = await _store(make)
    await store.put(_row("resp_a"))
    row = _row("resp_a")
    assert await _get(store, "alice", "resp_a") == row.body
    assert await _get(store, "alice", "resp_a", "input_items") == row.input_items
    assert await _get(store, "alice", "resp_a", "conversation") == row.conversation
    assert await store.get("bob", "resp_a", "body") is None and await store.get("alice", "resp_missing", "body") is None
    assert not await store.delete("bob", "resp_a")
    assert await store.delete("alice", "resp_a") and not await store.delete("alice", "resp_a")
    assert await store.get("alice", "resp_a", "body") is None
    with pytest.raises(ValueError, match="no column"):
        await store.get("alice", "resp_a", "owner")  # type: ignore[arg-type]  # the one name put in SQL


async def test_an_expired_response_is_not_found_and_is_swept(make: StorageFactory) -> None:
    store = await _store(make, retention_days=1, sweep_interval=0.01)
    await store.storage.put(_row("resp_old", created_at=time.time() - 2 * 86_400), cap=Cap(10, 10**6))  # no sweep
    assert await store.get("alice", "resp_old", "body") is None  # past retention: gone at once for readers
    await store.put(_row("resp_new"))  # the edge's first write starts the sweep, a task of its own
    await store.aclose()  # which waits for it
    assert store.dropped.labels("retention")._value.get() == 1
    assert await store.get("alice", "resp_new", "body") is not None


async def test_past_the_per_key_cap_the_oldest_are_dropped_and_counted(make: StorageFactory) -> None:
    store = await _store(make, max_per_key=3)
    now = time.time()
    for index in range(5):
        await store.put(_row(f"resp_{index}", created_at=now + index))
    await store.put(_row("resp_bob", owner="bob"))
    kept = [index for index in range(5) if await store.get("alice", f"resp_{index}", "body") is not None]
    assert kept == [2, 3, 4] and await store.get("bob", "resp_bob", "body") is not None
    assert store.dropped.labels("max_per_key")._value.get() == 2 and store.stored._value.get() == 6


async def test_past_the_per_key_bytes_the_oldest_are_dropped_the_newest_kept(make: StorageFactory) -> None:
    store = await _store(make, max_bytes_per_key=1024)  # each row below is 400-500 bytes: two fit
    now = time.time()
    for index in range(4):
        await store.put(_row(f"resp_{index}", created_at=now + index, text="x" * 100))
    kept = [index for index in range(4) if await store.get("alice", f"resp_{index}", "body") is not None]
    assert kept == [2, 3] and store.dropped.labels("max_per_key")._value.get() == 2
    await store.put(_row("resp_huge", created_at=now + 9, text="x" * 2000))  # over alone: the others go, it stays
    assert await store.get("alice", "resp_huge", "body") is not None
    assert [index for index in range(4) if await store.get("alice", f"resp_{index}", "body")] == []


async def test_the_owners_totals_follow_every_write(make: StorageFactory) -> None:
    """response_owners holds each owner's count and bytes (so a store scans nothing): put, the cap's
    drops, delete and the sweep all keep it equal to the rows."""
    keys = await _keys(make)
    store = ResponseStore(storage_for(keys), ResponsesSettings(max_per_key=3, sweep_interval=3600), CollectorRegistry())
    now = time.time()
    for index in range(5):
        await store.put(_row(f"resp_{index}", created_at=now + index))
    assert (await _held(keys, "alice") or (0, 0))[0] == 3
    assert await store.delete("alice", "resp_4")
    assert (await _held(keys, "alice") or (0, 0))[0] == 2
    await store.storage.put(_row("resp_old", created_at=now - 9 * 86_400), cap=store.cap)
    await store.storage.put(_row("resp_bob", owner="bob", created_at=now - 9 * 86_400), cap=store.cap)
    assert await store.storage.sweep(now - 86_400) == 2
    assert (await _held(keys, "alice") or (0, 0))[0] == 2 and await _held(keys, "bob") == (0, 0)
    assert Cap(3, 10**6).batch(10) == 64 and Cap(3, 10**6).batch(1000) == 997  # as many as over, at least 64


async def test_two_edges_on_one_store_share_their_responses(make: StorageFactory) -> None:
    one, two = await _store(make), await _store(make)
    one.put_soon(_row("resp_shared"))
    await one.aclose()
    found = await _get(two, "alice", "resp_shared", "conversation")
    assert found is not None and found[-1] == {"type": "message", "text": "é"}


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
        await store.get("alice", "resp_lost", "body")
    assert caught.value.status == 503 and caught.value.retry_after == 1.0


async def test_a_postgresql_key_store_at_version_4_is_upgraded_to_5_keeping_its_keys(postgres: PgServer) -> None:
    """A shared store written by an edge before stored responses: the next edge adds ``responses``
    and ``response_owners`` in place, keeps the keys, and stores responses in it; one written by a
    newer edge (6) is refused, untouched."""
    url = await new_database(postgres)
    connection = await asyncpg.connect(url)
    try:
        async with connection.transaction():  # as the edge at schema 4 left it
            await connection.execute("CREATE TABLE edge_schema_version (version integer NOT NULL)")
            await connection.execute("INSERT INTO edge_schema_version (version) VALUES (4)")
            for step in MIGRATIONS[:4]:
                for statement in step:
                    await connection.execute(statement.format(real="double precision", id="BIGSERIAL PRIMARY KEY"))
            await connection.execute(
                "INSERT INTO keys (name, key_id, hash, created_at, admin) VALUES ('ci', 'kid', 'h', 1.0, TRUE)"
            )
        keys = PgKeyStorage(url)
        await keys.open()
        try:
            assert await connection.fetchval("SELECT version FROM edge_schema_version") == SCHEMA_VERSION == 5
            assert [info.name for info in await keys.list_keys()] == ["ci"]
            store = ResponseStore(storage_for(keys), ResponsesSettings(), CollectorRegistry())
            await store.put(_row("resp_after_upgrade", owner="ci"))
            assert await _get(store, "ci", "resp_after_upgrade") == _row("resp_after_upgrade").body
            assert await _held(keys, "ci") is not None
        finally:
            await keys.aclose()
        await connection.execute("UPDATE edge_schema_version SET version = 6")
        newer = PgKeyStorage(url)
        with pytest.raises(SchemaTooNew, match="is at schema version 6, newer than this edge's 5"):
            await newer.open()
        assert await connection.fetchval("SELECT count(*) FROM responses") == 1  # refused, not touched
    finally:
        await connection.close()


async def test_a_sweep_is_batched_and_runs_apart_from_the_put(make: StorageFactory) -> None:
    """Over a batch of expired rows: all deleted, counted, the totals right; the put that started the
    sweep returned before it (its row stored); a failed sweep is a sweep error, not a store error."""
    keys = await _keys(make)
    store = ResponseStore(storage_for(keys), ResponsesSettings(sweep_interval=0.01), CollectorRegistry())
    old = time.time() - 400 * 86_400
    for index in range(1_203):
        await store.storage.put(_row(f"resp_old{index}", owner=f"k{index % 3}", created_at=old), cap=store.cap)
    await store.put(_row("resp_new"))
    assert store._sweeping is not None and store.stored._value.get() == 1
    await store.aclose()
    left: object = store._sweeping  # (not narrowed by the assert above: the task ended and cleared it)
    assert store.dropped.labels("retention")._value.get() == 1_203 and left is None
    assert await _held(keys, "alice") is not None and [await _held(keys, f"k{n}") for n in range(3)] == [(0, 0)] * 3

    class Away:
        async def sweep(self, before: float) -> int:
            raise OSError("the store is away")

    store.storage.sweep = Away().sweep  # type: ignore[method-assign]
    store._swept = 0.0
    await store.put(_row("resp_later"))
    await store.aclose()
    assert store.sweep_errors._value.get() == 1 and store.dropped.labels("store_error")._value.get() == 0
    assert await store.get("alice", "resp_later", "body") is not None


async def test_a_response_stored_twice_counts_once_and_its_write_stays_findable(make: StorageFactory) -> None:
    """A stream's end and its client's leaving may both store one id: the second insert is a no-op, not
    counted; the first write's done callback does not forget the second write."""
    store = await _store(make)
    store.put_soon(_row("resp_twice"))
    first = store._writes["resp_twice"]
    store.put_soon(_row("resp_twice", text="later"))
    second = store._writes["resp_twice"]
    await first
    assert store._writes.get("resp_twice") is second
    await store.aclose()
    assert store.stored._value.get() == 1 and (await _get(store, "alice", "resp_twice"))["output"][0]["text"] == "é"


@pytest.mark.slow
async def test_concurrent_put_at_cap_sweep_and_delete_of_one_owner_never_deadlock(make: StorageFactory) -> None:
    """One owner at its cap, with expired rows: puts (dropping its oldest), the sweep and deletes at once,
    from two edges, many rounds: none fails (on PostgreSQL opposite lock orders deadlocked and aborted a
    put), and the owner's totals equal its rows."""
    keys_one, keys_two = await _keys(make), await _keys(make)
    one = ResponseStore(storage_for(keys_one), ResponsesSettings(max_per_key=5), CollectorRegistry())
    two = ResponseStore(storage_for(keys_two), ResponsesSettings(max_per_key=5), CollectorRegistry())
    now = time.time()
    for round_ in range(40):
        old = now - 30 * 86_400
        for index in range(30):
            await one.storage.put(_row(f"resp_x{round_}_{index}", created_at=old + index), cap=Cap(10**6, 10**9))
        puts = [
            (one if index % 2 else two).storage.put(_row(f"resp_{round_}_{index}", created_at=now + index), cap=one.cap)
            for index in range(8)
        ]
        sweeps = [one.storage.sweep(now - 86_400), two.storage.sweep(now - 86_400)]
        deletes = [two.storage.delete("alice", f"resp_{round_ - 1}_{index}") for index in range(8)]
        await asyncio.gather(*puts, *sweeps, *deletes)
        count, _ = await _held(keys_one, "alice") or (0, 0)
        assert count <= 5 + 8  # the cap, give or take what was put at once
    await one.storage.sweep(now - 86_400)
    count, _ = await _held(keys_one, "alice") or (0, 0)
    assert 0 < count <= 13
