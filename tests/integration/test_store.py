"""The run history on real SQLite files: round trips, WAL, group commit, interrupted runs, filters, errors,
commits refused by a locked file (kept, retried, bounded), the version 1 and 2 migrations, and who a run
is recorded as sent by (the core's records, through a stand-in sink)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog
from conftest import assert_eventually

from iop_cli import runs
from iop_cli.output import CliError
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters.mock import MockAdapter, MockOptions
from iop_node.core import Node
from iop_node.domain import RunRecord, RunStatus
from iop_node.metrics import NodeMetrics
from iop_node.router import Limits, Router
from iop_node.settings import RouteSettings
from iop_node.store import INTERRUPTED_MESSAGE, SqliteRunStore
from iop_wire.errors import IopError
from iop_wire.tls import PeerIdentity, Role

T0 = datetime.datetime(2026, 5, 1, 12, 0, 0, 123456, tzinfo=datetime.UTC)


def _at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def _start(
    run_id: str, node_id: str = "node-a", model: str = "m", received: float = 0.0, connection: str = "conn-1"
) -> RunRecord:
    return RunRecord(
        run_id=run_id,
        node_id=node_id,
        model=model,
        status=RunStatus.RUNNING,
        peer="edge-1",
        caller="edge-1",
        connection=connection,
        received_at=_at(received),
    )


def _end(start: RunRecord, status: RunStatus = RunStatus.COMPLETED) -> RunRecord:
    return dataclasses.replace(start, status=status, finished_at=start.received_at, completion_tokens=3)


def _rows(path: Path, sql: str = "SELECT count(*) FROM runs") -> list[tuple[object, ...]]:
    """Query through a second, independent connection."""
    with sqlite3.connect(path) as connection:
        rows = connection.execute(sql).fetchall()
    connection.close()
    return rows


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "history" / "runs.db"


@pytest.fixture
async def store(path: Path) -> AsyncIterator[SqliteRunStore]:
    store = SqliteRunStore(path, "node-a")
    assert await store.open() == 0
    yield store
    await store.close()


async def _reopen(path: Path, node_id: str = "node-a", *, mark_interrupted: bool = True) -> tuple[SqliteRunStore, int]:
    store = SqliteRunStore(path, node_id)
    return store, await store.open(mark_interrupted=mark_interrupted)


async def test_every_field_round_trips(store: SqliteRunStore) -> None:
    start = RunRecord(
        run_id="r1",
        node_id="node-a",
        model="llama",
        status=RunStatus.RUNNING,
        caller="alice",
        peer="edge-1",
        connection="c0ffee",
        received_at=_at(0),
    )
    await store.record_start(start)
    assert await store.get("r1") == start
    end = dataclasses.replace(
        start,
        status=RunStatus.FAILED,
        adapter="cli",
        error_code="BACKEND_ERROR",
        error_message="exit status 3",
        started_at=_at(0.01),
        first_token_at=_at(0.25),
        finished_at=_at(1.5),
        prompt_tokens=12,
        completion_tokens=34,
        usage_estimated=True,
        finish_reason="error",
        stderr_tail="line 1\nline 2 é",
        extra={"k": "v", "pid": "42"},
    )
    defaults = RunRecord(run_id="", node_id="", model="", status=RunStatus.RUNNING)
    unset = [f.name for f in dataclasses.fields(end) if getattr(end, f.name) == getattr(defaults, f.name)]
    assert unset == []
    await store.record_end(end)
    got = await store.get("r1")
    assert got == end
    assert got is not None and got.finished_at is not None and got.finished_at.tzinfo == datetime.UTC


async def test_wal_mode_and_schema_version(store: SqliteRunStore, path: Path) -> None:
    assert _rows(path, "PRAGMA journal_mode") == [("wal",)]
    assert _rows(path, "PRAGMA user_version") == [(3,)]
    key = sorted((pk, name) for _, name, _, _, _, pk in _rows(path, "PRAGMA table_info(runs)") if pk)
    assert [name for _, name in key] == ["node_id", "connection", "run_id"]
    assert store._db is not None
    assert list(await store._db.execute_fetchall("PRAGMA synchronous")) == [(1,)]  # NORMAL


async def test_writes_return_without_waiting_and_flush_makes_them_visible(store: SqliteRunStore, path: Path) -> None:
    record = _start("r1")
    for write in (store.record_start(record), store.record_end(_end(record))):
        with pytest.raises(StopIteration):  # the coroutine finished on its first step: it never waited
            write.send(None)
    assert _rows(path) == [(0,)]
    await store.flush()
    assert _rows(path, "SELECT run_id, status FROM runs") == [("r1", "completed")]


async def test_a_thousand_concurrent_runs_land_in_few_commits(store: SqliteRunStore, path: Path) -> None:
    async def run(index: int) -> None:
        record = _start(f"r{index}", received=index)
        await store.record_start(record)
        await asyncio.sleep(0)
        await store.record_end(_end(record))

    began = time.monotonic()
    await asyncio.gather(*(run(index) for index in range(1000)))
    await store.flush()
    assert _rows(path, "SELECT status, count(*) FROM runs GROUP BY status") == [("completed", 1000)]
    assert 1 <= store._commits < 100
    assert time.monotonic() - began < 5


async def test_reopen_marks_only_this_nodes_running_rows_interrupted(path: Path) -> None:
    store, _ = await _reopen(path)
    for run_id in ("a1", "a2", "a3"):
        await store.record_start(_start(run_id))
    await store.record_end(_end(_start("a3")))
    await store.close()
    other, _ = await _reopen(path, "node-b")
    await other.record_start(_start("b1", "node-b"))
    await other.close()
    before = time.time()
    store, marked = await _reopen(path)
    assert marked == 2
    rows = _rows(path, "SELECT run_id, status, error_message, finished_at FROM runs ORDER BY run_id")
    assert [row[:3] for row in rows] == [
        ("a1", "interrupted", INTERRUPTED_MESSAGE),
        ("a2", "interrupted", INTERRUPTED_MESSAGE),
        ("a3", "completed", ""),
        ("b1", "running", ""),
    ]
    assert all(before <= finished <= time.time() for _, _, _, finished in rows[:2])  # type: ignore[operator]
    await store.close()
    store, marked = await _reopen(path, "node-b", mark_interrupted=False)
    assert marked == 0
    assert (await store.get("b1")) == _start("b1", "node-b")
    await store.close()


async def test_list_filters_combine_and_order_newest_first(store: SqliteRunStore) -> None:
    for index, (model, status) in enumerate(
        [("m1", RunStatus.COMPLETED), ("m2", RunStatus.FAILED), ("m1", RunStatus.FAILED), ("m2", RunStatus.COMPLETED)]
    ):
        record = _start(f"r{index}", model=model, received=index * 60)
        await store.record_start(record)
        await store.record_end(_end(record, status))

    async def ids(**filters: object) -> list[str]:
        return [record.run_id for record in await store.list(**filters)]  # type: ignore[arg-type]

    assert await ids() == ["r3", "r2", "r1", "r0"]
    assert await ids(status=RunStatus.FAILED) == ["r2", "r1"]
    assert await ids(model="m1") == ["r2", "r0"]
    assert await ids(since=_at(60)) == ["r3", "r2", "r1"]
    assert await ids(since=_at(60).astimezone(datetime.timezone(datetime.timedelta(hours=2)))) == ["r3", "r2", "r1"]
    assert await ids(status=RunStatus.FAILED, model="m1", since=_at(60)) == ["r2"]
    assert await ids(limit=2) == ["r3", "r2"]
    assert await ids(model="none") == []


async def test_get_unknown_is_none_and_a_shared_id_gives_the_newest(store: SqliteRunStore, path: Path) -> None:
    assert await store.get("nope") is None
    await store.record_start(_start("same", received=0))
    other, _ = await _reopen(path, "node-b")
    await other.record_start(_start("same", "node-b", received=10))
    await other.close()
    got = await store.get("same")
    assert got is not None and got.node_id == "node-b"


async def test_a_repeated_start_does_not_clobber_a_finished_row(store: SqliteRunStore) -> None:
    record = _start("r1")
    await store.record_start(record)
    await store.record_end(_end(record))
    await store.record_start(dataclasses.replace(record, received_at=_at(99), model="again"))
    assert await store.get("r1") == _end(record)


async def test_two_connections_may_use_the_same_run_id(store: SqliteRunStore) -> None:
    alice = dataclasses.replace(_start("job-1", connection="conn-a"), caller="alice")
    bob = dataclasses.replace(_start("job-1", connection="conn-b", received=50), caller="bob")
    again = dataclasses.replace(alice, connection="conn-c", received_at=_at(60))  # alice, a new connection
    for record in (alice, bob, again):
        await store.record_start(record)
    await store.record_end(_end(alice))
    rows = await store.list()
    assert [(r.connection, r.caller, r.status.value) for r in rows] == [
        ("conn-c", "alice", "running"),
        ("conn-b", "bob", "running"),
        ("conn-a", "alice", "completed"),
    ]
    assert await store.get("job-1") == again  # the newest


async def test_a_peer_cannot_write_over_another_peers_row_even_on_a_reused_connection_id(
    store: SqliteRunStore,
) -> None:
    edge = _start("r1")
    await store.record_start(edge)
    await store.record_end(_end(edge))
    intruder = dataclasses.replace(edge, peer="worker-1", caller="edge-1", model="other", received_at=_at(9))
    with structlog.testing.capture_logs() as logs:
        await store.record_start(intruder)
        await store.record_end(_end(intruder, RunStatus.FAILED))
        await store.flush()
    assert await store.list() == [_end(edge)]
    assert [(log["event"], log["peer"]) for log in logs] == [("run_write_refused", "worker-1")]


async def test_an_end_without_its_start_still_lands(store: SqliteRunStore) -> None:
    end = _end(_start("r1"))
    await store.record_end(end)
    assert await store.get("r1") == end


async def test_a_failed_write_is_logged_and_the_writer_goes_on(store: SqliteRunStore, path: Path) -> None:
    await store.record_start(_start("before"))
    await store.flush()
    _rows(path, "ALTER TABLE runs RENAME TO runs_away")
    with structlog.testing.capture_logs() as logs:
        await store.record_start(_start("lost"))
        await store.flush()
    assert [(log["event"], log["run_id"], log["log_level"]) for log in logs] == [("run_write_failed", "lost", "error")]
    assert "no such table" in logs[0]["error"]
    _rows(path, "ALTER TABLE runs_away RENAME TO runs")
    await store.record_start(_start("after"))
    assert [record.run_id for record in await store.list()] == ["after", "before"]  # same time: newest row first
    assert await store.get("lost") is None


async def test_close_commits_everything_and_a_reopen_sees_it(path: Path) -> None:
    store, _ = await _reopen(path)
    for index in range(50):
        await store.record_start(_start(f"r{index}", received=index))
    await store.close()
    with pytest.raises(RuntimeError, match="not open"):
        await store.record_start(_start("late"))
    store, marked = await _reopen(path)
    assert marked == 50
    assert len(await store.list(limit=1000)) == 50
    await store.close()


def _runs(command: str, db: Path, **options: object) -> int:
    """``iop runs ls|show`` on ``db``, in a thread of its own as the command runs (its own event loop)."""
    defaults = {"status": None, "since": None, "model": None, "limit": 10, "json": False, "run_id": ""}
    args = argparse.Namespace(db=db, config=None, dir=db.parent, **(defaults | options))
    try:
        code: int = asyncio.run(getattr(runs, command)(args))
    except CliError as exc:  # as `iop` prints it
        print(f"iop runs: {exc}", file=sys.stderr)
        return exc.code
    return code


async def test_history_reads_without_changing_rows(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, _ = await _reopen(path)
    await store.record_start(_start("r1", received=0))
    await store.record_end(dataclasses.replace(_end(_start("r2", received=1)), stderr_tail="boom"))
    await store.flush()
    assert await asyncio.to_thread(_runs, "ls", path) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].startswith("RUN ID") and "r1" in table and "r2" in table
    assert await asyncio.to_thread(_runs, "ls", path, status="running", model="m", since="2026-01-01") == 0
    assert "running" in capsys.readouterr().out
    assert await asyncio.to_thread(_runs, "show", path, run_id="r2") == 0
    assert capsys.readouterr().out.endswith("stderr_tail:\n    boom\n")
    assert await asyncio.to_thread(_runs, "show", path, run_id="nope") == 1
    assert "no run 'nope'" in capsys.readouterr().err
    assert _rows(path, "SELECT run_id, status FROM runs ORDER BY run_id") == [("r1", "running"), ("r2", "completed")]
    await store.close()


async def test_history_errors_name_the_problem(tmp_path: Path, path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.db"
    assert await asyncio.to_thread(_runs, "show", missing, run_id="r1") == 2
    assert str(missing) in capsys.readouterr().err
    assert not missing.exists()
    store, _ = await _reopen(path)
    await store.close()
    assert await asyncio.to_thread(_runs, "ls", path, status="done") == 2
    assert "valid: running, completed, failed, cancelled, interrupted" in capsys.readouterr().err
    assert await asyncio.to_thread(_runs, "ls", path, since="yesterday") == 2
    assert "30s" in capsys.readouterr().err


async def test_a_row_that_cannot_be_written_is_logged_and_the_writer_goes_on(store: SqliteRunStore, path: Path) -> None:
    broken = _start("broken")
    broken.extra = {"blob": object()}  # type: ignore[dict-item]  # not JSON: its row cannot be built
    with structlog.testing.capture_logs() as logs:
        await store.record_start(broken)
        await store.record_start(_start("fine"))
        await store.flush()
    assert [row[0] for row in _rows(path, "SELECT run_id FROM runs")] == ["fine"]
    assert any(log["event"] == "run_write_failed" and log["run_id"] == "broken" for log in logs)
    await store.record_end(_end(_start("later")))  # the writer is still there
    assert (await store.get("later")).status is RunStatus.COMPLETED  # type: ignore[union-attr]


# -- a file that refuses commits: kept, retried with backoff, bounded, said --------------------


def _lock(path: Path) -> sqlite3.Connection:
    """Another connection holding the write lock: every statement of the store fails with "database is locked".

    (Tests run as root, whom a read-only file or folder does not stop: a held lock is the reliable refusal.)
    """
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    return holder


def _unlock(holder: sqlite3.Connection) -> None:
    holder.execute("ROLLBACK")
    holder.close()


def _sample(metrics: NodeMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def _refusing_store(
    path: Path, metrics: NodeMetrics, *, max_backlog: int = 100_000, close_timeout: float = 10.0
) -> SqliteRunStore:
    """A store that finds out fast that the file refuses (10 ms busy timeout) and retries every 50 ms at most."""
    return SqliteRunStore(
        path,
        "node-a",
        metrics=metrics,
        busy_timeout=0.01,
        retry_max=0.05,
        max_backlog=max_backlog,
        close_timeout=close_timeout,
    )


async def _record_run(store: SqliteRunStore, index: int) -> None:
    record = _start(f"r{index}", received=index)
    await store.record_start(record)
    await asyncio.sleep(0.01)  # the run's own time: the writer tries to commit its start meanwhile
    await store.record_end(_end(record))


async def test_runs_recorded_while_the_file_refuses_commits_land_once_it_takes_them_again(path: Path) -> None:
    metrics = NodeMetrics()
    store = _refusing_store(path, metrics)
    await store.open()
    for index in range(3):
        await _record_run(store, index)
    await store.flush()
    holder = _lock(path)
    with structlog.testing.capture_logs() as logs:
        for index in range(3, 13):  # 10 runs while every commit is refused
            await _record_run(store, index)
        await assert_eventually(lambda: _sample(metrics, "iop_node_history_commit_failures_total") >= 3)
        assert _sample(metrics, "iop_node_history_backlog_writes") == 20  # a start and an end per run
        assert _rows(path) == [(3,)]
        _unlock(holder)
        for index in range(13, 16):
            await _record_run(store, index)
        await store.flush()
    assert _rows(path, "SELECT status, count(*) FROM runs GROUP BY status") == [("completed", 16)]
    failed = [log for log in logs if log["event"] == "run_commit_failed"]
    assert failed and all(log["log_level"] == "error" and "database is locked" in log["error"] for log in failed)
    assert [log["event"] for log in logs if log["event"] != "run_commit_failed"] == ["run_history_recovered"]
    assert _sample(metrics, "iop_node_history_backlog_writes") == 0
    assert _sample(metrics, "iop_node_history_writes_dropped_total", reason="backlog_full") == 0
    await store.aclose()


async def test_a_full_backlog_drops_the_oldest_writes_counts_and_logs_them(path: Path) -> None:
    metrics = NodeMetrics()
    store = _refusing_store(path, metrics, max_backlog=5)
    await store.open()
    holder = _lock(path)
    with structlog.testing.capture_logs() as logs:
        for index in range(8):  # no await yields here: all 8 are queued before the writer runs
            await store.record_start(_start(f"r{index}", received=index))
        assert _sample(metrics, "iop_node_history_writes_dropped_total", reason="backlog_full") == 3
        assert _sample(metrics, "iop_node_history_backlog_writes") == 5
        await assert_eventually(lambda: _sample(metrics, "iop_node_history_commit_failures_total") >= 1)
        _unlock(holder)
        await store.flush()
    dropped = [(log["log_level"], log["dropped"]) for log in logs if log["event"] == "run_history_writes_dropped"]
    assert dropped[0] == ("error", 1) and sum(count for _, count in dropped) == 3  # once a second, then the rest
    assert [row[0] for row in _rows(path, "SELECT run_id FROM runs ORDER BY run_id")] == ["r3", "r4", "r5", "r6", "r7"]
    await store.aclose()


async def test_aclose_retries_for_close_timeout_then_says_what_it_could_not_write(path: Path) -> None:
    metrics = NodeMetrics()
    store = _refusing_store(path, metrics, close_timeout=0.3)
    await store.open()
    holder = _lock(path)
    await store.record_start(_start("r1"))
    await store.record_end(_end(_start("r1")))
    began = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        await store.close()  # the old name of aclose
    assert 0.3 <= time.monotonic() - began < 3
    lost = [log for log in logs if log["event"] == "run_history_lost"]
    assert [(log["log_level"], log["writes"]) for log in lost] == [("error", 2)]
    assert _sample(metrics, "iop_node_history_writes_dropped_total", reason="closed") == 2
    _unlock(holder)
    assert _rows(path) == [(0,)]


# The schema and rows of a version 1 file, as version 1 of the node wrote them.
_V1_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT NOT NULL, node_id TEXT NOT NULL, caller TEXT NOT NULL DEFAULT '', model TEXT NOT NULL,
    adapter TEXT NOT NULL DEFAULT '', status TEXT NOT NULL,
    error_code TEXT NOT NULL DEFAULT '', error_message TEXT NOT NULL DEFAULT '',
    received_at REAL, started_at REAL, first_token_at REAL, finished_at REAL,
    prompt_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0,
    finish_reason TEXT NOT NULL DEFAULT '', stderr_tail TEXT NOT NULL DEFAULT '',
    extra TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (node_id, caller, run_id)
);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status);
CREATE INDEX IF NOT EXISTS runs_model ON runs (model);
CREATE INDEX IF NOT EXISTS runs_received_at ON runs (received_at);
CREATE INDEX IF NOT EXISTS runs_run_id ON runs (run_id);
PRAGMA user_version = 1;
"""
_V1_ROWS = [  # run_id, node_id, caller, status, received_at, extra
    ("solo", "node-a", "edge-1", "completed", 10.0, '{"pid": "7"}'),
    ("shared", "node-a", "alice", "completed", 20.0, "{}"),
    ("shared", "node-a", "bob", "running", 30.0, "{}"),
    ("shared", "node-b", "alice", "failed", 40.0, "{}"),
]


