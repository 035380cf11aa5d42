"""The key store suite, run against both stores (a SQLite file, a real PostgreSQL): the same
interface, the same behaviour, including budgets taken by two edges at once and the schema's
versions."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import asyncpg
import pytest
from key_store_helpers import StorageFactory, factory, new_database
from pg_faults import lost_reply
from worker.pg_server import PgServer, end_sessions, pg_server, required_binaries

from iop_edge.key_storage import SCHEMA_VERSION, KeyStorage, SchemaTooNew, UsageRow, UsageTotal
from iop_edge.keys import create_key, digest, list_keys
from iop_edge.pg_keys import PgKeyStorage
from iop_edge.usage import UsageRecorder


@pytest.fixture(scope="module")
def postgres() -> Iterator[PgServer]:
    """A PostgreSQL server for this module."""
    with pg_server(required_binaries()) as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres"])
async def make(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StorageFactory]:
    """Opens stores on one fresh file or database (as several edges would); closes them after the test."""
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


async def _open(make: StorageFactory) -> KeyStorage:
    store = make()
    await store.open()
    return store


async def test_keys_are_created_listed_revoked_and_their_names_never_reused(make: StorageFactory) -> None:
    store = await _open(make)
    await store.create("alice", digest("sk-iop-a"), rpm=10, tpm=1000, max_concurrent=2)
    await store.create("bob", digest("sk-iop-b"), rpm=None, tpm=None, max_concurrent=None)
    with pytest.raises(ValueError, match="key 'alice' exists"):
        await store.create("alice", digest("sk-iop-c"), rpm=None, tpm=None, max_concurrent=None)
    active = await store.active()
    assert active[digest("sk-iop-a")].name == "alice" and active[digest("sk-iop-a")].max_concurrent == 2
    assert await store.revoke("alice") and not await store.revoke("alice") and not await store.revoke("nobody")
    assert set((await store.active()).values()) == {active[digest("sk-iop-b")]}
    with pytest.raises(ValueError, match="key name 'alice' was used by a revoked key"):
        await store.create("alice", digest("sk-iop-d"), rpm=3, tpm=None, max_concurrent=None)
    infos = {info.name: info for info in await store.list_keys()}
    assert infos["alice"].rpm == 10 and infos["alice"].revoked_at is not None and infos["bob"].rpm is None
    assert infos["alice"].key_id == "key_" + digest("sk-iop-a")[:12]
    assert digest("sk-iop-d") not in await store.active()


async def test_two_edges_creating_one_name_at_once_make_one_key(make: StorageFactory) -> None:
    """Names are never given twice (records are kept by name), also to two creates racing from two edges."""
    one, two = await _open(make), await _open(make)

    async def create(store: KeyStorage, secret: str) -> bool:
        try:
            await store.create("carol", digest(secret), rpm=None, tpm=None, max_concurrent=None)
        except ValueError:
            return False
        return True

    made = await asyncio.gather(*(create(store, f"sk-iop-{i}") for i in range(8) for store in (one, two)))
    assert made.count(True) == 1
    assert [info.name for info in await one.list_keys()] == ["carol"]


async def test_admin_keys_are_kept_as_admin(make: StorageFactory) -> None:
    store = await _open(make)
    await store.create("ops", digest("sk-iop-o"), rpm=None, tpm=None, max_concurrent=None, admin=True)
    await store.create("team", digest("sk-iop-t"), rpm=None, tpm=None, max_concurrent=None)
    active = await store.active()
    assert active[digest("sk-iop-o")].admin and not active[digest("sk-iop-t")].admin
    assert [(info.name, info.admin) for info in await store.list_keys()] == [("ops", True), ("team", False)]


async def test_operations_right_after_the_server_ends_the_sessions_are_applied_once(postgres: PgServer) -> None:
    """The pool still holds sessions the server ended (a restart): a key lookup, ``iop keys create``
    or a usage write met one and failed. Each now runs on fresh sessions, and is applied once."""
    url = await new_database(postgres)
    database = url.rsplit("/", 1)[1]
    store = PgKeyStorage(url, max_connections=2)
    await store.open()
    rounds = 20
    operations: list[Callable[[int], Awaitable[object]]] = [
        lambda n: store.create(f"k{n}", digest(f"sk-iop-{n}"), rpm=None, tpm=None, max_concurrent=None),
        lambda n: store.active(),
        lambda n: store.add_usage([UsageRow("alice", 100, 1, 10)], "edge-1", f"b{n}"),
        lambda n: store.take("alice", "rpm", "edge-1", want=1, debt=0, limit=5 * rounds, window=60.0),
        lambda n: store.revoke(f"k{n}"),
    ]
    try:
        n = 0
        # Whether an operation meets an ended session or the pool saw the end first is a race: go on
        # past 20 rounds (to 100) until at least one did, so the path is exercised on every run.
        while n < rounds or (store.sessions_lost == 0 and n < 5 * rounds):
            for operation in operations:
                await asyncio.gather(store.changes(), store.changes())  # both sessions open, idle
                assert await end_sessions(postgres, database) >= 1
                assert await operation(n) is not False
            n += 1
        rounds = n
        assert dict(await store.usage()) == {"alice": UsageTotal(rounds, 10 * rounds)}
        assert (await store.take("alice", "rpm", "edge-1", want=1, debt=0, limit=rounds, window=60.0)).granted == 0
        assert [info.name for info in await store.list_keys() if info.revoked_at is not None] == [
            f"k{n}" for n in range(rounds)
        ]
        assert store.sessions_lost >= 1
    finally:
        await store.aclose()


async def test_a_budget_take_whose_commit_reply_is_lost_is_not_taken_again(postgres: PgServer) -> None:
    """The server committed the grant, and the reply was lost: taken again, the grant would count
    twice against the limit (and this one report nothing granted). The store asks the server
    whether the first committed, and reports that grant."""
    async with lost_reply(postgres, await new_database(postgres)) as lost:
        store = PgKeyStorage(lost.url, max_connections=1, timeout=10.0)
        await store.open()
        try:
            cutting = lost.cut_when_committed("key_grants")
            cutting.add_done_callback(lambda _: lost.proxy.pass_())  # reachable again at once
            grant = await store.take("alice", "rpm", "edge-1", want=1, debt=0, limit=2, window=60.0)
            await cutting
            assert grant.granted == 1 and grant.grant_id is not None
            assert (await store.take("alice", "rpm", "edge-1", want=1, debt=0, limit=2, window=60.0)).granted == 1
            assert store.sessions_lost == 1
        finally:
            await store.aclose()


async def test_a_usage_batch_committed_unseen_as_the_database_went_away_is_counted_once(postgres: PgServer) -> None:
    """The 251 against 250 once seen with PostgreSQL stopped: the server committed a usage batch,
    the reply was lost, and the database was away, so the edge could not ask. Its batch is sent
    again under its id, and found written."""
    async with lost_reply(postgres, await new_database(postgres)) as lost:
        store = PgKeyStorage(lost.url, max_connections=1, timeout=10.0)
        await store.open()
        try:
            usage = UsageRecorder(store, "edge-1")
            usage.record("alice", 10)
            cutting = lost.cut_when_committed("key_usage")
            assert not await usage.flush()  # its outcome unknown: kept
            await cutting
            usage.record("alice", 5)
            lost.proxy.pass_()
            assert await usage.flush() and not len(usage)
            assert dict(await store.usage()) == {"alice": UsageTotal(2, 15)}
        finally:
            await store.aclose()


async def test_every_create_and_revoke_is_a_change_another_store_sees(make: StorageFactory) -> None:
    one, two = await _open(make), await _open(make)
    before = await two.changes()
    assert await two.changes() == before  # nothing happened: nothing to re-read
    await one.create("alice", digest("sk-iop-a"), rpm=None, tpm=None, max_concurrent=None)
    after_create = await two.changes()
    assert after_create != before and digest("sk-iop-a") in await two.active()
    await one.revoke("alice")
    assert await two.changes() != after_create and not await two.active()


async def test_usage_adds_up_across_edges_and_batches_each_batch_once(make: StorageFactory) -> None:
    one, two = await _open(make), await _open(make)
    await one.add_usage([UsageRow("alice", 100, 2, 30), UsageRow("bob", 100, 1, 5)], "edge-1", "b1")
    await one.add_usage([UsageRow("alice", 100, 1, 10)], "edge-1", "b2")
    await one.add_usage([UsageRow("alice", 100, 1, 10)], "edge-1", "b2")  # sent again: found written
    await two.add_usage([UsageRow("alice", 101, 4, 0)], "edge-2", "b2")  # each edge's batches are its own
    assert dict(await one.usage()) == {"alice": UsageTotal(7, 40), "bob": UsageTotal(1, 5)}


async def test_takes_by_two_edges_at_once_never_pass_the_limit(make: StorageFactory) -> None:
    one, two = await _open(make), await _open(make)

    async def take(store: KeyStorage, edge: str) -> int:
        grant = await store.take("alice", "rpm", edge, want=7, debt=0, limit=100, window=60)
        return grant.granted

    granted = await asyncio.gather(*(take(store, f"e{i}") for i in range(20) for store in (one, two)))
    assert sum(granted) == 100
    refused = await one.take("alice", "rpm", "e0", want=5, debt=0, limit=100, window=60)
    assert refused.granted == 0 and refused.grant_id is None and 0 < refused.retry_after <= 60
    assert (await one.take("alice", "tpm", "e0", want=5, debt=0, limit=100, window=60)).granted == 5  # its own budget


async def test_given_back_units_can_be_taken_again_and_debts_count(make: StorageFactory) -> None:
    store = await _open(make)
    first = await store.take("alice", "tpm", "e1", want=60, debt=0, limit=100, window=60)
    assert first.granted == 60 and first.grant_id is not None
    assert (await store.take("alice", "tpm", "e2", want=60, debt=0, limit=100, window=60)).granted == 40
    await store.give_back([(first.grant_id, 25)])
    with_debt = await store.take("alice", "tpm", "e2", want=60, debt=10, limit=100, window=60)
    assert with_debt.granted == 15  # 25 back, 10 of them owed for tokens already spent
    assert (await store.take("alice", "tpm", "e1", want=1, debt=0, limit=100, window=60)).granted == 0


async def test_grants_leave_the_window(make: StorageFactory) -> None:
    store = await _open(make)
    assert (await store.take("alice", "rpm", "e1", want=5, debt=0, limit=5, window=0.3)).granted == 5
    refused = await store.take("alice", "rpm", "e1", want=5, debt=0, limit=5, window=0.3)
    assert refused.granted == 0 and refused.retry_after <= 0.3
    await asyncio.sleep(0.35)
    assert (await store.take("alice", "rpm", "e1", want=5, debt=0, limit=5, window=0.3)).granted == 5


async def test_slots_are_shared_and_lapse_when_not_renewed(make: StorageFactory) -> None:
    one, two = await _open(make), await _open(make)
    assert await one.hold_slots("alice", "e1", want=3, limit=4, ttl=60) == 3
    assert await two.hold_slots("alice", "e2", want=3, limit=4, ttl=60) == 1
    assert await one.hold_slots("alice", "e1", want=1, limit=4, ttl=60) == 1  # lets two go
    assert await two.hold_slots("alice", "e2", want=3, limit=4, ttl=60) == 3
    assert await one.hold_slots("alice", "e1", want=2, limit=4, ttl=60) == 1
    await asyncio.sleep(0.3)
    assert await one.hold_slots("alice", "e1", want=4, limit=4, ttl=0.2) == 4  # e2's lapsed


async def test_heartbeats_count_the_live_edges(make: StorageFactory) -> None:
    one, two = await _open(make), await _open(make)
    assert await one.heartbeat("e1", ttl=60) == 1
    assert await two.heartbeat("e2", ttl=60) == 2
    await asyncio.sleep(0.3)
    assert await one.heartbeat("e1", ttl=0.2) == 1


async def test_a_store_newer_than_this_edge_refuses_to_open_naming_it(
    make: StorageFactory, request: pytest.FixtureRequest
) -> None:
    store = await _open(make)
    table = "schema_version" if "sqlite" in request.node.callspec.id else "edge_schema_version"
    sql = f"UPDATE {table} SET version = {SCHEMA_VERSION + 1}"  # noqa: S608 - the test's own table name
    if isinstance(url := getattr(store, "url", None), str):
        connection = await asyncpg.connect(url)
        await connection.execute(sql)
        await connection.close()
    else:
        with sqlite3.connect(Path(store.name)) as db:
            db.execute(sql)
    newer = make()
    with pytest.raises(SchemaTooNew, match=f"^the key store {store.name} is at schema version {SCHEMA_VERSION + 1},"):
        await newer.open()


_V1 = """CREATE TABLE keys (
    name TEXT PRIMARY KEY, key_id TEXT NOT NULL UNIQUE, hash TEXT NOT NULL UNIQUE, created_at REAL NOT NULL,
    revoked_at REAL, rpm INTEGER CHECK (rpm IS NULL OR rpm >= 1), tpm INTEGER CHECK (tpm IS NULL OR tpm >= 1),
    max_concurrent INTEGER CHECK (max_concurrent IS NULL OR max_concurrent >= 1))"""


def test_a_key_file_from_before_versions_is_migrated_keeping_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    with sqlite3.connect(path) as db:  # as the edge before schema versions wrote it
        db.execute(_V1)
        db.execute("INSERT INTO keys VALUES ('old', 'key_0123', ?, 1.0, NULL, 5, NULL, NULL)", (digest("sk-iop-x"),))
    [old] = list_keys(path)
    assert (old.name, old.rpm, old.admin) == ("old", 5, False)  # keys from before scopes are not admin
    create_key(path, "new")
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    assert [info.name for info in list_keys(path)] == ["old", "new"]
