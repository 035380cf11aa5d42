"""A node lost in the middle of a streamed tool call: the control-plane does not continue the run on
another node (a Continuation carries text, and a call's fragments are not text), it ends the run
NODE_LOST saying why. Real `iop node` processes (mock adapter, paced) registered over mTLS with an
in-process control-plane; the node carrying the run is killed (SIGKILL) mid-call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Pki
from cp_helpers import all_ready, client, cp_settings, listening_port, node_processes, one_stream
from node_helpers import chat, collect, kinds

from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_gen.pb.iop import runtime_pb2 as pb

PACED: dict[str, Any] = {"model": "paced", "adapter": "mock", "options": {"tokens": 40, "tokens_per_second": 20}}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "write_story",
            "parameters": {"type": "object", "properties": {"story": {"type": "string", "minLength": 300}}},
        },
    }
]


@pytest.fixture
async def cp(pki: Pki, tmp_path: Path) -> AsyncIterator[ControlPlaneApp]:
    async with build_control_plane(cp_settings(pki, tmp_path)) as app:
        yield app


def _metric(app: ControlPlaneApp, name: str, **labels: str) -> float:
    return app.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_a_node_lost_mid_tool_call_ends_the_run_node_lost_without_continuing_it(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    with node_processes(pki, tmp_path, listening_port(cp), "node-a", "node-b", routes=[PACED]) as processes:
        await all_ready(cp, "node-a", "node-b")
        edge = await client(cp, pki)
        request = chat("paced", run_id="calling")
        request.openai_fields.update({"tools": TOOLS})
        stream = await edge.open_run(request)
        events: list[pb.RunEvent] = []
        async with asyncio.timeout(30):
            while kinds(events).count("delta") < 4:  # the call's id and name, then three fragments of arguments
                events.append(await anext(stream))
            processes[events[0].start.node_id].kill()
            events += await collect(stream)
    one_stream(events)
    assert kinds(events)[-1] == "error" and set(kinds(events)[1:-1]) == {"delta"}
    calls = [call for event in events if event.HasField("delta") for call in event.delta.tool_calls]
    assert calls[0].function_name == "write_story" and all(not event.delta.text for event in events[1:-1])
    error = events[-1].error
    assert error.code == pb.ERROR_CODE_NODE_LOST and error.retryable, "the client sends the run again"
    assert "was not continued: tool calls are not continued" in error.message, error.message
    assert _metric(cp, "iop_control_plane_migrations_total", outcome="not_continuable") == 1
    assert _metric(cp, "iop_control_plane_migrations_total", outcome="continued") == 0
    assert _metric(cp, "iop_control_plane_node_lost_runs_total") == 1
    run = await _ledger_run(cp, "calling")
    assert [attempt.outcome for attempt in run.attempts] == ["node_lost"] and run.migrations == 0, "one attempt"


async def _ledger_run(app: ControlPlaneApp, run_id: str) -> pb.LedgerRun:
    """The run's ledger row, once the writer committed it (in batches, off the relay's path)."""
    for _ in range(100):
        found = (await app.sessions.store.runs(pb.RunsList(run_id=run_id))).runs
        if found:
            return found[0]
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run_id!r} never reached the ledger")