def _v1_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as connection:
        connection.executescript(_V1_SCHEMA)
        connection.executemany(
            "INSERT INTO runs (run_id, node_id, caller, model, status, received_at, extra) "
            "VALUES (?, ?, ?, 'm', ?, ?, ?)",
            _V1_ROWS,
        )
    connection.close()


async def test_a_version_1_file_is_migrated_on_open_keeping_every_row(path: Path) -> None:
    _v1_file(path)
    with structlog.testing.capture_logs() as logs:
        store, marked = await _reopen(path)
    assert marked == 1  # node-a's running row, now under the new key
    assert [log["from_version"] for log in logs if log["event"] == "run_history_migrated"] == [1]
    assert _rows(path, "PRAGMA user_version") == [(3,)]
    columns = "run_id, node_id, connection, peer, caller, status, extra, usage_estimated"
    rows = _rows(path, f"SELECT {columns} FROM runs ORDER BY rowid")  # noqa: S608 - constant text
    assert rows == [
        ("solo", "node-a", "", "edge-1", "edge-1", "completed", '{"pid": "7"}', 0),
        ("shared", "node-a", "v1:alice", "alice", "alice", "completed", "{}", 0),  # two callers shared this id
        ("shared", "node-a", "v1:bob", "bob", "bob", "interrupted", "{}", 0),
        ("shared", "node-b", "", "alice", "alice", "failed", "{}", 0),
    ]
    indexes = {row[0] for row in _rows(path, "SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"runs_status", "runs_model", "runs_received_at", "runs_run_id"} <= indexes
    assert not _rows(path, "SELECT name FROM sqlite_master WHERE name = 'runs_v2'")
    got = await store.get("solo")
    assert got is not None and (got.peer, got.connection, got.extra) == ("edge-1", "", {"pid": "7"})
    await store.record_start(dataclasses.replace(_start("solo", connection="conn-new"), received_at=_at(99)))
    assert [r.connection for r in await store.list() if r.run_id == "solo"] == ["conn-new", ""]
    await store.close()
    store, _ = await _reopen(path)  # a second open finds version 3 and changes nothing
    assert len(await store.list()) == 5
    await store.close()


async def test_a_version_2_file_gains_the_usage_estimated_column_keeping_every_row(path: Path) -> None:
    store, _ = await _reopen(path)
    await store.record_end(_end(_start("r1")))
    await store.aclose()
    _rows(path, "ALTER TABLE runs DROP COLUMN usage_estimated")  # what version 2 of the node wrote
    _rows(path, "PRAGMA user_version = 2")
    with structlog.testing.capture_logs() as logs:
        store, _ = await _reopen(path)
    assert [log["from_version"] for log in logs if log["event"] == "run_history_migrated"] == [2]
    assert _rows(path, "PRAGMA user_version") == [(3,)]
    assert await store.get("r1") == _end(_start("r1"))  # usage_estimated: False
    estimated = dataclasses.replace(_end(_start("r2")), usage_estimated=True)
    await store.record_end(estimated)
    assert await store.get("r2") == estimated
    await store.aclose()


async def test_nodes_opening_a_version_1_file_together_migrate_it_once(path: Path) -> None:
    _v1_file(path)
    stores = [SqliteRunStore(path, node_id) for node_id in ("node-a", "node-b", "node-c")]
    await asyncio.gather(*(store.open(mark_interrupted=False) for store in stores))
    rows = _rows(path, "SELECT run_id, node_id, connection FROM runs ORDER BY rowid")
    assert rows == [
        ("solo", "node-a", ""),
        ("shared", "node-a", "v1:alice"),
        ("shared", "node-a", "v1:bob"),
        ("shared", "node-b", ""),
    ]
    for store in stores:
        await store.close()


# -- identity: what the core records about who sent a run --------------------------------------


class _Sink:
    """The parts of the wire's EventSink the core uses, for one run on one connection."""

    def __init__(self, peer: PeerIdentity, connection_id: str) -> None:
        self.peer, self.connection_id = peer, connection_id
        self.cancel_reason = ""
        self.events: list[str] = []

    async def start(self, *, node_id: str, model: str, adapter: str) -> None:
        self.events.append("start")

    async def delta(self, text: str) -> None:
        self.events.append("delta")

    async def output(self, delta: pb.RunDelta) -> None:
        self.events.append("delta")

    async def complete(
        self, finish_reason: int, usage: pb.Usage | None = None, timings: pb.Timings | None = None
    ) -> None:
        self.events.append("complete")


def _node(store: SqliteRunStore) -> Node:
    routes = [RouteSettings(model="m", adapter="mock", options={"tokens": 2})]
    return Node(
        node_id="node-a",
        router=Router(routes, Limits(max_prompt_chars=1000, max_tokens=100)),
        adapters={"mock": MockAdapter({"m": MockOptions(tokens=2)})},
        store=store,
        metrics=NodeMetrics(),
        version="test",
    )


def _request(run_id: str, caller: str = "", model: str = "m") -> pb.RunRequest:
    message = pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text="hi")])
    return pb.RunRequest(run_id=run_id, model=model, messages=[message], caller=pb.Caller(id=caller))


