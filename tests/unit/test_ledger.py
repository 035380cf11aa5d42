"""The run ledger's bounds: a full write backlog drops runs (counted), and old runs are pruned."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from iop_control_plane import ledger
from iop_control_plane.ledger import Attempt, LedgerEntry
from iop_control_plane.store import AuditStore
from iop_gen.pb.iop import runtime_pb2 as pb


def _entry(run_id: str, *nodes: str) -> LedgerEntry:
    entry = LedgerEntry(run_id, "edge-1", "c1", "alice", "mock-small")
    for node in nodes:
        entry.attempts.append(Attempt(node, "mock-small", entry.received, outcome="failed", ended=entry.received))
    entry.ending(pb.RunEvent(complete=pb.RunComplete(usage=pb.Usage(completion_tokens=3))))
    return entry


async def test_a_full_backlog_drops_runs_and_counts_them(tmp_path: Path) -> None:
    dropped = Counter("dropped", "", registry=CollectorRegistry())
    store = AuditStore(tmp_path / "cp.db", backlog=2, dropped=dropped)
    await store.open()
    for number in range(3):  # the writer gets no turn in between: all three wait
        store.run_ended(_entry(f"r{number}", "node-a"))
    assert dropped._value.get() == 1
    await store.aclose()
    listed = ledger.query(tmp_path / "cp.db", pb.RunsList())
    assert [run.run_id for run in listed.runs] == ["r1", "r0"] and not listed.more
    assert listed.runs[0].usage.completion_tokens == 3 and listed.runs[0].attempts[0].node_id == "node-a"


async def test_old_runs_are_pruned_with_their_attempts(tmp_path: Path) -> None:
    store = AuditStore(tmp_path / "cp.db", max_runs=5)
    await store.open()
    for number in range(1000):
        store.run_ended(_entry(f"r{number}", "node-a", "node-b"))
    await store.aclose()
    listed = ledger.query(tmp_path / "cp.db", pb.RunsList(limit=1000))
    assert [run.run_id for run in listed.runs] == [f"r{number}" for number in range(999, 994, -1)]
    assert all(len(run.attempts) == 2 for run in listed.runs)
    assert [run.run_id for run in ledger.query(tmp_path / "cp.db", pb.RunsList(node_id="node-b", limit=2)).runs] == [
        "r999",
        "r998",
    ]


def test_a_bad_status_is_refused_naming_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown status 'done'; valid: completed, failed, cancelled"):
        ledger.query(tmp_path / "cp.db", pb.RunsList(status="done"))
