"""Failover's bounds, with nodes that refuse every run retryably: a run is tried on at most its
attempts' worth of nodes, and never twice on one node, whatever its priority."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from conftest import Pki
from cp_helpers import BusyNode, all_ready, client, cp_settings
from node_helpers import chat, collect, kinds

from iop_control_plane.admin import PolicyInForce
from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_gen.pb.iop import runtime_pb2 as pb


async def _refused_everywhere(app: ControlPlaneApp, pki: Pki, count: int, request: pb.RunRequest) -> list[BusyNode]:
    """Register ``count`` busy nodes, send ``request`` once; the nodes, each with the runs it was sent."""
    nodes = [BusyNode(f"busy-{index}") for index in range(count)]
    connections = [await node.register(app, pki) for node in nodes]
    await all_ready(app, *(node.node_id for node in nodes))
    edge = await client(app, pki)
    events = await asyncio.wait_for(collect(await edge.open_run(request)), 10)
    assert kinds(events) == ["error"] and events[0].error.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED
    assert events[0].error.message == "full"  # the last attempt's failure, relayed as the node said it
    for connection in (edge, *connections):
        await connection.close()
    return nodes


def _attempts(nodes: list[BusyNode]) -> list[str]:
    """The attempt numbers the nodes saw (``<connection>.<run>.<attempt>``), in order."""
    return sorted(run_id.rsplit(".", 1)[1] for node in nodes for run_id in node.runs)


@pytest.mark.parametrize(("policy", "attempts"), [("", 3), ("defaults: {attempts: 2}\n", 2)])
async def test_a_run_refused_everywhere_is_tried_on_its_attempts_nodes_only(
    pki: Pki, tmp_path: Path, policy: str, attempts: int
) -> None:
    async with build_control_plane(cp_settings(pki, tmp_path), policy=PolicyInForce(policy)) as app:
        nodes = await _refused_everywhere(app, pki, 5, chat())
        assert _attempts(nodes) == [str(number) for number in range(1, attempts + 1)]
        assert all(len(node.runs) <= 1 for node in nodes)
        failovers = app.metrics.registry.get_sample_value(
            "iop_control_plane_failovers_total", {"reason": "RESOURCE_EXHAUSTED"}
        )
        assert failovers == attempts


@pytest.mark.parametrize("priority", [-1, 0], ids=["background", "interactive"])
async def test_a_failover_never_returns_to_a_node_it_tried(pki: Pki, tmp_path: Path, priority: int) -> None:
    async with build_control_plane(cp_settings(pki, tmp_path, attempts=3)) as app:
        nodes = await _refused_everywhere(app, pki, 2, chat(priority=priority))
        assert Counter(len(node.runs) for node in nodes) == {1: 2}  # each node once; no third attempt
