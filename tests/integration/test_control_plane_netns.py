"""A node in its own network namespace whose link is cut under it: no FIN, no RST, just silence.

The control-plane listens on the host end of a veth pair; ``node-ns`` runs inside the namespace
and dials it there; ``node-b`` is an ordinary local node dialing the same address. Setting the
host end of the pair down cuts the link without closing any socket. Needs root (CAP_NET_ADMIN);
skipped otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import Pki, assert_eventually
from cp_helpers import IOP, all_ready, cp_settings, node_config, sequences
from node_helpers import chat, collect, kinds, text

from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_control_plane.registry import NodeState
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection, ConnectionConfig
from iop_wire.endpoint import dial
from iop_wire.runs import RunStream
from iop_wire.tls import Role

INTERVAL = 0.5
SILENT = 3 * INTERVAL + 1.0  # 3 intervals, plus the watchdog's tick
_serial = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Netns:
    """A namespace joined to the host by a veth pair: ``host_address`` here, ``ns_address`` there."""

    name: str
    host_veth: str
    ns_veth: str
    host_address: str
    ns_address: str

    def cut(self) -> None:
        """Take the host end down: packets stop, sockets stay open on both sides."""
        _ip("link", "set", self.host_veth, "down")

    def heal(self) -> None:
        _ip("link", "set", self.host_veth, "up")


@pytest.fixture
def netns() -> Iterator[Netns]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN)")
    serial = next(_serial)
    tag = f"iop{os.getpid() % 100000}{serial}"  # interface names: at most 15 characters
    spread = (os.getpid() * 64 + serial) % 8000  # a /24 of its own among 8000, per process and test
    subnet = f"10.{200 + spread // 250}.{spread % 250 + 1}"
    space = Netns(tag, f"{tag}h", f"{tag}n", f"{subnet}.1", f"{subnet}.2")
    try:
        _ip("netns", "add", space.name)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr.decode().strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        pytest.skip(f"`ip netns add` failed (no CAP_NET_ADMIN?): {detail}")
    try:
        _ip("link", "add", space.host_veth, "type", "veth", "peer", "name", space.ns_veth)
        _ip("link", "set", space.ns_veth, "netns", space.name)
        _ip("addr", "add", f"{space.host_address}/24", "dev", space.host_veth)
        _ip("link", "set", space.host_veth, "up")
        inside = ("-n", space.name)
        _ip(*inside, "addr", "add", f"{space.ns_address}/24", "dev", space.ns_veth)
        _ip(*inside, "link", "set", space.ns_veth, "up")
        _ip(*inside, "link", "set", "lo", "up")
        yield space
    finally:
        subprocess.run(["ip", "link", "del", space.host_veth], capture_output=True, check=False, timeout=10)
        subprocess.run(["ip", "netns", "del", space.name], capture_output=True, check=False, timeout=10)


def _node(pki: Pki, tmp_path: Path, node_id: str, address: str, netns: str | None = None) -> subprocess.Popen[bytes]:
    """`iop node` dialing the control-plane at ``address`` (host:port), inside ``netns`` if given."""
    config = node_config(pki, tmp_path, node_id, 0)
    data = yaml.safe_load(config.read_text())
    data["control_plane"]["address"] = address  # verified as "localhost" still (server_name)
    config.write_text(yaml.safe_dump(data))
    command = [*IOP, "node", "--config", str(config)]
    if netns is not None:
        command = ["ip", "netns", "exec", netns, *command]  # exec: the pid is the node's
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@dataclass
class Rig:
    cp: ControlPlaneApp
    space: Netns
    admin: Connection
    edge: Connection

    def state(self, node_id: str) -> NodeState:
        return self.cp.registry.nodes[node_id].state

    async def on_isolated(self, model: str, run_id: str) -> tuple[RunStream, pb.RunEvent]:
        """A run placed on node-ns (node-b drained meanwhile), and its start event."""
        await self.admin.request(pb.Envelope(nodes_drain=pb.NodesDrain(node_id="node-b", reason="test")))
        stream = await self.edge.open_run(chat(model=model, run_id=run_id))
        start = await asyncio.wait_for(anext(stream), 5)
        assert start.start.node_id == "node-ns"
        await self.admin.request(pb.Envelope(nodes_undrain=pb.NodesUndrain(node_id="node-b")))
        return stream, start

    async def returns(self) -> None:
        """With the link back up, node-ns dials again and is READY."""
        self.space.heal()
        await all_ready(self.cp, "node-ns")
        await assert_eventually(lambda: len(self.cp.sessions.store.events("node-ns")) == 3)  # written after
        assert [state for state, _ in self.cp.sessions.store.events("node-ns")] == ["ready", "unavailable", "ready"]
        events = await asyncio.wait_for(collect(await self.edge.open_run(chat())), 10)
        assert kinds(events)[-1] == "complete"


@pytest.fixture
async def rig(netns: Netns, pki: Pki, tmp_path: Path) -> AsyncIterator[Rig]:
    settings = cp_settings(pki, tmp_path, listen={"host": netns.host_address, "port": 0})
    async with build_control_plane(settings) as cp:
        assert cp.listener is not None
        address = f"{netns.host_address}:{cp.listener.port}"
        processes = [
            _node(pki, tmp_path, "node-ns", address, netns.name),
            _node(pki, tmp_path, "node-b", address),
        ]
        try:
            await all_ready(cp, "node-ns", "node-b")

            async def connect(name: str, role: Role) -> Connection:
                assert cp.listener is not None
                return await dial(
                    netns.host_address,
                    cp.listener.port,
                    tls=pki.config(name, role),
                    server_hostname="localhost",
                    config=ConnectionConfig(heartbeat_interval=INTERVAL),
                )

            admin, edge = await connect("ops", Role.ADMIN), await connect("edge-1", Role.EDGE)
            try:
                yield Rig(cp, netns, admin, edge)
            finally:
                await edge.close()
                await admin.close()
        finally:
            for process in processes:
                process.kill()
                process.wait(timeout=10)


def _clean(events: list[pb.RunEvent]) -> None:
    assert kinds(events)[0] == "start" and kinds(events).count("start") == 1, kinds(events)
    assert sequences(events) == list(range(len(events)))


async def test_the_node_really_sits_behind_the_veth(rig: Rig) -> None:
    node = rig.cp.registry.nodes["node-ns"]
    listed = (await rig.admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
    addresses = {n.node_id: n.address for n in listed.nodes}
    assert addresses["node-ns"].startswith(f"{rig.space.ns_address}:"), addresses
    assert node.state is NodeState.READY


async def test_a_cut_link_before_first_token_fails_over_and_the_node_returns(rig: Rig) -> None:
    stream, start = await rig.on_isolated("mock-ttft", "moved")  # its first token is a second away
    cut = time.monotonic()
    rig.space.cut()
    await assert_eventually(lambda: rig.state("node-ns") is NodeState.UNAVAILABLE, timeout=SILENT + 2)
    took = time.monotonic() - cut
    assert took < SILENT, f"unavailable after {took:.2f} s"
    events = [start, *await asyncio.wait_for(collect(stream), 10)]
    _clean(events)
    assert kinds(events)[-1] == "complete" and "error" not in kinds(events) and text(events)
    failovers = rig.cp.metrics.registry.get_sample_value(
        "iop_control_plane_failovers_total", {"reason": "connection_lost"}
    )
    assert failovers == 1
    await rig.returns()


async def test_a_cut_link_mid_stream_is_continued_on_the_other_node_and_the_node_returns(rig: Rig) -> None:
    stream, start = await rig.on_isolated("mock-slow", "cut")
    deltas = [await asyncio.wait_for(anext(stream), 5) for _ in range(3)]
    assert kinds(deltas) == ["delta"] * 3
    cut = time.monotonic()
    rig.space.cut()
    # it does not hang: within the silence limit node-b goes on from the third delta
    more = [await asyncio.wait_for(anext(stream), SILENT + 3) for _ in range(3)]
    assert time.monotonic() - cut < SILENT + 0.5
    events = [start, *deltas, *more]
    _clean(events)
    assert kinds(more) == ["delta"] * 3, kinds(more)
    migrations = rig.cp.metrics.registry.get_sample_value(
        "iop_control_plane_migrations_total", {"outcome": "continued"}
    )
    assert migrations == 1 and rig.state("node-ns") is NodeState.UNAVAILABLE
    await stream.cancel("enough")
    await rig.returns()
