"""Migration: a run whose node is lost after output continues on another node that can continue it.

Real `iop node` processes (mock adapter: its continuation is exact; cli adapter: it continues
nothing) registered over mTLS with an in-process control-plane; a node is killed (SIGKILL) or
frozen (SIGSTOP) mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import Pki, assert_eventually
from cp_helpers import (
    IOP,
    all_ready,
    client,
    cp_settings,
    listening_port,
    node_process,
    node_processes,
    one_stream,
)
from cp_policy_helpers import write_policy
from node_helpers import chat, collect, kinds, text

from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection
from iop_wire.runs import RunStream
from iop_wire.tls import Role

PACED: dict[str, Any] = {"model": "paced", "adapter": "mock", "options": {"tokens": 40, "tokens_per_second": 20}}
_WORDS = "import sys, time\nfor n in range(40):\n    print('word', n, flush=True)\n    time.sleep(0.05)\n"
CLI: dict[str, Any] = {"model": "paced", "adapter": "cli", "options": {"argv": [sys.executable, "-c", _WORDS]}}


@pytest.fixture
async def cp(pki: Pki, tmp_path: Path) -> AsyncIterator[ControlPlaneApp]:
    async with build_control_plane(cp_settings(pki, tmp_path)) as app:
        yield app


@pytest.fixture
async def cp_once(pki: Pki, tmp_path: Path) -> AsyncIterator[ControlPlaneApp]:
    """A control-plane whose policy allows one migration per run."""
    policy = write_policy(tmp_path, "defaults: {migrations: 1}\n")
    async with build_control_plane(cp_settings(pki, tmp_path, policy_path=policy)) as app:
        yield app


@pytest.fixture
async def cp_never(pki: Pki, tmp_path: Path) -> AsyncIterator[ControlPlaneApp]:
    """A control-plane whose policy allows no migration."""
    policy = write_policy(tmp_path, "defaults: {migrations: 0}\n")
    async with build_control_plane(cp_settings(pki, tmp_path, policy_path=policy)) as app:
        yield app


async def _deltas(stream: RunStream, count: int) -> list[pb.RunEvent]:
    """The stream's events up to its ``count``-th delta."""
    events: list[pb.RunEvent] = []
    while kinds(events).count("delta") < count:
        events.append(await anext(stream))
    return events


async def _cut(edge: Connection, request: pb.RunRequest, processes: dict[str, Any], after: int) -> list[pb.RunEvent]:
    """Run ``request``, kill its node after ``after`` deltas, and read the rest: every event the requester saw."""
    stream = await edge.open_run(request)
    events = await _deltas(stream, after)
    processes[events[0].start.node_id].kill()
    return [*events, *await collect(stream)]


def _metric(app: ControlPlaneApp, name: str, **labels: str) -> float:
    return app.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_a_node_killed_mid_stream_is_continued_on_another_exactly(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    with node_processes(pki, tmp_path, listening_port(cp), "node-a", "node-b", routes=[PACED]) as processes:
        await all_ready(cp, "node-a", "node-b")
        edge = await client(cp, pki)
        whole = await collect(await edge.open_run(chat("paced", run_id="whole")))
        assert kinds(whole)[-1] == "complete"

        events = await _cut(edge, chat("paced", run_id="cut"), processes, after=5)
        one_stream(events)
        assert kinds(events)[-1] == "complete", events[-1]
        assert text(events) == text(whole)  # byte for byte: nothing repeated, nothing missing
        usage, expected = events[-1].complete.usage, whole[-1].complete.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (expected.prompt_tokens, expected.completion_tokens)
        delivered = next(n for n, event in enumerate(events) if event.WhichOneof("event") == "complete")
        assert usage.continuation_prompt_tokens >= 5 and usage.continuation_prompt_tokens < delivered
        assert _metric(cp, "iop_control_plane_migrations_total", outcome="continued") == 1
        assert _metric(cp, "iop_control_plane_migration_gap_seconds_count") == 1
        assert _metric(cp, "iop_control_plane_node_lost_runs_total") == 0

        run = await _ledger_run(cp, "cut")
        assert run.migrations == 1 and run.status == "completed"
        lost, continued = run.attempts
        assert (lost.outcome, lost.continued, continued.outcome, continued.continued) == (
            "node_lost",
            False,
            "completed",
            True,
        )
        assert lost.outputs + continued.outputs == run.outputs == 40 and lost.outputs >= 5
        assert continued.continuation_prompt_tokens == usage.continuation_prompt_tokens == lost.outputs
        assert continued.gap.ToTimedelta().total_seconds() > 0 and not lost.HasField("gap")
        await _runs_show(cp, pki, tmp_path, "cut", lost=lost.node_id, to=continued.node_id)


async def _ledger_run(app: ControlPlaneApp, run_id: str) -> pb.LedgerRun:
    """The run's ledger row, once the writer committed it."""
    found: list[pb.LedgerRun] = []

    async def written() -> bool:
        found[:] = (await app.sessions.store.runs(pb.RunsList(run_id=run_id))).runs
        return bool(found)

    for _ in range(100):  # the ledger is written in batches, off the relay's path
        if await written():
            return found[0]
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run_id!r} never reached the ledger")


