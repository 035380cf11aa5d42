"""Idle nodes on the control-plane: heartbeats alone keep a node ready and its heartbeat age fresh."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from conftest import Pki
from cp_helpers import BusyNode, all_ready, client, cp_settings

from iop_control_plane.bootstrap import build_control_plane
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.tls import Role


async def test_a_node_sending_only_heartbeats_is_listed_ready_and_recently_heard(pki: Pki, tmp_path: Path) -> None:
    async with build_control_plane(cp_settings(pki, tmp_path)) as app:
        node = await BusyNode("node-quiet").register(app, pki)  # registers, then sends no node.status at all
        await all_ready(app, "node-quiet")
        await asyncio.sleep(4 * 0.5)  # 4 heartbeat intervals with nothing but heartbeats from the node
        admin = await client(app, pki, "ops", Role.ADMIN)
        (listed,) = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed.nodes
        assert listed.state == pb.NODE_STATE_READY
        age = time.time() - listed.last_heartbeat.ToNanoseconds() / 1e9
        assert age < 2 * 0.5, age  # its last heartbeat, not its registration 2 s ago
        await admin.close()
        await node.close()
