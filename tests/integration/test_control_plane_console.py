"""What the console reads from the control-plane (issue 24), with a real `iop node` process over mTLS:
usage.list, overview.show and runs.list by caller, and who may ask them (edge and worker certificates
read; operations stay an admin's)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from conftest import Pki
from cp_helpers import all_ready, client, cp_settings, listening_port, node_processes
from node_helpers import chat, collect, kinds

from iop_control_plane.bootstrap import build_control_plane
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import Connection
from iop_wire.errors import IopError
from iop_wire.tls import Role


async def _usage(asker: Connection, **fields: object) -> pb.UsageListed:
    return (await asker.request(pb.Envelope(usage_list=pb.UsageList(**fields)))).usage_listed  # type: ignore[arg-type]


async def _recorded(asker: Connection, runs: int, **fields: object) -> pb.UsageListed:
    """usage.list once it counts ``runs`` runs (the ledger's writer commits every 20 ms)."""
    deadline = time.monotonic() + 5.0
    while True:
        listed = await _usage(asker, **fields)
        if sum(entry.requests for entry in listed.entries) == runs:
            return listed
        assert time.monotonic() < deadline, f"usage.list did not count {runs} runs within 5 s: {listed}"
        await asyncio.sleep(0.02)


async def test_an_edge_reads_usage_overview_runs_and_nodes_but_may_not_operate(pki: Pki, tmp_path: Path) -> None:
    async with build_control_plane(cp_settings(pki, tmp_path)) as cp:
        with node_processes(pki, tmp_path, listening_port(cp), "node-a"):
            await all_ready(cp, "node-a")
            edge = await client(cp, pki)
            done = await collect(await edge.open_run(chat(caller=pb.Caller(id="team-a"))))
            failed = await collect(
                await edge.open_run(chat(caller=pb.Caller(id="team-b"), metadata={"mock.fail_after": "2"}))
            )
            assert kinds(done)[-1] == "complete" and kinds(failed)[-1] == "error"
            usage = done[-1].complete.usage
            assert failed[-1].error.usage.completion_tokens > 0  # the node counts what a failed run streamed
            slow = await edge.open_run(chat(model="mock-slow", caller=pb.Caller(id="team-c")))
            assert [kinds([await anext(slow)]) for _ in range(3)] == [["start"], ["delta"], ["delta"]]
            await slow.cancel("enough")
            assert kinds(await collect(slow))[-1] == "error"

            entries = (await _recorded(edge, 3, by_caller=True, by_model=True)).entries
            team_a, team_b, team_c = entries
            assert (team_a.caller, team_a.model, team_a.failed) == ("team-a", "mock-small", 0)
            assert (team_a.prompt_tokens, team_a.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)
            # Failed: the mock counted its prompt before its output and each delta is a token: exact.
            assert (team_b.caller, team_b.requests, team_b.failed, team_b.estimated) == ("team-b", 1, 1, 0)
            assert (team_b.prompt_tokens, team_b.completion_tokens) == (
                failed[-1].error.usage.prompt_tokens,
                failed[-1].error.usage.completion_tokens,
            )
            assert (team_b.prompt_tokens, team_b.completion_tokens) == (3, 2)  # "user: hello there"; fail_after 2
            # Cancelled by its requester: recorded with the node's count once its end of the run comes
            # (test_control_plane_cancel_usage.py), exact as the failed run's.
            assert (team_c.caller, team_c.requests, team_c.failed, team_c.estimated) == ("team-c", 1, 1, 0)
            assert team_c.prompt_tokens == team_b.prompt_tokens and team_c.completion_tokens >= 2
            assert team_a.start.seconds % 3600 == 0

            shown = (await edge.request(pb.Envelope(overview_show=pb.OverviewShow()))).overview_shown
            assert (shown.window_seconds, shown.requests, shown.failed, shown.control_plane) == (60, 3, 1, "cp")
            assert shown.completion_tokens >= usage.completion_tokens and shown.HasField("ttft_p50")
            assert [(m.model, m.requests, m.failed) for m in shown.models] == [
                ("mock-slow", 1, 0),
                ("mock-small", 2, 1),
            ]

            mine = (await edge.request(pb.Envelope(runs_list=pb.RunsList(caller="team-a")))).runs_listed
            assert [run.caller for run in mine.runs] == ["team-a"]
            nodes = (await edge.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
            assert [node.node_id for node in nodes.nodes] == ["node-a"]

            worker = await client(cp, pki, "worker-1", Role.WORKER)
            assert len((await _usage(worker)).entries) == 1  # one hour, summed

            for operation in (
                pb.Envelope(nodes_drain=pb.NodesDrain(node_id="node-a")),
                pb.Envelope(policy_apply=pb.PolicyApply(yaml="{}")),
                pb.Envelope(nodes_remove=pb.NodesRemove(node_id="node-a")),
            ):
                with pytest.raises(IopError) as denied:
                    await edge.request(operation)
                assert denied.value.code == pb.ERROR_CODE_PERMISSION_DENIED
            assert "node-a" not in cp.sessions.drained


async def test_bad_usage_and_overview_requests_are_invalid_argument(pki: Pki, tmp_path: Path) -> None:
    async with build_control_plane(cp_settings(pki, tmp_path)) as cp:
        admin = await client(cp, pki, "ops", Role.ADMIN)
        backwards = pb.UsageList()
        backwards.start.seconds, backwards.end.seconds = 2_000, 1_000
        with pytest.raises(IopError) as window:
            await admin.request(pb.Envelope(usage_list=backwards))
        assert window.value.code == pb.ERROR_CODE_INVALID_ARGUMENT and "must be before end" in window.value.message
        years = pb.UsageList(bucket=pb.USAGE_BUCKET_DAY)
        years.start.seconds, years.end.seconds = 0, 2 * 365 * 86_400
        with pytest.raises(IopError) as too_wide:
            await admin.request(pb.Envelope(usage_list=years))
        assert too_wide.value.code == pb.ERROR_CODE_INVALID_ARGUMENT and too_wide.value.message.startswith("start (0)")
        with pytest.raises(IopError) as too_long:
            await admin.request(pb.Envelope(overview_show=pb.OverviewShow(window_seconds=3601)))
        assert too_long.value.code == pb.ERROR_CODE_INVALID_ARGUMENT and "3600" in too_long.value.message
        shown = (await admin.request(pb.Envelope(overview_show=pb.OverviewShow(window_seconds=3600)))).overview_shown
        assert (shown.window_seconds, shown.requests, shown.HasField("ttft_p50")) == (3600, 0, False)


async def test_runs_naming_models_no_node_serves_are_counted_under_one_unknown_model(pki: Pki, tmp_path: Path) -> None:
    """Any key may name thousands of models that do not exist: the rollup and the overview count them as one
    ``(unknown)`` model (else each would be a row for ever, until usage.list is over its cap for everyone);
    the ledger keeps the name each run asked for, clipped."""
    async with build_control_plane(cp_settings(pki, tmp_path)) as cp:
        edge = await client(cp, pki)
        for n in range(500):
            events = await collect(await edge.open_run(chat(model=f"bogus-{n}", caller=pb.Caller(id="team-x"))))
            assert events[-1].error.code == pb.ERROR_CODE_MODEL_NOT_FOUND
        long = "x" * 300  # over NAME_CHARS: refused INVALID_ARGUMENT, counted under (unknown) too
        assert (await collect(await edge.open_run(chat(model=long, caller=pb.Caller(id="team-x")))))[-1].error.code == (
            pb.ERROR_CODE_INVALID_ARGUMENT
        )
        entries = (await _recorded(edge, 501, by_caller=True, by_model=True)).entries
        assert [(e.caller, e.model, e.requests, e.failed) for e in entries] == [("team-x", "(unknown)", 501, 501)]
        by_day = (await _usage(edge, bucket=pb.USAGE_BUCKET_DAY, by_model=True)).entries
        assert [(e.model, e.requests) for e in by_day] == [("(unknown)", 501)]

        shown = (await edge.request(pb.Envelope(overview_show=pb.OverviewShow()))).overview_shown
        assert [(m.model, m.requests, m.failed) for m in shown.models] == [("(unknown)", 501, 501)]
        one = (await edge.request(pb.Envelope(runs_list=pb.RunsList(model="bogus-7")))).runs_listed
        assert [(run.model, run.status) for run in one.runs] == [("bogus-7", "failed")]
        clipped = (await edge.request(pb.Envelope(runs_list=pb.RunsList(limit=1)))).runs_listed.runs[0].model
        assert clipped.startswith("x" * 256) and len(clipped) < 300
