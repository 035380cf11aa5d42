"""The control-plane's state store (issue 20, item 1): one suite, run on a SQLite file and on a real
PostgreSQL. Ledger and open-runs journal, node audit, numbered policies, drains, join tokens,
certificates and revocations, the change counters replicas poll, and schema versions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest
from cp_store_helpers import fresh_database, postgres  # noqa: F401 - the session's server fixture
from pg_faults import lost_reply
from worker.pg_server import PgServer, end_sessions

from iop_control_plane import usage
from iop_control_plane.bootstrap import build_control_plane
from iop_control_plane.ledger import Attempt, LedgerEntry
from iop_control_plane.metrics import ControlPlaneMetrics
from iop_control_plane.pg_store import PgStore
from iop_control_plane.registry import Registry
from iop_control_plane.settings import ConfigError, Settings, StartError, load_settings
from iop_control_plane.sqlite_store import SqliteStore
from iop_control_plane.state import SCHEMA_VERSION, NodeSeen, Opened, Placed, StateChanged, StateStore, StoreTooNew
from iop_control_plane.store import AuditStore
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.pg import shown_url

Open = Callable[[str], Awaitable[StateStore]]


@pytest.fixture(params=["sqlite", "postgres"])
async def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Open]:
    """Opens stores (as owner ``name``) on one fresh SQLite file or PostgreSQL database; closed after the test."""
    if request.param == "sqlite":

        def build() -> StateStore:
            return SqliteStore(tmp_path / "cp.db")

    else:
        url = await fresh_database(request.getfixturevalue("postgres"))

        def build() -> StateStore:
            return PgStore(url)

    opened: list[StateStore] = []

    async def make(owner: str) -> StateStore:
        store = build()
        await store.open(owner)
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.aclose()


def _ended(run_id: str, *nodes: str) -> LedgerEntry:
    entry = LedgerEntry(run_id, "edge-1", "conn-1", "alice", "mock-small")
    for node in nodes:
        entry.attempts.append(Attempt(node, "mock-small", entry.received, "completed", "", entry.received + 0.1))
    entry.ending(pb.RunEvent(complete=pb.RunComplete(usage=pb.Usage(prompt_tokens=3, completion_tokens=5))))
    return entry


async def test_the_ledger_keeps_runs_and_their_attempts(open_store: Open) -> None:
    store = await open_store("cp-a")
    await store.commit([_ended("r1", "node-a"), _ended("r2", "node-a", "node-b")], {})
    listed = await store.runs(pb.RunsList())
    assert [run.run_id for run in listed.runs] == ["r2", "r1"] and not listed.more
    assert [a.node_id for a in listed.runs[0].attempts] == ["node-a", "node-b"]
    assert listed.runs[0].usage.completion_tokens == 5 and listed.runs[0].status == "completed"
    only_b = await store.runs(pb.RunsList(node_id="node-b", limit=1))
    assert [run.run_id for run in only_b.runs] == ["r2"]
    assert [run.run_id for run in (await store.runs(pb.RunsList(limit=1))).runs] == ["r2"]
    with pytest.raises(ValueError, match="unknown status"):
        await store.runs(pb.RunsList(status="done"))
    await store.prune(1, 10)
    assert [run.run_id for run in (await store.runs(pb.RunsList())).runs] == ["r2"]


async def test_the_ledger_keeps_a_migrated_runs_attempts_with_their_outputs_cost_and_gap(open_store: Open) -> None:
    store = await open_store("cp-a")
    entry = _ended("moved", "node-a", "node-b")
    lost, continued = entry.attempts
    lost.outcome, lost.outputs = "node_lost", 12
    continued.outputs, continued.continued, continued.continuation_prompt_tokens, continued.gap = 28, True, 12, 0.75
    entry.migrations = 1
    await store.commit([entry], {})
    [run] = (await store.runs(pb.RunsList(run_id="moved"))).runs
    assert run.migrations == 1
    first, second = run.attempts
    assert (first.outputs, first.continued, first.continuation_prompt_tokens, first.HasField("gap")) == (
        12,
        False,
        0,
        False,
    )
    assert (second.outputs, second.continued, second.continuation_prompt_tokens) == (28, True, 12)
    assert second.gap.ToTimedelta().total_seconds() == 0.75


async def test_runs_in_progress_of_a_silent_control_plane_are_recorded_interrupted(open_store: Open) -> None:
    first, second = await open_store("cp-a"), await open_store("cp-b")
    waiting, placed, ended = (LedgerEntry(name, "edge-1", "c", "alice", "m") for name in ("w", "p", "e"))
    placed.attempts.append(Attempt("node-a", "m", placed.received))
    await first.heartbeat()
    await first.commit([Opened(waiting), Opened(placed), Opened(ended)], {})
    await first.commit([Placed(placed, 1, placed.attempts[0])], {})
    ended.ending(None)
    await first.commit([ended], {})
    assert len(await second.recover(60.0)) == 0  # cp-a is alive: its runs are its own
    assert len(await second.recover(0.0)) == 2  # silent (here: for any time at all): recorded once
    assert len(await second.recover(0.0)) == 0
    runs = {run.run_id: run for run in (await second.runs(pb.RunsList())).runs}
    assert runs["e"].status == "cancelled" and runs["w"].status == runs["p"].status == "interrupted"
    assert "attempt 1 on node node-a" in runs["p"].error_message and runs["p"].attempts[0].outcome == "interrupted"
    assert "not yet placed" in runs["w"].error_message


async def test_a_run_left_open_is_settled_once_by_the_node_of_its_last_attempt_only(open_store: Open) -> None:
    first, second = await open_store("cp-a"), await open_store("cp-b")
    placed = LedgerEntry("p", "edge-1", "conn-7", "alice", "m")
    placed.attempts.append(Attempt("node-a", "m", placed.received))
    await first.commit([Opened(placed), Placed(placed, 1, placed.attempts[0])], {})
    [left] = await second.recover(0.0)
    assert (left.node_id, left.attempt, left.node_run_id) == ("node-a", 1, "conn-7.p.1")  # the relay's id on the node
    found = pb.LedgerRun(run_id=left.node_run_id, status="completed", finish_reason=pb.FINISH_REASON_STOP)
    found.usage.prompt_tokens, found.usage.completion_tokens = 5, 7
    liar = dataclasses.replace(left, node_id="node-b")
    assert not await second.settle(liar, found)  # a node speaks only for runs it had the last attempt of
    assert await second.settle(left, found)
    assert not await second.settle(left, pb.LedgerRun(run_id=left.node_run_id, status="failed"))  # settled once
    [run] = (await second.runs(pb.RunsList())).runs
    assert (run.status, run.usage.prompt_tokens, run.usage.completion_tokens) == ("completed", 5, 7)
    assert run.finish_reason == pb.FINISH_REASON_STOP and [a.outcome for a in run.attempts] == ["completed"]

    moved = LedgerEntry("moved", "edge-1", "conn-7", "alice", "m")  # opened again through cp-b after the kill
    moved.attempts.append(Attempt("node-a", "m", moved.received))
    await first.commit([Opened(moved), Placed(moved, 1, moved.attempts[0])], {})
    [left] = await second.recover(0.0)
    await second.commit([_ended("moved", "node-b")], {})
    assert not await second.settle(
        left, pb.LedgerRun(run_id=left.node_run_id, status="completed")
    )  # cp-b row: its record
    assert [run.status for run in (await second.runs(pb.RunsList(run_id="moved"))).runs] == ["completed", "interrupted"]


async def test_a_run_opened_again_through_another_control_plane_is_recorded_once(open_store: Open) -> None:
    first, second = await open_store("cp-a"), await open_store("cp-b")
    left = LedgerEntry("moved", "edge-1", "c", "alice", "m")
    await first.commit([Opened(left)], {})  # cp-a dies before the run's first output ...
    await second.commit([_ended("moved", "node-b")], {})  # ... the edge opens it again through cp-b
    assert len(await second.recover(0.0)) == 0
    runs = (await second.runs(pb.RunsList())).runs
    assert [(run.run_id, run.status) for run in runs] == [("moved", "completed")]


async def test_the_node_audit_keeps_nodes_and_state_changes(open_store: Open) -> None:
    store = await open_store("cp-a")
    await store.commit([NodeSeen("node-a", '{"zone": "a"}', "127.0.0.1", '["m"]', 10.0)], {})
    await store.commit([StateChanged("node-a", 11.0, "ready", "registered")], {"node-a": 12.0})
    await store.commit([StateChanged("node-a", 13.0, "draining", "by ops")], {})
    assert await store.nodes() == [("node-a", 10.0, '["m"]')]
    assert await store.events("node-a") == [("ready", "registered"), ("draining", "by ops")]


async def test_policies_are_numbered_and_the_newest_is_in_force(open_store: Open) -> None:
    store = await open_store("cp-a")
    assert await store.newest_policy() is None
    before = await store.changes()
    first = await store.add_policy("defaults: {}\n", "a" * 64, "policy.yaml", "start")
    second = await store.add_policy("callers: {}\n", "b" * 64, "iop policy apply", "ops")
    assert second.version > first.version
    newest = await store.newest_policy()
    assert newest is not None and (newest.version, newest.text, newest.applied_by) == (
        second.version,
        "callers: {}\n",
        "ops",
    )
    assert [p.version for p in await store.policies()] == [second.version, first.version]
    assert (await store.changes())["policy"] == before["policy"] + 2


async def test_drains_are_kept_and_counted(open_store: Open) -> None:
    store = await open_store("cp-a")
    await store.set_drain("node-a", "maintenance", "ops", drained=True)
    await store.set_drain("node-b", "", "ops", drained=True)
    await store.set_drain("node-b", "", "ops", drained=False)
    assert await store.drains() == {"node-a": "maintenance"}
    assert (await store.changes())["drains"] == 3


async def test_tokens_certificates_and_revocations(open_store: Open) -> None:
    store = await open_store("cp-a")
    now = time.time()
    await store.add_token(("abc123", "f" * 64, now, now + 60, 1, 0, "gpu-", "ops", None))
    assert await store.use_token("abc123") and not await store.use_token("abc123")  # one use, across replicas too
    assert (await store.tokens("abc123"))[0][5] == 1 and len(await store.tokens()) == 1
    assert await store.revoke_token("abc123", now) and not await store.revoke_token("nope00", now)
    await store.add_attempt(now, "abc123", "10.0.0.1", "gpu-1", "accepted")
    assert await store.attempts() == [("abc123", "10.0.0.1", "gpu-1", "accepted")]
    await store.issue("gpu-1", "0a", now + 60, now)
    await store.issue("gpu-1", "0b", now + 60, now)
    revocations = (await store.changes())["revocations"]
    assert sorted(await store.revoke_node("gpu-1", "removed", now, ("0c", now + 60))) == ["0a", "0b", "0c"]
    assert await store.revoke_node("gpu-1", "again", now, None) == []  # nothing new: not counted
    assert await store.revoked() == {"0a", "0b", "0c"}
    assert (await store.changes())["revocations"] == revocations + 1


async def test_a_store_newer_than_the_code_refuses_to_open(open_store: Open) -> None:
    store = await open_store("cp-a")
    if isinstance(store, SqliteStore):
        with sqlite3.connect(store.path) as db:
            db.execute("UPDATE control_plane_schema SET version = ?", (SCHEMA_VERSION + 1,))
        again: StateStore = SqliteStore(store.path)
    else:
        assert isinstance(store, PgStore)
        connection = await asyncpg.connect(store.url)
        await connection.execute("UPDATE control_plane_schema SET version = $1", SCHEMA_VERSION + 1)
        await connection.close()
        again = PgStore(store.url)
    with pytest.raises(StoreTooNew, match=f"version {SCHEMA_VERSION + 1}, newer"):
        await again.open("cp-b")


_V1_FILE = """
CREATE TABLE nodes (node_id TEXT PRIMARY KEY, labels TEXT NOT NULL, address TEXT NOT NULL, models TEXT NOT NULL,
    first_seen REAL NOT NULL, last_seen REAL NOT NULL);
