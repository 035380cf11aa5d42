"""A run its requester cancels is recorded with what its node counted it used (issue 24): the control-plane
waits, off the requester's path and up to ``ledger.cancel_usage_wait``, for the node's end of the run;
past it (a frozen node) the ledger keeps the control-plane's estimate, and at most
``ledger.cancel_usage_waits`` runs wait at once."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest
from conftest import Pki, assert_eventually
from cp_helpers import BusyNode, all_ready, client, cp_settings, listening_port, node_processes
from node_helpers import chat, collect, kinds

from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_control_plane.settings import load_settings
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import Connection, RunStream
from iop_wire.errors import IopError
from iop_wire.runs import EventSink
from iop_wire.settings import ConfigError
from iop_wire.tls import Role


async def _cancel_after(stream: RunStream, deltas: int) -> None:
    """Read the run's start and ``deltas`` deltas, then cancel it: the requester sees its end at once."""
    assert kinds([await anext(stream) for _ in range(deltas + 1)]) == ["start"] + ["delta"] * deltas
    await stream.cancel("enough")
    assert kinds(await collect(stream))[-1] == "error"


async def _ledger_run(asker: Connection, run_id: str) -> pb.LedgerRun:
    """The run's ledger row once the writer committed it (every 20 ms, or once its node's count came)."""
    deadline = time.monotonic() + 10.0
    while True:
        listed = (await asker.request(pb.Envelope(runs_list=pb.RunsList(run_id=run_id)))).runs_listed
        if listed.runs:
            return listed.runs[0]
        assert time.monotonic() < deadline, f"run {run_id} not in the ledger within 10 s"
        await asyncio.sleep(0.02)


