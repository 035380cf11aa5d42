"""The run history on real SQLite files: round trips, WAL, group commit, interrupted runs, filters, errors."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog

from iop_node.domain import RunRecord, RunStatus
from iop_node.history import list_runs, show_run
from iop_node.store import INTERRUPTED_MESSAGE, SqliteRunStore

T0 = datetime.datetime(2026, 5, 1, 12, 0, 0, 123456, tzinfo=datetime.UTC)


def _at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def _start(run_id: str, node_id: str = "node-a", model: str = "m", received: float = 0.0) -> RunRecord:
    return RunRecord(run_id=run_id, node_id=node_id, model=model, status=RunStatus.RUNNING, received_at=_at(received))


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
        run_id="r1", node_id="node-a", model="llama", status=RunStatus.RUNNING, caller="edge-1", received_at=_at(0)
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
    assert _rows(path, "PRAGMA user_version") == [(1,)]
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


async def test_two_callers_may_use_the_same_run_id(store: SqliteRunStore) -> None:
    alice = dataclasses.replace(_start("job-1"), caller="alice")
    bob = dataclasses.replace(_start("job-1"), caller="bob", received_at=_at(50))
    await store.record_start(alice)
    await store.record_start(bob)
    await store.record_end(_end(alice))
    rows = await store.list()
    assert sorted((r.caller, r.status.value) for r in rows) == [("alice", "completed"), ("bob", "running")]


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


async def test_history_reads_without_changing_rows(path: Path) -> None:
    store, _ = await _reopen(path)
    await store.record_start(_start("r1", received=0))
    await store.record_end(dataclasses.replace(_end(_start("r2", received=1)), stderr_tail="boom"))
    await store.flush()
    table = await list_runs(path, status=None, model=None, since=None, limit=10)
    assert table.splitlines()[0].startswith("RUN ID") and "r1" in table and "r2" in table
    assert "running" in await list_runs(path, status="running", model="m", since="2026-01-01", limit=10)
    shown = await show_run(path, "r2")
    assert shown is not None and shown.endswith("stderr_tail:\n    boom")
    assert await show_run(path, "nope") is None
    assert _rows(path, "SELECT run_id, status FROM runs ORDER BY run_id") == [("r1", "running"), ("r2", "completed")]
    await store.close()


async def test_history_errors_name_the_problem(tmp_path: Path, path: Path) -> None:
    missing = tmp_path / "missing.db"
    with pytest.raises(FileNotFoundError, match=r"missing\.db") as caught:
        await show_run(missing, "r1")
    assert caught.value.filename == str(missing)
    assert not missing.exists()
    with pytest.raises(ValueError, match="valid: running, completed, failed, cancelled, interrupted"):
        await list_runs(path, status="done", model=None, since=None, limit=10)
    with pytest.raises(ValueError, match="30s"):
        await list_runs(path, status=None, model=None, since="yesterday", limit=10)


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