CREATE TABLE node_events (node_id TEXT NOT NULL, at REAL NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL);
CREATE TABLE open_runs (id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, requester TEXT NOT NULL, connection TEXT NOT NULL,
    caller TEXT NOT NULL, model TEXT NOT NULL, received_at REAL NOT NULL, node_id TEXT NOT NULL DEFAULT '',
    node_model TEXT NOT NULL DEFAULT '', attempt INTEGER NOT NULL DEFAULT 0, placed_after REAL NOT NULL DEFAULT 0);
CREATE TABLE node_certificates (serial TEXT PRIMARY KEY, node_id TEXT NOT NULL, issued_at REAL NOT NULL,
    not_after REAL NOT NULL, revoked_at REAL, reason TEXT NOT NULL);
INSERT INTO nodes VALUES ('node-a', '{}', '127.0.0.1', '["m"]', 5.0, 6.0);
INSERT INTO open_runs (run_id, requester, connection, caller, model, received_at)
    VALUES ('old', 'e', 'c', 'x', 'm', 1.0);
INSERT INTO node_certificates VALUES ('0f', 'node-a', 1.0, 2.0, 3.0, 'removed');
"""


async def test_a_sqlite_file_of_an_earlier_version_migrates_forward(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:  # as issue 19's control-plane left it: no version table
        db.executescript(_V1_FILE)
    store = SqliteStore(path)
    await store.open("cp-a")
    try:
        assert await store.nodes() == [("node-a", 5.0, '["m"]')] and await store.revoked() == {"0f"}
        assert len(await store.recover(0.0)) == 1  # its run left open is recorded interrupted
        assert [run.status for run in (await store.runs(pb.RunsList())).runs] == ["interrupted"]
        assert await store.changes() == {"policy": 0, "drains": 0, "revocations": 0}
    finally:
        await store.aclose()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM control_plane_schema").fetchall() == [(SCHEMA_VERSION,)]


async def test_a_postgresql_database_of_version_2_with_runs_migrates_forward(postgres: PgServer) -> None:  # noqa: F811
    """Version 3 added the migration columns to a ledger that may hold millions of runs: they come with
    their defaults, and the runs read as runs never continued."""
    url = await fresh_database(postgres)
    store = PgStore(url)
    await store.open("cp-a")
    await store.commit([_ended("before", "node-a", "node-b")], {})
    await store.aclose()
    connection = await asyncpg.connect(url)
    try:  # back to version 2, as a control-plane of the last release left it
        await connection.execute("ALTER TABLE runs DROP COLUMN migrations")
        await connection.execute("ALTER TABLE runs DROP COLUMN cached_tokens")  # and version 4's
        await connection.execute("DROP TABLE usage_hours, usage_days")
        await connection.execute("DROP INDEX runs_by_received, runs_by_caller")
        for column in ("outputs", "continued", "continuation_prompt_tokens", "gap"):
            await connection.execute(f"ALTER TABLE run_attempts DROP COLUMN {column}")
        await connection.execute("UPDATE control_plane_schema SET version = 2")
    finally:
        await connection.close()
    again = PgStore(url)
    await again.open("cp-b")
    try:
        (run,) = (await again.runs(pb.RunsList())).runs
        assert (run.run_id, run.migrations, [a.node_id for a in run.attempts]) == ("before", 0, ["node-a", "node-b"])
        assert all(not a.continued and a.outputs == 0 and not a.HasField("gap") for a in run.attempts)
        await again.commit([_ended("after", "node-c")], {})
        assert [r.run_id for r in (await again.runs(pb.RunsList())).runs] == ["after", "before"]
    finally:
        await again.aclose()
    connection = await asyncpg.connect(url)
    try:
        assert await connection.fetchval("SELECT max(version) FROM control_plane_schema") == SCHEMA_VERSION
    finally:
        await connection.close()


async def test_control_planes_opening_one_database_together_migrate_it_once(postgres: PgServer) -> None:  # noqa: F811
    url = await fresh_database(postgres)
    stores = [PgStore(url) for _ in range(3)]
    await asyncio.gather(*(store.open(f"cp-{n}") for n, store in enumerate(stores)))
    try:
        assert await stores[0].changes() == {"policy": 0, "drains": 0, "revocations": 0}
    finally:
        for store in stores:
            await store.aclose()


async def test_commands_right_after_the_server_ends_the_sessions_are_applied_once(postgres: PgServer) -> None:  # noqa: F811
    """The pool still holds sessions the server ended (a restart): an admin command, a join or a
    ledger write met one and failed. Each now runs on fresh sessions, and is applied once."""
    url = await fresh_database(postgres)
    database = url.rsplit("/", 1)[1]
    store = PgStore(url, max_connections=2)
    await store.open("cp-a")
    metrics = ControlPlaneMetrics(Registry())
    metrics.watch_store(AuditStore(store))
    now = time.time()
    rounds = 20
    commands: list[Callable[[int], Awaitable[object]]] = [
        lambda n: store.add_policy(f"# policy {n}", "0" * 64, "cli", "ops"),
        lambda n: store.use_token("abc123"),
        lambda n: store.commit([_ended(f"r{n}", "node-a")], {}),
        lambda n: store.revoke_node(f"gpu-{n}", "removed", now, (f"{n:02x}", now + 60)),
        lambda n: store.drains(),
    ]
    try:
        await store.add_token(("abc123", "f" * 64, now, now + 60, 5 * rounds, 0, "gpu-", "ops", None))
        n = 0
        # Whether a command meets an ended session or the pool saw the end first is a race: go on
        # past 20 rounds (to 100) until at least one did, so the path is exercised on every run.
        while n < rounds or (store.sessions_lost == 0 and n < 5 * rounds):
            for command in commands:
                await asyncio.gather(store.changes(), store.changes())  # both sessions open, idle
                assert await end_sessions(postgres, database) >= 1
                assert await command(n) not in (False, [])
            n += 1
        rounds = n
        assert [policy.version for policy in await store.policies()] == list(range(rounds, 0, -1))
        assert (await store.tokens("abc123"))[0][5] == rounds
        assert len((await store.runs(pb.RunsList(limit=100))).runs) == rounds
        assert len(await store.revoked()) == rounds
        assert store.sessions_lost >= 1
        assert metrics.registry.get_sample_value("iop_control_plane_store_sessions_lost_total") == store.sessions_lost
    finally:
        await store.aclose()


async def test_a_ledger_batch_committed_unseen_as_the_database_went_away_is_written_once(
    postgres: PgServer,  # noqa: F811
) -> None:
    """The server committed a batch of ended runs and state changes, the reply was lost, and the
    database was away, so the control-plane could not ask: its writer sends the batch again, and
    no run or state change is recorded twice."""
    async with lost_reply(postgres, await fresh_database(postgres)) as lost:
        store = PgStore(lost.url, timeout=10.0)
        await store.open("cp-a")
        batch = [_ended("r1", "node-a"), StateChanged("node-a", time.time(), "ready", "registered")]
        try:
            cutting = lost.cut_when_committed("runs")
            with pytest.raises(ConnectionResetError):  # asking whether it committed: its outcome unknown
                await store.commit(batch, {})
            await cutting
            lost.proxy.pass_()
            await store.commit(batch, {})
            assert [run.run_id for run in (await store.runs(pb.RunsList())).runs] == ["r1"]
            assert len((await store.runs(pb.RunsList())).runs[0].attempts) == 1
            assert await store.events("node-a") == [("ready", "registered")]
        finally:
            await store.aclose()


def test_a_password_is_never_shown() -> None:
    assert shown_url("postgresql://iop:s3cret@db.internal:5432/iop") == "postgresql://iop:***@db.internal:5432/iop"
    assert shown_url("postgresql://iop@db/iop") == "postgresql://iop@db/iop"


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("mysql://iop@db/iop", "store.url (line 1): must start with postgresql://"),
        ("postgresql://iop@db", "store.url (line 1): name the host and the database"),
        ("postgresql://iop@db:99999/iop", "store.url (line 1): not a URL"),
    ],
)
def test_a_bad_store_url_is_one_line_naming_the_key(url: str, said: str, tmp_path: Path) -> None:
    config = tmp_path / "cp.yaml"
    config.write_text(f"store: {{url: '{url}'}}\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(config)
    assert said in str(refused.value) and "\n" not in str(refused.value)


async def test_a_database_that_cannot_be_reached_stops_the_start_naming_the_key(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = Settings.model_validate(
        {"listen": {"port": 0}, "store": {"url": f"postgresql://iop:secret@127.0.0.1:{port}/iop", "timeout": 1}}
    )
    with pytest.raises(StartError) as refused:
        await build_control_plane(settings).start()
    assert str(refused.value).startswith("store.url: cannot open postgresql://iop:***@127.0.0.1")
    assert "secret" not in str(refused.value)


def _run(run_id: str, caller: str, model: str, at: float, status: str = "completed", **usage: int) -> LedgerEntry:
    """A run of ``caller`` received at ``at`` that ended ``status`` with ``usage``'s tokens."""
    entry = LedgerEntry(run_id, "edge-1", "conn-1", caller, model, received_at=at)
    counted = pb.Usage(**usage)
    if status == "completed":
        entry.ending(pb.RunEvent(complete=pb.RunComplete(usage=counted)))
    else:
        code = pb.ERROR_CODE_CANCELLED if status == "cancelled" else pb.ERROR_CODE_INTERNAL
        entry.ending(pb.RunEvent(error=pb.Error(code=code, message=status, usage=counted)))
    return entry