EDGE = PeerIdentity("edge-1", Role.EDGE)
WORKER = PeerIdentity("worker-1", Role.WORKER)
ADMIN = PeerIdentity("admin-1", Role.ADMIN)


async def _run(node: Node, request: pb.RunRequest, peer: PeerIdentity, connection_id: str) -> _Sink:
    sink = _Sink(peer, connection_id)
    await node.run(request, sink)  # type: ignore[arg-type]  # a stand-in for the wire's sink
    return sink


async def test_a_peer_reusing_another_connections_run_id_gets_its_own_row(store: SqliteRunStore) -> None:
    node = _node(store)
    edge = await _run(node, _request("r1", caller="alice"), EDGE, "conn-e")
    assert edge.events == ["start", "delta", "delta", "complete"]
    before = await store.get("r1")
    assert before is not None and (before.caller, before.peer, before.connection) == ("alice", "edge-1", "conn-e")
    # The attack: a worker certificate names the edge as caller and reuses the edge's run id.
    with pytest.raises(IopError):
        await _run(node, _request("r1", caller="edge-1", model="nope"), WORKER, "conn-w")
    rows = {r.connection: r for r in await store.list()}
    assert rows["conn-e"] == before  # untouched
    intruder = rows["conn-w"]
    assert (intruder.peer, intruder.status, intruder.error_code) == ("worker-1", RunStatus.FAILED, "MODEL_NOT_FOUND")
    # Workers act for their jobs' owners (tls.TRUSTED_ROLES): the name is kept, beside who vouched for it.
    assert intruder.caller == "edge-1"
    assert len(rows) == 2


