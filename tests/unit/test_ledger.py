"""The run ledger: a full write backlog drops runs (counted), old runs are pruned, runs left open by a
killed control-plane are recorded as interrupted, and every string it stores is clipped."""

from __future__ import annotations

import contextlib
import math
import sqlite3
from pathlib import Path

import pytest
from conftest import assert_eventually
from prometheus_client import CollectorRegistry, Counter

from iop_control_plane import ledger
from iop_control_plane.ledger import Attempt, LedgerEntry
from iop_control_plane.metrics import ControlPlaneMetrics
from iop_control_plane.registry import Registry
from iop_control_plane.store import AuditStore
from iop_control_plane.text import NAME_CHARS, TEXT_CHARS
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
    with pytest.raises(ValueError, match="unknown status 'done'; valid: completed, failed, cancelled, interrupted"):
        ledger.query(tmp_path / "cp.db", pb.RunsList(status="done"))


def _open_runs(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db:
        (count,) = db.execute("SELECT COUNT(*) FROM open_runs").fetchone()
    return int(count)


async def test_runs_left_open_are_recorded_as_interrupted_when_the_store_opens_again(tmp_path: Path) -> None:
    path = tmp_path / "cp.db"
    store = AuditStore(path)
    await store.open()
    waiting, placed, ended = (LedgerEntry(run_id, "edge-1", "c1", "alice", "mock") for run_id in ("w", "p", "e"))
    for entry in (waiting, placed, ended):
        store.run_started(entry)
    await assert_eventually(lambda: _open_runs(path) == 3)  # committed: each end must close its row
    for node in ("node-a", "node-b"):  # a failover: the second attempt is the one in progress
        placed.attempts.append(Attempt(node, "mock-small", placed.received))
        store.run_placed(placed)
    ended.ending(pb.RunEvent(complete=pb.RunComplete()))
    store.run_ended(ended)
    await store.aclose()  # as the file is when the process is killed: waiting and placed never ended
    assert _open_runs(path) == 2

    reopened = AuditStore(path)
    await reopened.open()
    await reopened.aclose()
    assert _open_runs(path) == 0
    listed = ledger.query(path, pb.RunsList()).runs
    assert sorted(run.run_id for run in listed) == ["e", "p", "w"]
    runs = {run.run_id: run for run in listed}
    assert {run_id: run.status for run_id, run in runs.items()} == {
        "w": "interrupted",
        "p": "interrupted",
        "e": "completed",
    }
    assert runs["w"].node_id == "" and not runs["w"].attempts and "not yet placed" in runs["w"].error_message
    (attempt,) = runs["p"].attempts
    assert (runs["p"].node_id, attempt.node_id, attempt.model, attempt.outcome) == (
        "node-b",
        "node-b",
        "mock-small",
        "interrupted",
    )
    assert [run.run_id for run in ledger.query(path, pb.RunsList(status="interrupted")).runs] == ["p", "w"]


async def test_a_run_that_ends_within_one_commit_writes_no_open_row(tmp_path: Path) -> None:
    store = AuditStore(tmp_path / "cp.db")
    await store.open()
    entry = _entry("quick", "node-a")  # started, placed and ended before the writer's window closed
    store.run_started(entry)
    store.run_placed(entry)
    store.run_ended(entry)
    await store.aclose()
    assert entry.open_row is None and _open_runs(tmp_path / "cp.db") == 0
    assert [run.status for run in ledger.query(tmp_path / "cp.db", pb.RunsList()).runs] == ["completed"]


async def test_a_run_the_backlog_had_no_room_for_at_its_start_is_not_recorded_at_its_end(tmp_path: Path) -> None:
    dropped = Counter("dropped", "", registry=CollectorRegistry())
    store = AuditStore(tmp_path / "cp.db", backlog=1, dropped=dropped)
    await store.open()
    taken, refused = _entry("taken"), _entry("refused")
    store.run_started(taken)
    store.run_started(refused)
    store.run_ended(refused)
    store.run_ended(taken)  # its end is written though the backlog is full: its open row must close
    await store.aclose()
    assert dropped._value.get() == 1 and _open_runs(tmp_path / "cp.db") == 0
    assert [run.run_id for run in ledger.query(tmp_path / "cp.db", pb.RunsList()).runs] == ["taken"]


async def test_node_writes_past_the_backlog_are_dropped_and_counted_in_the_metrics(tmp_path: Path) -> None:
    metrics = ControlPlaneMetrics(Registry())
    store = AuditStore(tmp_path / "cp.db", backlog=3)
    metrics.watch_store(store)
    await store.open()
    for n in range(5):  # nothing is written before the loop runs again: the backlog holds 3
        store.state_changed(f"node-{n}", "ready", "registered")
    assert metrics.registry.get_sample_value("iop_control_plane_store_backlog") == 3
    assert metrics.registry.get_sample_value("iop_control_plane_audit_dropped_total") == 2
    assert metrics.registry.get_sample_value("iop_control_plane_store_up") == 1
    await store.aclose()
    assert metrics.registry.get_sample_value("iop_control_plane_store_backlog") == 0
    assert store.events("node-2") == [("ready", "registered")] and store.events("node-3") == []


async def test_every_stored_string_is_clipped(tmp_path: Path) -> None:
    huge = "m" * 1_000_000
    store = AuditStore(tmp_path / "cp.db")
    await store.open()
    open_entry = LedgerEntry(huge, huge, huge, huge, huge)
    store.run_started(open_entry)
    open_entry.attempts.append(Attempt(huge, huge, open_entry.received))
    store.run_placed(open_entry)
    ended = LedgerEntry(huge + "m", huge, huge, huge, huge)  # another run: its id clips to another
    ended.attempts.append(Attempt(huge, huge, ended.received, reason=huge, ended=ended.received))
    ended.ending(pb.RunEvent(error=pb.Error(code=pb.ERROR_CODE_INTERNAL, message=huge)))
    store.run_ended(ended)
    await store.aclose()
    await (reopened := AuditStore(tmp_path / "cp.db")).open()  # the open run is recovered, clipped too
    await reopened.aclose()
    runs = ledger.query(tmp_path / "cp.db", pb.RunsList()).runs
    assert (
        len(runs) == 2 and sum(file.stat().st_size for file in tmp_path.glob("cp.db*")) < 200_000
    )  # a few pages per table: nothing near the 1 MB strings
    for run in runs:
        names = [run.run_id, run.requester, run.connection, run.caller, run.model, run.node_id]
        names += [name for attempt in run.attempts for name in (attempt.node_id, attempt.model)]
        assert all(name.startswith("m" * NAME_CHARS + "…[") and len(name) < NAME_CHARS + 20 for name in names)
        texts = (run.error_message, *(attempt.reason for attempt in run.attempts))
        assert all(len(text) < TEXT_CHARS + 100 for text in texts)
    (failed,) = (run for run in runs if run.status == "failed")
    assert failed.error_message.endswith(f"…[{1_000_000 - TEXT_CHARS} more]")


async def test_node_state_changes_are_pruned_and_their_reasons_clipped(tmp_path: Path) -> None:
    store = AuditStore(tmp_path / "cp.db", max_events=5)
    await store.open()
    for number in range(3000):  # a node that reconnects in a loop
        store.state_changed("node-a", "ready" if number % 2 else "unavailable", f"change {number}")
    store.state_changed("node-a", "draining", "r" * 1_000_000)
    await store.aclose()
    with contextlib.closing(sqlite3.connect(tmp_path / "cp.db")) as db:
        reasons = [reason for (reason,) in db.execute("SELECT reason FROM node_events ORDER BY rowid")]
    assert reasons[:4] == [f"change {number}" for number in range(2996, 3000)]  # the newest 5 kept
    assert len(reasons) == 5 and reasons[-1].startswith("r" * TEXT_CHARS + "…[") and len(reasons[-1]) < TEXT_CHARS + 20


async def test_runs_left_open_wait_for_their_node_in_bounded_number_and_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from iop_control_plane import settling
    from iop_control_plane.nodes import NodeSessions

    monkeypatch.setattr(settling, "MAX_KEPT", 2)
    monkeypatch.setattr(settling, "KEEP_FOR", 0.05)
    metrics = ControlPlaneMetrics(Registry())
    store = AuditStore(tmp_path / "cp.db")
    left_open = settling.LeftOpenRuns(store.state, NodeSessions(Registry(), store, heartbeat_interval=1.0),
                                      metrics.left_open_settled)  # fmt: skip
    runs = [ledger.LeftOpen(number, "node-a", 1, f"c.r{number}.1") for number in range(3)]
    left_open.add([*runs, ledger.LeftOpen(9, "", 0, "")])  # node-a is not connected; the unplaced one waits for none
    assert left_open.kept == 2

    def outcome(name: str) -> float | None:
        return metrics.registry.get_sample_value("iop_control_plane_left_open_runs_total", {"outcome": name})

    assert outcome("not_kept") == 1
    await assert_eventually(lambda: left_open.kept == 0, timeout=5)  # node-a never registered
    assert outcome("node_not_back") == 2


def test_a_cancelled_run_keeps_the_estimate_until_its_nodes_count_comes() -> None:
    entry = LedgerEntry("r1", "edge-1", "c1", "alice", "mock-small", prompt_estimate=4, outputs=2)
    entry.attempts.append(Attempt("node-a", "mock-small", entry.received, outcome="cancelled"))
    entry.ending(None, "the client went away")
    estimate = pb.Usage(prompt_tokens=4, completion_tokens=2, estimated=True)
    assert (entry.status, entry.error_message, entry.usage) == ("cancelled", "the client went away", estimate)
    lost = pb.RunEvent(error=pb.Error(code=pb.ERROR_CODE_NODE_LOST, message="connection closed"))
    assert not entry.counted(lost) and entry.usage == estimate  # made here: no count in it
    used = pb.Usage(prompt_tokens=6, completion_tokens=5, estimated=True)
    assert entry.counted(pb.RunEvent(error=pb.Error(code=pb.ERROR_CODE_CANCELLED, usage=used)))
    assert (entry.status, entry.usage) == ("cancelled", used)


def test_a_page_boundary_in_nanoseconds_excludes_exactly_the_runs_at_or_after_it() -> None:
    """runs.list's ``before`` is the oldest run's time in nanoseconds (as shown); read back as seconds
    it rounded up 1 time in 30, and the next page started with that same run."""
    rounded_up = 0
    for step in range(20_000):
        stored = 1_764_000_000.0 + step * 0.000_123_457  # times as time.time() gives them
        shown = int(stored * 1e9)
        rounded_up += shown / 1e9 >= stored
        below = ledger._below(shown)
        assert below < stored, (stored, shown)
        assert int(math.nextafter(below, math.inf) * 1e9) >= shown
    assert rounded_up > 0  # the case the stepping is for does occur in these times


@pytest.mark.timeout(10)
def test_a_boundary_at_or_before_the_epoch_is_answered_at_once_and_matches_no_run() -> None:
    """``before`` 0 (or a negative Timestamp) stepped through every float near zero, for ever, in the
    store's thread: one console request (runs?before=0) held a thread of the control-plane at 100% CPU."""
    for nanoseconds in (0, -1, -5, -1_764_000_000_000_000_000):
        assert ledger._below(nanoseconds) < 0  # no run's received_at is negative
    assert 0 < ledger._below(1) < 1e-9
