"""The engine outlives its store's errors: a failed step is counted and tried again, never silently gone.

The errors are real ones from real stores: SQLite's "database is locked" (another connection holds
the write lock past the busy timeout) and asyncpg's lost connection (PostgreSQL terminates the
store's sessions). Neither is an OSError, which is all the engine used to survive: its task ended
and no batch ran again until a restart. The engine here never reaches the control-plane: the batch
it must finish has no lines, so finishing it is store work alone.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from iop_wire.dialer import KeepConnected, Links, Target
from iop_worker.engine import Engine
from iop_worker.metrics import WorkerMetrics
from iop_worker.pg_store import PgJobStore
from iop_worker.settings import BatchSettings
from iop_worker.sqlite_store import SqliteJobStore
from iop_worker.store import BatchRecord, BatchStatus, JobStore, new_batch_id
from worker.pg_server import PgServer, create_database, end_sessions
from worker.test_store import eventually

UNUSED = Target("127.0.0.1", 9)
"""The control-plane the engine would dial for a line; never dialed here (the batch has no lines)."""


def _failures(metrics: WorkerMetrics, part: str) -> float:
    return metrics.registry.get_sample_value("iop_worker_part_failures_total", {"part": part}) or 0.0


@pytest.fixture
async def running() -> AsyncIterator[list[asyncio.Task[None]]]:
    tasks: list[asyncio.Task[None]] = []
    yield tasks
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _engine(store: JobStore, metrics: WorkerMetrics) -> Engine:
    settings = BatchSettings(poll_interval=0.05, lease_seconds=1.0)
    return Engine(store, Links([KeepConnected(UNUSED)]), settings, metrics, name="supervised")


async def _finishes_a_batch(store: JobStore) -> None:
    batch_id = new_batch_id()
    now = int(time.time())
    batch = BatchRecord(batch_id, "/v1/chat/completions", "file-x", "24h", now, now + 3600, BatchStatus.IN_PROGRESS)
    await store.create_batch(batch, [])
    ended = await eventually(
        lambda: store.get_batch(batch_id), lambda found: found is not None and found.status is BatchStatus.COMPLETED
    )
    assert ended is not None and ended.completed_at is not None


async def test_a_locked_sqlite_file_pauses_the_engine_and_it_goes_on(
    tmp_path: Path, running: list[asyncio.Task[None]]
) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = SqliteJobStore(path, busy_timeout=0.05)
    await store.open()
    metrics = WorkerMetrics()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process's long write: the engine's lease cannot start one
    try:
        engine = asyncio.create_task(_engine(store, metrics).run_forever())
        running.append(engine)
        await eventually(lambda: asyncio.sleep(0, _failures(metrics, "step")), lambda failed: failed >= 2)
        assert not engine.done()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    await _finishes_a_batch(store)
    assert not engine.done()
    await store.aclose()


async def test_lost_postgresql_sessions_pause_the_engine_and_it_goes_on(
    postgres: PgServer, running: list[asyncio.Task[None]]
) -> None:
    url = postgres.url(await create_database(postgres, f"supervised_{os.getpid()}"))
    store = PgJobStore(url, max_connections=2)
    await store.open()
    metrics = WorkerMetrics()
    engine = asyncio.create_task(_engine(store, metrics).run_forever())
    running.append(engine)
    admin = await asyncpg.connect(postgres.url())
    try:

        async def terminate() -> float:  # the server ends the store's sessions (a restart, a failover)
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                url.rsplit("/", 1)[1],
            )
            return _failures(metrics, "step")

        await eventually(terminate, lambda failed: failed >= 1, timeout=10.0)
    finally:
        await admin.close()
    assert not engine.done()
    await _finishes_a_batch(store)
    await store.aclose()


async def test_a_request_right_after_the_server_ends_the_sessions_is_served(postgres: PgServer) -> None:
    """The pool still holds the ended sessions (their end not yet read): the store takes fresh ones.

    CI once saw ``create_batch`` fail with asyncpg's "another operation is in progress" on a session
    the server had just ended: the next API request would have failed the same way.
    """
    database = await create_database(postgres, f"ended_{os.getpid()}")
    store = PgJobStore(postgres.url(database), max_connections=2)
    await store.open()
    try:
        rounds = 0
        # Whether create_batch meets an ended session or the pool saw the end first is a race: go on
        # past 20 rounds (to 100) until at least one did, so the path is exercised on every run.
        while rounds < 20 or (store.sessions_lost == 0 and rounds < 100):
            rounds += 1
            await asyncio.gather(*(store.get_batch("batch_none") for _ in range(2)))  # both sessions open, idle
            assert await end_sessions(postgres, database) >= 1
            now = int(time.time())
            batch = BatchRecord(
                new_batch_id(), "/v1/chat/completions", "file-x", "24h", now, now + 3600, BatchStatus.VALIDATING
            )
            await store.create_batch(batch, [])
            assert await store.get_batch(batch.id) == batch
        assert store.sessions_lost >= 1
    finally:
        await store.aclose()