def _node_record(path: Path, run_id: str) -> tuple[str, int, int, bool] | None:
    """The node's own record of the run (status, prompt, completion, estimated) once it ended, from its run store."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        row = db.execute(
            "SELECT status, prompt_tokens, completion_tokens, usage_estimated FROM runs WHERE run_id LIKE ?",
            (f"%.{run_id}.1",),
        ).fetchone()
    return None if row is None or row[0] == "running" else (row[0], row[1], row[2], bool(row[3]))


def _counted(app: ControlPlaneApp, outcome: str) -> float:
    value = app.metrics.registry.get_sample_value("iop_control_plane_cancelled_usage_total", {"outcome": outcome})
    return value or 0.0


async def test_a_cancelled_run_is_recorded_with_its_nodes_count(pki: Pki, tmp_path: Path) -> None:
    async with build_control_plane(cp_settings(pki, tmp_path)) as cp:
        with node_processes(pki, tmp_path, listening_port(cp), "node-a"):
            await all_ready(cp, "node-a")
            edge = await client(cp, pki)
            request = chat(model="mock-slow", text="a b c d e f g h", caller=pb.Caller(id="team-c"))
            await _cancel_after(await edge.open_run(request), 3)

            run = await _ledger_run(edge, request.run_id)
            node = await _node_record_when_ended(tmp_path / "node-a.db", request.run_id)
            assert (run.status, node[0]) == ("cancelled", "cancelled")
            # The node's count, exact: the mock counts the prompt before its output (a word a token: 9
            # in "user: a b c d e f g h") and each delta it streamed is a token. Not the control-plane's
            # estimate (4 prompt tokens for its 15 characters, one per delta relayed) nor the node's
            # from the text (6).
            usage = run.usage
            assert (usage.prompt_tokens, usage.completion_tokens, usage.estimated) == node[1:]
            assert (usage.prompt_tokens, usage.estimated) == (9, False)
            assert usage.completion_tokens >= run.outputs >= 3
            assert (_counted(cp, "counted"), _counted(cp, "timeout")) == (1, 0)

            usage_listed = (await edge.request(pb.Envelope(usage_list=pb.UsageList(caller="team-c")))).usage_listed
            (entry,) = usage_listed.entries
            assert (entry.prompt_tokens, entry.completion_tokens, entry.requests) == (*node[1:3], 1)


async def _node_record_when_ended(path: Path, run_id: str) -> tuple[str, int, int, bool]:
    deadline = time.monotonic() + 5.0
    while (record := _node_record(path, run_id)) is None:
        assert time.monotonic() < deadline, f"the node did not record the end of {run_id} within 5 s"
        await asyncio.sleep(0.02)
    return record


async def test_a_frozen_node_leaves_a_cancelled_run_estimated_past_the_wait(pki: Pki, tmp_path: Path) -> None:
    settings = cp_settings(pki, tmp_path, ledger={"cancel_usage_wait": 0.3})
    async with build_control_plane(settings) as cp:
        with node_processes(pki, tmp_path, listening_port(cp), "node-a") as nodes:
            await all_ready(cp, "node-a")
            edge = await client(cp, pki)
            request = chat(model="mock-slow")
            stream = await edge.open_run(request)
            assert kinds([await anext(stream) for _ in range(4)]) == ["start", "delta", "delta", "delta"]
            os.kill(nodes["node-a"].pid, signal.SIGSTOP)  # alive to TCP, answers nothing (killed on the way out)
            await stream.cancel("enough")
            assert kinds(await collect(stream))[-1] == "error"  # the requester is answered at once all the same

            run = await _ledger_run(edge, request.run_id)
            usage = run.usage
            assert run.status == "cancelled" and usage.estimated
            assert (usage.prompt_tokens, usage.completion_tokens) == (3, run.outputs)  # the control-plane's estimate
            assert (_counted(cp, "timeout"), _counted(cp, "counted")) == (1, 0)


class _HeldNode(BusyNode):
    """A node written with the wire API that streams one delta, then answers a cancel only once ``release`` is set,
    with the usage it says the run used."""

    def __init__(self, node_id: str, *, completes: bool = False) -> None:
        super().__init__(node_id)
        self.release = asyncio.Event()
        self.cancelled = 0
        self.completes = completes
        """Answer the cancel with a complete: a run that finished as the cancel came."""

    async def run(self, request: pb.RunRequest, sink: EventSink) -> None:
        self.runs.append(request.run_id)
        await sink.start(node_id=self.node_id, model=request.model, adapter="fake")
        await sink.delta("one ")
        try:
            await asyncio.Event().wait()  # until cancelled
        except asyncio.CancelledError:
            self.cancelled += 1
            await self.release.wait()
            used = pb.Usage(prompt_tokens=7, completion_tokens=9)
            if self.completes:
                await sink.complete(pb.FINISH_REASON_STOP, used)
            else:
                await sink.error(IopError(pb.ERROR_CODE_CANCELLED, "cancelled", usage=used))


async def test_waits_for_counts_are_bounded_and_the_rest_are_estimated(pki: Pki, tmp_path: Path) -> None:
    settings = cp_settings(pki, tmp_path, ledger={"cancel_usage_wait": 30, "cancel_usage_waits": 1})
    async with build_control_plane(settings) as cp:
        node = _HeldNode("node-a")
        await node.register(cp, pki)
        await all_ready(cp, "node-a")
        edge = await client(cp, pki)
        first, second = chat(), chat()
        first_stream, second_stream = await edge.open_run(first), await edge.open_run(second)
        await _cancel_after(first_stream, 1)
        await assert_eventually(lambda: cp.runs.cancelled.waiting == 1 and node.cancelled == 1)
        await _cancel_after(second_stream, 1)  # one wait in progress already: recorded at once, estimated

        skipped = await _ledger_run(edge, second.run_id)
        assert skipped.usage.estimated and skipped.usage.completion_tokens == skipped.outputs == 1
        assert (_counted(cp, "skipped"), _counted(cp, "counted"), cp.runs.cancelled.waiting) == (1, 0, 1)
        gauge = cp.metrics.registry.get_sample_value("iop_control_plane_cancelled_usage_waiting")
        assert gauge == 1

        node.release.set()
        counted = await _ledger_run(edge, first.run_id)
        usage = counted.usage
        assert (counted.status, usage.prompt_tokens, usage.completion_tokens, usage.estimated) == (
            "cancelled", 7, 9, False
        )  # fmt: skip
        assert (_counted(cp, "counted"), cp.runs.cancelled.waiting) == (1, 0)


async def test_a_run_that_completed_as_it_was_cancelled_is_recorded_cancelled_with_its_usage(
    pki: Pki, tmp_path: Path
) -> None:
    async with build_control_plane(cp_settings(pki, tmp_path)) as cp:
        node = _HeldNode("node-a", completes=True)
        node.release.set()
        await node.register(cp, pki)
        await all_ready(cp, "node-a")
        edge = await client(cp, pki)
        request = chat()
        await _cancel_after(await edge.open_run(request), 1)
        run = await _ledger_run(edge, request.run_id)
        usage = run.usage
        assert (run.status, usage.prompt_tokens, usage.completion_tokens, usage.estimated) == ("cancelled", 7, 9, False)
        assert _counted(cp, "counted") == 1


async def test_a_control_plane_that_stops_records_the_waiting_runs_with_the_estimate(pki: Pki, tmp_path: Path) -> None:
    settings = cp_settings(pki, tmp_path, ledger={"cancel_usage_wait": 30})
    async with build_control_plane(settings) as cp:
        node = _HeldNode("node-a")
        await node.register(cp, pki)
        await all_ready(cp, "node-a")
        edge = await client(cp, pki, "ops", Role.ADMIN)
        request = chat()
        await _cancel_after(await edge.open_run(request), 1)
        await assert_eventually(lambda: cp.runs.cancelled.waiting == 1)
    # Its node's connection closed with the listener (uncounted), else the wait was cut as the control-plane stopped.
    assert _counted(cp, "uncounted") + _counted(cp, "stopped") == 1
    with sqlite3.connect(tmp_path / "cp.db") as db:
        row = db.execute(
            "SELECT status, completion_tokens, usage_estimated FROM runs WHERE run_id = ?", (request.run_id,)
        ).fetchone()
    assert row == ("cancelled", 1, 1)


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("{cancel_usage_wait: -1}", "ledger.cancel_usage_wait"),
        ("{cancel_usage_wait: 61}", "ledger.cancel_usage_wait"),
        ("{cancel_usage_waits: -1}", "ledger.cancel_usage_waits"),
        ("{cancel_usage_waits: many}", "ledger.cancel_usage_waits"),
        ("{wait: 2}", "ledger.wait"),
    ],
)
def test_bad_ledger_settings_are_one_line_naming_the_key(tmp_path: Path, section: str, key: str) -> None:
    path = tmp_path / "cp.yaml"
    path.write_text(f"ledger: {section}\n")
    with pytest.raises(ConfigError) as raised:
        load_settings(path)
    message = str(raised.value).strip()
    assert "\n" not in message and message.startswith(key), message