_DAY0 = 1_764_633_600  # 2025-12-02 00:00 UTC


def _rows(listed: pb.UsageListed) -> list[tuple[int, str, str, int, int, int, int, int, int]]:
    return [
        (e.start.seconds, e.caller, e.model, e.requests, e.prompt_tokens, e.completion_tokens, e.cached_tokens,
         e.failed, e.estimated)
        for e in listed.entries
    ]  # fmt: skip


def _window(start: float, end: float, **fields: object) -> pb.UsageList:
    request = pb.UsageList(**fields)  # type: ignore[arg-type]
    request.start.seconds, request.end.seconds = int(start), int(end)
    return request


async def test_usage_sums_runs_per_hour_and_day_by_caller_and_model(open_store: Open) -> None:
    store = await open_store("cp-a")
    await store.commit(
        [
            _run("a1", "alice", "m1", _DAY0 + 10, prompt_tokens=3, completion_tokens=5, cached_tokens=1),
            _run("a2", "alice", "m1", _DAY0 + 3599, "failed", prompt_tokens=2, completion_tokens=1),
            _run("a3", "alice", "m2", _DAY0 + 3600, "cancelled", prompt_tokens=4, estimated=True),
            _run("b1", "bob", "m1", _DAY0 + 86_400 + 5, prompt_tokens=7, completion_tokens=9),
        ],
        {},
    )
    await store.commit([_run("a4", "alice", "m1", _DAY0 + 20, prompt_tokens=1, completion_tokens=1)], {})
    hours = await store.usage(_window(_DAY0, _DAY0 + 2 * 86_400, by_caller=True, by_model=True))
    assert _rows(hours) == [
        (_DAY0, "alice", "m1", 3, 6, 7, 1, 1, 0),
        (_DAY0 + 3600, "alice", "m2", 1, 4, 0, 0, 1, 1),
        (_DAY0 + 86_400, "bob", "m1", 1, 7, 9, 0, 0, 0),
    ]
    days = await store.usage(_window(_DAY0 + 7, _DAY0 + 2 * 86_400, bucket=pb.USAGE_BUCKET_DAY, by_caller=True))
    assert _rows(days) == [(_DAY0, "alice", "", 4, 10, 7, 1, 2, 1), (_DAY0 + 86_400, "bob", "", 1, 7, 9, 0, 0, 0)]
    only = await store.usage(_window(_DAY0, _DAY0 + 86_400, bucket=pb.USAGE_BUCKET_DAY, caller="alice", model="m2"))
    assert _rows(only) == [(_DAY0, "", "", 1, 4, 0, 0, 1, 1)]
    summed = await store.usage(_window(_DAY0, _DAY0 + 3600))  # one hour, every caller and model summed
    assert _rows(summed) == [(_DAY0, "", "", 3, 6, 7, 1, 1, 0)]
    assert not (await store.usage(_window(_DAY0 - 86_400, _DAY0))).entries
    with pytest.raises(ValueError, match="must be before end"):
        await store.usage(_window(_DAY0, _DAY0))


