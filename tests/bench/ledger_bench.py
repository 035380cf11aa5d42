"""Ledger benchmark: the audit writer's cost per run, with the open-run journal and without it.

Each case commits RUNS runs through :class:`AuditStore` (its writer thread, its batching) and
reports the writer's CPU time per run:

- ``ended only``: runs recorded when they end and never noted open (what the ledger did before
  runs in progress were journaled);
- ``short runs``: started, placed and ended within one commit window (the journal writes nothing);
- ``long runs``: the open row and its node are committed, then the run ends in a later batch
  (one insert, one update and one delete more per run).

Prints a table; asserts nothing.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from table import print_table

from iop_control_plane.ledger import Attempt, LedgerEntry
from iop_control_plane.sqlite_store import SqliteStore
from iop_control_plane.store import AuditStore
from iop_gen.pb.iop import runtime_pb2 as pb

RUNS = 20_000
_Case = Callable[[AuditStore, list[LedgerEntry]], Awaitable[None]]


def _entries() -> list[LedgerEntry]:
    return [LedgerEntry(f"run-{n}", "edge-1", "c0ffee0123456789", "alice", "mock-small") for n in range(RUNS)]


def _place_and_end(entry: LedgerEntry, store: AuditStore, *, placed: bool) -> None:
    entry.attempts.append(Attempt("node-a", "mock-small", entry.received, outcome="completed", ended=entry.received))
    if placed:
        store.run_placed(entry)
    entry.ending(pb.RunEvent(complete=pb.RunComplete(usage=pb.Usage(prompt_tokens=5, completion_tokens=16))))
    store.run_ended(entry)


async def _ended_only(store: AuditStore, entries: list[LedgerEntry]) -> None:
    for number, entry in enumerate(entries, 1):
        _place_and_end(entry, store, placed=False)
        if number % 100 == 0:
            await asyncio.sleep(0)


async def _short(store: AuditStore, entries: list[LedgerEntry]) -> None:
    for number, entry in enumerate(entries, 1):
        store.run_started(entry)
        _place_and_end(entry, store, placed=True)
        if number % 100 == 0:
            await asyncio.sleep(0)


async def _long(store: AuditStore, entries: list[LedgerEntry]) -> None:
    for chunk in range(0, RUNS, 500):
        for entry in entries[chunk : chunk + 500]:
            store.run_started(entry)
        await asyncio.sleep(0.05)  # past the commit window: the open rows are written
        for entry in entries[chunk : chunk + 500]:
            _place_and_end(entry, store, placed=True)


async def _measure(case: _Case) -> float:
    """The writer's CPU seconds per run (the writer's thread; the event loop's own work excluded)."""
    with tempfile.TemporaryDirectory() as folder:
        store = AuditStore(Path(folder) / "cp.db", backlog=RUNS)
        await store.open()
        spent = 0.0
        state = store.state
        assert isinstance(state, SqliteStore)
        commit = state._commit  # the benchmark times the writer's own work

        def timed(db: object, batch: object, touched: object) -> None:
            nonlocal spent
            began = time.thread_time()
            commit(db, batch, touched)  # type: ignore[arg-type]  # the writer's batch, passed through
            spent += time.thread_time() - began

        state._commit = timed  # type: ignore[method-assign]  # wrapped, as above
        await case(store, _entries())
        await store.aclose()
    return spent / RUNS


async def main() -> None:
    cases = {"ended only (before)": _ended_only, "short runs": _short, "long runs": _long}
    rows = [(f"ledger writer, {name}", f"{await _measure(case) * 1e6:.1f}") for name, case in cases.items()]
    print_table(rows, "µs CPU per run")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
