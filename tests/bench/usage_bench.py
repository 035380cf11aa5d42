"""Usage benchmark: usage.list over a month of a busy platform's rollup (no processes).

A state store is filled as the ledger's writer fills it: RUNS runs spread evenly over 30 days,
from CALLERS callers of MODELS models (completed, some failed), summed per batch of 10,000 runs
with :func:`iop_control_plane.usage.rollup` and upserted with the store's own statements into
``usage_hours`` and ``usage_days`` (the ``runs`` rows themselves are not written: usage.list
never reads them). Then each query runs REPEAT times through the store's ``usage()`` (SQLite: a
read-only connection in a thread; PostgreSQL: the pool), answer built, and its p50 and p95 are
printed, with the number of rows it returned. SQLite always; PostgreSQL when initdb and pg_ctl
are installed (a throwaway server, as ``tests/worker/pg_server.py`` starts it; its usage tables
analyzed once filled, as autovacuum would have long before a month of use).

Prints a table; asserts nothing. Target: under 200 ms for a month by hour, by caller and model.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from table import print_table

from iop_control_plane import usage
from iop_control_plane.pg_store import PgStore
from iop_control_plane.sqlite_store import SqliteStore
from iop_control_plane.state import StateStore
from iop_gen.pb.iop import runtime_pb2 as pb

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/: the PostgreSQL helper of the store suite
from worker.pg_server import find_binaries, pg_server

RUNS = 1_000_000
CALLERS = 10
MODELS = 4
DAYS = 30
REPEAT = 40
_BATCH = 10_000
_END = 1_764_633_600  # 2025-12-02 00:00 UTC: the month before it
_START = _END - DAYS * 86_400
Fill = Callable[[list[tuple[object, ...]]], Awaitable[None]]


def _runs(batch: int, rng: random.Random) -> list[tuple[object, ...]]:
    """``runs`` rows (``ledger.RUN_COLUMNS`` order) with what the rollup reads set; received in order."""
    rows = []
    for n in range(batch, min(batch + _BATCH, RUNS)):
        at = _START + n * (DAYS * 86_400 / RUNS)
        status = "failed" if rng.random() < 0.02 else "completed"
        caller, model = f"team-{rng.randrange(CALLERS)}", f"model-{rng.randrange(MODELS)}"
        prompt, completion = rng.randrange(20, 2000), rng.randrange(1, 500)
        rows.append(("r", "edge-1", "c", caller, model, "node", status, 0, "", at, None, 1.0, prompt, completion,
                     0, 1, 1, 0, prompt // 4))  # fmt: skip
    return rows


async def _fill(fill: Fill) -> float:
    """Seconds to roll up and write every run (in batches, as the writer would)."""
    rng, began = random.Random(7), time.perf_counter()
    for batch in range(0, RUNS, _BATCH):
        await fill(_runs(batch, rng))
    return time.perf_counter() - began


def _sqlite_fill(store: SqliteStore) -> Fill:
    statements = {table: usage.upsert_sql(table, lambda _: "?") for table, _ in usage.TABLES}

    async def fill(runs: list[tuple[object, ...]]) -> None:
        def write(db: sqlite3.Connection) -> None:
            with db:
                for table, rows in usage.rollup(runs):
                    db.executemany(statements[table], rows)

        await store._call(write)  # the store's one connection, as its writer uses it

    return fill


def _pg_fill(store: PgStore) -> Fill:
    statements = {table: usage.upsert_sql(table, lambda n: f"${n}") for table, _ in usage.TABLES}

    async def fill(runs: list[tuple[object, ...]]) -> None:
        async with store.pool.acquire() as conn, conn.transaction():
            for table, rows in usage.rollup(runs):
                await conn.executemany(statements[table], rows)

    return fill


def _queries() -> dict[str, pb.UsageList]:
    def month(**fields: object) -> pb.UsageList:
        request = pb.UsageList(**fields)  # type: ignore[arg-type]
        request.start.seconds, request.end.seconds = _START, _END
        return request

    day, hour = pb.USAGE_BUCKET_DAY, pb.USAGE_BUCKET_HOUR
    return {
        "month by day, by caller and model": month(bucket=day, by_caller=True, by_model=True),
        "month by hour, by caller and model": month(bucket=hour, by_caller=True, by_model=True),
        "month by hour, one caller, by model": month(bucket=hour, caller="team-3", by_model=True),
        "month by day, summed": month(bucket=day),
    }


async def _measure(store: StateStore, name: str) -> list[tuple[str, str]]:
    rows = []
    for what, request in _queries().items():
        took, answered = [], 0
        for _ in range(REPEAT):
            began = time.perf_counter()
            answered = len((await store.usage(request)).entries)
            took.append((time.perf_counter() - began) * 1e3)
        p95 = statistics.quantiles(took, n=20)[-1]
        rows.append((f"usage.list {name}, {what} ({answered:,} rows)", f"{statistics.median(took):.1f} / {p95:.1f}"))
    return rows


async def _sqlite(folder: Path) -> list[tuple[str, str]]:
    store = SqliteStore(folder / "cp.db")
    await store.open("bench")
    try:
        filled = await _fill(_sqlite_fill(store))
        print(f"SQLite: {RUNS:,} runs rolled up and written in {filled:.1f} s", file=sys.stderr)
        return await _measure(store, "SQLite")
    finally:
        await store.aclose()


async def _postgres() -> list[tuple[str, str]]:
    binaries = find_binaries()
    if binaries is None:
        print("PostgreSQL: skipped (initdb and pg_ctl are not installed)", file=sys.stderr)
        return []
    with pg_server(binaries) as server:
        store = PgStore(server.url())
        await store.open("bench")
        try:
            filled = await _fill(_pg_fill(store))
            print(f"PostgreSQL: {RUNS:,} runs rolled up and written in {filled:.1f} s", file=sys.stderr)
            # A month written in seconds is read before autovacuum's first pass (it wakes every minute):
            # with no statistics the planner sorts the rows on disk instead of reading the key's index in
            # order (p50 156 ms, p95 236 ms then). A platform that took a month to fill them has them.
            await store.pool.execute("ANALYZE usage_hours; ANALYZE usage_days")
            return await _measure(store, "PostgreSQL")
        finally:
            await store.aclose()


async def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        rows = await _sqlite(Path(folder))
    rows += await _postgres()
    print_table(rows, "ms p50 / p95")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
