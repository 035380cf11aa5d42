"""A node given several control-planes (``control_plane.addresses``): it registers with each and
reports its load to each; two control-planes placing runs on one node never overfill it: the
node's admission refuses (RESOURCE_EXHAUSTED, retryable) and the refusing run's control-plane
relays it to another node."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from conftest import Pki, assert_eventually
from cp_helpers import all_ready, client, cp_settings
from node_helpers import chat, collect, kinds, node_settings

from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_node.bootstrap import NodeApp, build_node
from iop_wire.tls import Role

ONE_SLOT: list[dict[str, Any]] = [
    {
        "model": "mock-slow",
        "adapter": "mock",
        "max_concurrency": 1,
        "queue_size": 0,
        "options": {"tokens": 20, "tokens_per_second": 40},
    }
]


@asynccontextmanager
async def _platform(
    pki: Pki, tmp_path: Path, *node_ids: str
) -> AsyncIterator[tuple[list[ControlPlaneApp], list[NodeApp]]]:
    """Two control-planes, and nodes registered with both (no listener of their own)."""
    async with AsyncExitStack() as stack:
        cps = []
        for name in ("cp-a", "cp-b"):
            folder = tmp_path / name
            folder.mkdir()
            cps.append(await stack.enter_async_context(build_control_plane(cp_settings(pki, folder))))
        addresses = [f"127.0.0.1:{cp.listener.port}" for cp in cps if cp.listener is not None]
        nodes = []
        for node_id in node_ids:
            control_plane = {"addresses": addresses, "server_name": "localhost", "reconnect_initial": 0.05}
            tls = pki.config(node_id, Role.NODE)  # a node registers under its certificate's name
            settings = node_settings(
                pki,
                tmp_path,
                ONE_SLOT,
                listen={"enabled": False},
                control_plane=control_plane,
                store_path=tmp_path / f"{node_id}.db",
                node_id=node_id,
                tls={"enabled": True, "cert": tls.cert, "key": tls.key, "ca": tls.ca},
            )
            node = build_node(settings)
            await node.start()
            stack.push_async_callback(node.stop, 0)
            nodes.append(node)
        for cp in cps:
            await all_ready(cp, *node_ids)
        yield cps, nodes


async def test_a_node_registers_with_every_control_plane_and_reports_its_load_to_each(pki: Pki, tmp_path: Path) -> None:
    async with _platform(pki, tmp_path, "node-1") as (cps, (node,)):
        assert len(node.registrations) == 2
        # Ready on the control-planes once they took node.register; the node counts it once node.registered is back.
        await assert_eventually(lambda: all(r.registrations == 1 for r in node.registrations))
        edge = await client(cps[0], pki)
        stream = await edge.open_run(chat("mock-slow"))
        assert (await anext(stream)).HasField("start")
        for cp in cps:  # both know the node is full, though only cp-a placed the run
            await assert_eventually(lambda cp=cp: cp.registry.nodes["node-1"].models["mock-slow"].in_flight == 1)
        await collect(stream)
        await edge.close()


async def test_two_control_planes_filling_one_node_send_the_refused_run_elsewhere(pki: Pki, tmp_path: Path) -> None:
    async with _platform(pki, tmp_path, "node-1", "node-2") as (cps, _):
        edges = [await client(cp, pki) for cp in cps]
        refused = 0.0
        for _ in range(10):  # both control-planes place at once, before either hears of the other's run
            streams = await asyncio.gather(*(edge.open_run(chat("mock-slow")) for edge in edges))
            results = await asyncio.wait_for(asyncio.gather(*(collect(stream) for stream in streams)), 10)
            assert all(kinds(events)[-1] == "complete" for events in results), results
            ran_on = sorted(events[0].start.node_id for events in results)
            assert ran_on == ["node-1", "node-2"], "one run per node: neither was overfilled"
            refused = sum(
                cp.metrics.registry.get_sample_value(
                    "iop_control_plane_failovers_total", {"reason": "RESOURCE_EXHAUSTED"}
                )
                or 0.0
                for cp in cps
            )
            if refused:
                break
        assert refused, "no round had both control-planes choose one node: the refusal path was not exercised"
        for edge in edges:
            await edge.close()