async def test_the_same_run_id_on_two_connections_of_one_peer_is_two_rows(store: SqliteRunStore) -> None:
    node = _node(store)
    await _run(node, _request("r1"), EDGE, "conn-1")
    await _run(node, _request("r1"), EDGE, "conn-2")
    rows = await store.list()
    assert sorted((r.connection, r.status.value) for r in rows) == [("conn-1", "completed"), ("conn-2", "completed")]


@pytest.mark.parametrize(
    ("peer", "named", "caller"),
    [
        (EDGE, "alice", "alice"),  # an edge acts for its API keys' owners
        (EDGE, "", "edge-1"),  # nobody named: the peer itself
        (ADMIN, "edge-1", "admin-1"),  # an admin acts for nobody: the name in the request is ignored
        (PeerIdentity("", None), "edge-1", ""),  # plaintext, no certificate: no identity to take a name from
    ],
    ids=["edge-names-a-caller", "edge-names-nobody", "admin-cannot-name-one", "anonymous-cannot-name-one"],
)
async def test_the_caller_is_named_only_by_roles_that_act_for_others(
    store: SqliteRunStore, peer: PeerIdentity, named: str, caller: str
) -> None:
    await _run(_node(store), _request("r1", caller=named), peer, "conn-1")
    record = await store.get("r1")
    assert record is not None and (record.caller, record.peer) == (caller, peer.name)