async def test_usage_rows_are_bounded_with_a_way_out(open_store: Open, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await open_store("cp-a")
    await store.commit([_run(f"r{n}", "alice", "m1", _DAY0 + n * 3600) for n in range(4)], {})
    monkeypatch.setattr("iop_control_plane.usage.MAX_ENTRIES", 3)
    with pytest.raises(ValueError, match="more than 3 rows of usage: ask for a shorter window, days instead"):
        await store.usage(_window(_DAY0, _DAY0 + 86_400))
    assert len((await store.usage(_window(_DAY0, _DAY0 + 3 * 3600))).entries) == 3


async def test_usage_refuses_a_range_over_a_month_by_hour_or_400_days_by_day(open_store: Open) -> None:
    store = await open_store("cp-a")
    await store.commit([_run("a1", "alice", "m1", _DAY0 + 10, prompt_tokens=3)], {})
    month = 31 * 86_400 + 3600
    assert len((await store.usage(_window(_DAY0, _DAY0 + month))).entries) == 1  # a month by hour, unaligned
    with pytest.raises(ValueError, match=r"start \(\d+\) is 31\.0 days before end .*\(31 days and an hour by hour\)"):
        await store.usage(_window(_DAY0 - 1, _DAY0 + month))
    by_day = pb.USAGE_BUCKET_DAY
    assert len((await store.usage(_window(_DAY0, _DAY0 + 400 * 86_400, bucket=by_day))).entries) == 1
    with pytest.raises(ValueError, match=r"start \(\d+\) is 400\.0 days before end .*\(400 days by day\)"):
        await store.usage(_window(_DAY0 - 1, _DAY0 + 400 * 86_400, bucket=by_day))


async def test_a_callers_usage_is_read_through_an_index_added_by_the_migration(open_store: Open) -> None:
    """The rollup's key starts with the bucket's start: one caller's usage (the console's own-key view)
    reads an index by caller, added to a store of version 4, rather than every caller's rows in the range."""
    store = await open_store("cp-a")
    today = [_run(f"t{n}", f"caller-{n}", "m1", _DAY0 + n * 150) for n in range(500)]  # 500 callers in its day
    earlier = [_run(f"e{n}", f"caller-{n}", "m1", _DAY0 - n * 86_400 - 7) for n in range(500)]  # and each day before
    others = today + earlier
    await store.commit([_run("a1", "alice", "m1", _DAY0 + 10, prompt_tokens=3), *others], {})
    await store.aclose()
    undo = ["DROP INDEX usage_hours_by_caller", "DROP INDEX usage_days_by_caller",
            "UPDATE control_plane_schema SET version = 4"]  # fmt: skip
    await _execute(store, [*undo, "ANALYZE"])
    again = await open_store("cp-b")
    for bucket, table in ((pb.USAGE_BUCKET_HOUR, "usage_hours"), (pb.USAGE_BUCKET_DAY, "usage_days")):
        request = _window(_DAY0, _DAY0 + 86_400, bucket=bucket, caller="alice", by_model=True)
        assert _rows(await again.usage(request)) == [(_DAY0, "", "m1", 1, 3, 0, 0, 0, 0)]
        assert f"{table}_by_caller" in await _plan(again, request)


async def _execute(store: StateStore, statements: list[str]) -> None:
    """Run ``statements`` on ``store``'s file or database, outside the store."""
    if isinstance(store, SqliteStore):
        with sqlite3.connect(store.path) as db:
            for sql in statements:
                db.execute(sql)
        return
    assert isinstance(store, PgStore)
    connection = await asyncpg.connect(store.url)
    try:
        for sql in statements:
            await connection.execute(sql)
    finally:
        await connection.close()


async def _plan(store: StateStore, request: pb.UsageList) -> str:
    """The query plan of ``request``'s usage.list on ``store`` (PostgreSQL's with sequential scans off:
    a table of a few rows is read whole otherwise)."""
    if isinstance(store, SqliteStore):
        sql, params = usage.select(request, lambda _: "?")
        with sqlite3.connect(store.path) as db:
            return " ".join(str(row) for row in db.execute(f"EXPLAIN QUERY PLAN {sql}", params))
    assert isinstance(store, PgStore)
    sql, params = usage.select(request, lambda n: f"${n}")
    connection = await asyncpg.connect(store.url)
    try:
        await connection.execute("SET enable_seqscan = off")
        return " ".join(row[0] for row in await connection.fetch(f"EXPLAIN {sql}", *params))
    finally:
        await connection.close()


async def test_a_run_left_open_and_settled_moves_its_tokens_into_the_usage(open_store: Open) -> None:
    dead = await open_store("cp-dead")
    entry = LedgerEntry("left", "edge-1", "conn-1", "alice", "m1", received_at=_DAY0 + 60)
    entry.attempts.append(Attempt("node-a", "m1", entry.received))
    await dead.commit([Opened(entry), Placed(entry, 1, entry.attempts[0])], {})
    (left,) = await (await open_store("cp-live")).recover(0.0)
    live = await open_store("cp-live-2")
    assert _rows(await live.usage(_window(_DAY0, _DAY0 + 3600))) == [(_DAY0, "", "", 1, 0, 0, 0, 1, 0)]
    found = pb.LedgerRun(status="completed", usage=pb.Usage(prompt_tokens=5, completion_tokens=8, cached_tokens=2))
    assert await live.settle(left, found)
    assert _rows(await live.usage(_window(_DAY0, _DAY0 + 3600))) == [(_DAY0, "", "", 1, 5, 8, 2, 0, 0)]
    assert not await live.settle(left, found)  # once
    assert _rows(await live.usage(_window(_DAY0, _DAY0 + 3600))) == [(_DAY0, "", "", 1, 5, 8, 2, 0, 0)]


async def test_a_run_handed_unplaced_to_another_replica_is_one_request_in_the_usage(open_store: Open) -> None:
    """Replicas share the store. A run cp-a refused retryably before placement (UNAVAILABLE: no node yet),
    or held unplaced when it died (recorded interrupted), is opened again by the edge's failover on cp-b,
    which serves it: one request, cp-b's. A run refused for good before placement (MODEL_NOT_FOUND) counts."""
    cp_a, cp_b = await open_store("cp-a"), await open_store("cp-b")
    refused = LedgerEntry("r1", "edge-1", "conn-1", "alice", "m1", received_at=_DAY0 + 10)
    refused.ending(pb.RunEvent(error=pb.Error(code=pb.ERROR_CODE_UNAVAILABLE, message="no node yet", retryable=True)))
    unknown = LedgerEntry("r3", "edge-1", "conn-1", "alice", "nope", received_at=_DAY0 + 30)
    unknown.ending(pb.RunEvent(error=pb.Error(code=pb.ERROR_CODE_MODEL_NOT_FOUND, message="no node serves 'nope'")))
    await cp_a.commit([refused, unknown], {})
    dead = await open_store("cp-dead")
    await dead.commit([Opened(LedgerEntry("r2", "edge-1", "conn-2", "alice", "m1", received_at=_DAY0 + 20))], {})
    assert len(await cp_b.recover(0.0)) == 1  # cp-dead's unplaced run, recorded interrupted
    served = [_run(run_id, "alice", "m1", _DAY0 + 11, prompt_tokens=3, completion_tokens=5) for run_id in ("r1", "r2")]
    await cp_b.commit(served, {})
    listed = await cp_b.runs(pb.RunsList(caller="alice"))
    assert sorted((run.run_id, run.status) for run in listed.runs) == [
        ("r1", "completed"), ("r1", "failed"), ("r2", "completed"), ("r2", "interrupted"), ("r3", "failed"),
    ]  # fmt: skip
    usage_rows = _rows(await cp_a.usage(_window(_DAY0, _DAY0 + 3600, by_model=True)))
    assert usage_rows == [(_DAY0, "", "(unknown)", 1, 0, 0, 0, 1, 0), (_DAY0, "", "m1", 2, 6, 10, 0, 0, 0)]


async def test_runs_are_listed_by_caller_and_paged_by_arrival(open_store: Open) -> None:
    store = await open_store("cp-a")
    late_short = _run("late-short", "alice", "m1", _DAY0 + 30)
    early_long = _run("early-long", "alice", "m1", _DAY0 + 10)  # received first, ended (written) last
    await store.commit([_run("bob", "bob", "m1", _DAY0 + 20), late_short, _run("first", "alice", "m1", _DAY0)], {})
    await store.commit([early_long], {})
    page = await store.runs(pb.RunsList(caller="alice", limit=2))
    assert [run.run_id for run in page.runs] == ["late-short", "early-long"] and page.more
    following = pb.RunsList(caller="alice", limit=2)
    following.before.CopyFrom(page.runs[-1].received_at)
    rest = await store.runs(following)
    assert [run.run_id for run in rest.runs] == ["first"] and not rest.more


async def _back_to_version_3(store: StateStore) -> None:
    """The store as a control-plane of the last release left it: no usage tables, no cached tokens."""
    undo = [
        "DROP TABLE usage_hours",
        "DROP TABLE usage_days",
        "DROP INDEX runs_by_received",
        "DROP INDEX runs_by_caller",
        "ALTER TABLE runs DROP COLUMN cached_tokens",
        "UPDATE control_plane_schema SET version = 3",
    ]
    await _execute(store, undo)


async def test_the_usage_of_runs_recorded_before_it_was_kept_is_filled_in_by_the_migration(open_store: Open) -> None:
    store = await open_store("cp-a")
    await store.commit(
        [
            _run("a1", "alice", "m1", _DAY0 + 10, prompt_tokens=3, completion_tokens=5),
            _run("a2", "alice", "m1", _DAY0 + 3599.9, "failed", prompt_tokens=2, completion_tokens=1),
            _run("b1", "bob", "m2", _DAY0 + 90_000, "cancelled", prompt_tokens=4, estimated=True),
        ],
        {},
    )
    await store.aclose()
    await _back_to_version_3(store)
    again = await open_store("cp-b")
    window = _window(_DAY0, _DAY0 + 2 * 86_400, by_caller=True, by_model=True)
    assert _rows(await again.usage(window)) == [
        (_DAY0, "alice", "m1", 2, 5, 6, 0, 1, 0),
        (_DAY0 + 86_400 + 3600, "bob", "m2", 1, 4, 0, 0, 1, 1),
    ]
    window.bucket = pb.USAGE_BUCKET_DAY
    assert _rows(await again.usage(window)) == [
        (_DAY0, "alice", "m1", 2, 5, 6, 0, 1, 0),
        (_DAY0 + 86_400, "bob", "m2", 1, 4, 0, 0, 1, 1),
    ]
    await again.commit([_run("a3", "alice", "m1", _DAY0 + 20, prompt_tokens=1)], {})  # and it goes on adding
    assert _rows(await again.usage(_window(_DAY0, _DAY0 + 3600)))[0][3:5] == (3, 6)