async def _runs_show(app: ControlPlaneApp, pki: Pki, tmp_path: Path, run_id: str, *, lost: str, to: str) -> None:
    """`iop runs show RUN --control-plane`: each attempt with its outputs, whether it continued, its cost and gap."""
    certs = tmp_path / "admin" / "certs"
    certs.mkdir(parents=True)
    tls = pki.config("ops", Role.ADMIN)
    assert tls.cert and tls.key and tls.ca
    for source, name in ((tls.cert, "admin.crt"), (tls.key, "admin.key"), (tls.ca, "ca.crt")):
        shutil.copy(source, certs / name)
    where = ["--control-plane", f"127.0.0.1:{listening_port(app)}", "--dir", str(tmp_path / "admin")]
    for shown in ("--json", None):
        process = await asyncio.create_subprocess_exec(
            *IOP, "runs", "show", run_id, *where, *([shown] if shown else []), stdout=subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 0
        if shown:
            run = json.loads(out)
            assert run["migrations"] == 1
            first, second = run["attempts"]
            assert (first["node_id"], first["continued"], first["gap_ms"]) == (lost, False, None)
            assert (second["node_id"], second["continued"]) == (to, True) and second["gap_ms"] > 0
            assert second["continuation_prompt_tokens"] == first["outputs"] > 0
        else:
            lines = out.decode().splitlines()
            assert "migrations: 1" in lines
            assert any(line.startswith(f"  2. node_id={to}, ") and "continued=True" in line for line in lines)
    process = await asyncio.create_subprocess_exec(*IOP, "runs", "ls", *where, stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    header, *rows = (line.split() for line in out.decode().splitlines())
    (row,) = [row for row in rows if row[1] == run_id]
    assert (row[header.index("TRIES")], row[header.index("MOVED")]) == ("2", "1"), "the table shows the migration"


async def test_a_run_lost_again_past_the_migrations_limit_ends_node_lost_naming_it(
    cp_once: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    cp = cp_once
    with node_processes(pki, tmp_path, listening_port(cp), "node-a", "node-b", "node-c", routes=[PACED]) as processes:
        await all_ready(cp, "node-a", "node-b", "node-c")
        edge = await client(cp, pki)
        stream = await edge.open_run(chat("paced", run_id="twice"))
        events = await _deltas(stream, 3)
        first = events[0].start.node_id
        processes[first].kill()
        events += await _deltas(stream, 3)  # three more, from the node that continued it
        assert kinds(events).count("delta") == 6
        second = next(node for node in cp.registry.nodes.values() if node.models["paced"].placed).node_id
        assert second != first
        processes[second].kill()
        events += await collect(stream)
        one_stream(events)
        error = events[-1].error
        assert error.code == pb.ERROR_CODE_NODE_LOST and error.retryable
        assert "continued 1 time(s) already" in error.message and "migrations" in error.message
        assert _metric(cp, "iop_control_plane_migrations_total", outcome="continued") == 1
        assert _metric(cp, "iop_control_plane_migrations_total", outcome="limit") == 1
        assert _metric(cp, "iop_control_plane_node_lost_runs_total") == 1
        run = await _ledger_run(cp, "twice")
        assert [attempt.outcome for attempt in run.attempts] == ["node_lost", "node_lost"] and run.migrations == 1


async def test_with_no_migrations_allowed_a_cut_run_ends_node_lost(
    cp_never: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    cp = cp_never
    with node_processes(pki, tmp_path, listening_port(cp), "node-a", "node-b", routes=[PACED]) as processes:
        await all_ready(cp, "node-a", "node-b")
        events = await _cut(await client(cp, pki), chat("paced"), processes, after=2)
        one_stream(events)
        error = events[-1].error
        assert error.code == pb.ERROR_CODE_NODE_LOST and "migrations is 0" in error.message
        assert _metric(cp, "iop_control_plane_migrations_total", outcome="limit") == 1


async def test_a_run_no_node_can_continue_ends_node_lost_saying_why(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    with node_processes(pki, tmp_path, listening_port(cp), "node-a", "node-b", routes=[CLI]) as processes:
        await all_ready(cp, "node-a", "node-b")
        events = await _cut(await client(cp, pki), chat("paced"), processes, after=2)
        one_stream(events)
        error = events[-1].error
        assert error.code == pb.ERROR_CODE_NODE_LOST and error.retryable
        assert "can continue a run of its kind" in error.message, error.message
        assert _metric(cp, "iop_control_plane_migrations_total", outcome="no_node") == 1
        assert _metric(cp, "iop_control_plane_migrations_total", outcome="continued") == 0


async def test_a_node_that_refuses_the_continuation_is_not_the_runs_end(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    """node-b takes the prompt (11 characters) but not the prompt with the delivered text: its refusal
    (INVALID_ARGUMENT, before its own output) sends the run on, here to no other node: NODE_LOST
    naming the refusal, not an INVALID_ARGUMENT after half an answer."""
    with node_processes(pki, tmp_path, listening_port(cp), "node-a", routes=[PACED]) as processes:
        await all_ready(cp, "node-a")
        edge = await client(cp, pki)
        stream = await edge.open_run(chat("paced", run_id="refused", metadata={"mock.tokens": "400"}))
        events = await _deltas(stream, 5)
        with node_process(pki, tmp_path, listening_port(cp), "node-b", [PACED], max_prompt_chars=20):
            await all_ready(cp, "node-b")
            processes["node-a"].kill()
            events += await collect(stream)
    one_stream(events)
    error = events[-1].error
    assert error.code == pb.ERROR_CODE_NODE_LOST and error.retryable, events[-1]
    assert "node node-b refused to continue the run (INVALID_ARGUMENT: prompt of" in error.message, error.message
    assert "can continue a run of its kind" in error.message
    run = await _ledger_run(cp, "refused")
    assert [(a.node_id, a.outcome, a.continued, a.outputs) for a in run.attempts][1:] == [("node-b", "failed", True, 0)]
    assert run.attempts[0].outcome == "node_lost"


async def test_a_node_stopping_mid_stream_has_its_runs_continued(cp: ControlPlaneApp, pki: Pki, tmp_path: Path) -> None:
    """SIGTERM: the node drains, and past its grace ends its runs SHUTTING_DOWN over a connection still
    open; that cuts the run as a lost node does, and it is continued."""
    routes = [PACED]
    with node_processes(pki, tmp_path, listening_port(cp), "node-a", "node-b", routes=routes, shutdown_grace=0.2) as ps:
        await all_ready(cp, "node-a", "node-b")
        edge = await client(cp, pki)
        whole = await collect(await edge.open_run(chat("paced")))
        stream = await edge.open_run(chat("paced"))
        events = await _deltas(stream, 5)
        ps[events[0].start.node_id].send_signal(signal.SIGTERM)
        events += await collect(stream)
    one_stream(events)
    assert kinds(events)[-1] == "complete", events[-1]
    assert text(events) == text(whole)
    assert _metric(cp, "iop_control_plane_migrations_total", outcome="continued") == 1


async def test_a_continuation_from_a_peer_that_does_not_relay_runs_is_refused(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    with node_processes(pki, tmp_path, listening_port(cp), "node-a", routes=[PACED]):
        await all_ready(cp, "node-a")
        admin = await client(cp, pki, "ops", Role.ADMIN)
        request = chat("paced")
        request.continuation.text, request.continuation.completion_tokens = "a long text " * 100, 1
        events = await collect(await admin.open_run(request))
        error = events[-1].error
        assert (error.code, error.param) == (pb.ERROR_CODE_PERMISSION_DENIED, "continuation"), events
        assert kinds(events) == ["error"]
        assert (
            kinds(await collect(await admin.open_run(chat("paced", metadata={"mock.tokens": "2"}))))[-1] == "complete"
        )


async def test_a_run_arriving_with_a_continuation_goes_only_to_a_node_that_can_continue(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    with node_processes(pki, tmp_path, listening_port(cp), "node-mock", routes=[PACED]):
        await all_ready(cp, "node-mock")
        edge = await client(cp, pki)
        fast = {"mock.tokens_per_second": "0"}
        whole = text(await collect(await edge.open_run(chat("paced", metadata=fast))))
        head = whole.split(" ")[:7]
        with node_processes(pki, tmp_path, listening_port(cp), "node-cli", routes=[CLI]):
            await all_ready(cp, "node-cli")
            await _continued_only_on(edge, "node-mock", " ".join(head) + " ", whole)


async def _continued_only_on(edge: Connection, node_id: str, delivered: str, whole: str) -> None:
    """Runs sent with ``delivered`` as their continuation go to ``node_id`` alone, and end as ``whole`` does."""
    nodes = set()
    for _ in range(4):  # least-loaded alone would put some on the idle cli node
        request = chat("paced", metadata={"mock.tokens_per_second": "0"})
        request.continuation.text, request.continuation.completion_tokens = delivered, len(delivered.split())
        events = await collect(await edge.open_run(request))
        assert kinds(events)[-1] == "complete", events[-1]
        nodes.add(events[0].start.node_id)
        assert delivered + text(events) == whole
        assert events[-1].complete.usage.completion_tokens == 40
    assert nodes == {node_id}


async def test_a_frozen_node_is_detected_and_its_run_continued(cp: ControlPlaneApp, pki: Pki, tmp_path: Path) -> None:
    with node_processes(pki, tmp_path, listening_port(cp), "node-a", "node-b", routes=[PACED]) as processes:
        await all_ready(cp, "node-a", "node-b")
        edge = await client(cp, pki)
        whole = await collect(await edge.open_run(chat("paced")))
        stream = await edge.open_run(chat("paced"))
        events = await _deltas(stream, 4)
        frozen = processes[events[0].start.node_id]
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            events += await collect(stream)
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        one_stream(events)
        assert kinds(events)[-1] == "complete" and text(events) == text(whole)
        await assert_eventually(lambda: _metric(cp, "iop_control_plane_migrations_total", outcome="continued") == 1)


@asynccontextmanager
async def _one_slot_each(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> AsyncIterator[tuple[dict[str, subprocess.Popen[bytes]], Connection]]:
    """node-a and node-b serving ``paced`` one run at a time, and an edge's connection."""
    one_at_a_time = [{**PACED, "max_concurrency": 1}]
    with node_processes(pki, tmp_path, listening_port(cp), "node-a", "node-b", routes=one_at_a_time) as processes:
        await all_ready(cp, "node-a", "node-b")
        yield processes, await client(cp, pki)


async def _cut_with_the_other_slot_taken(
    edge: Connection, request: pb.RunRequest, processes: dict[str, Any], *, seconds: int
) -> tuple[RunStream, list[pb.RunEvent], RunStream]:
    """Of two nodes with one slot each: ``request`` on one, cut after a delta once a run of ``seconds`` holds the
    other's slot: (its stream, its events so far, the other run's stream past its start)."""
    cut = await edge.open_run(request)
    events = await _deltas(cut, 1)
    other = await edge.open_run(chat("paced", metadata={"mock.tokens": str(seconds * 20)}))  # 20 tokens/s
    assert (await anext(other)).start.node_id != events[0].start.node_id
    processes[events[0].start.node_id].kill()
    return cut, events, other


async def test_a_cut_run_waits_in_the_queue_for_a_node_that_can_continue_it(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    async with _one_slot_each(cp, pki, tmp_path) as (processes, edge):
        whole = await collect(await edge.open_run(chat("paced")))
        cut, events, other = await _cut_with_the_other_slot_taken(edge, chat("paced"), processes, seconds=1)
        ended: list[float] = []

        async def finish_other() -> None:
            assert kinds(await collect(other))[-1] == "complete"
            ended.append(time.monotonic())

        finishing = asyncio.create_task(finish_other())
        events.append(await anext(cut))
        while events[-1].WhichOneof("event") != "delta":
            events.append(await anext(cut))
        continued_at = time.monotonic()
        events += await collect(cut)
        await finishing
        one_stream(events)
        assert kinds(events)[-1] == "complete" and text(events) == text(whole)
        assert ended[0] <= continued_at  # it went on only once the other run freed the slot
        assert _metric(cp, "iop_control_plane_queue_wait_seconds_count", outcome="admitted") >= 1
        assert _metric(cp, "iop_control_plane_migrations_total", outcome="continued") == 1


async def test_a_cut_run_whose_deadline_passes_in_the_queue_ends_node_lost_saying_so(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    async with _one_slot_each(cp, pki, tmp_path) as (processes, edge):
        request = chat("paced", run_id="late")
        request.deadline.FromNanoseconds(time.time_ns() + 2_500_000_000)
        cut, events, other = await _cut_with_the_other_slot_taken(edge, request, processes, seconds=10)
        events += await collect(cut)
        await other.cancel("enough")
        one_stream(events)
        error = events[-1].error
        assert error.code == pb.ERROR_CODE_NODE_LOST and "not continued: no slot for 'paced' within" in error.message
        assert _metric(cp, "iop_control_plane_migrations_total", outcome="deadline") == 1
