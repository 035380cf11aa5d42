"""A node that reaches the control-plane through a faulty link: delay, stall, black hole, reset.

``node-p`` dials the control-plane through a :class:`FaultProxy`; ``node-b`` dials it directly and
is drained while a run must land on ``node-p``, then undrained so a failover has somewhere to go.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import Pki, assert_eventually
from cp_helpers import IOP, all_ready, client, cp_settings, node_config, node_processes, sequences
from fault_proxy import FaultProxy
from node_helpers import chat, collect, kinds, text

from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_control_plane.registry import NodeState
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection
from iop_wire.runs import RunStream
from iop_wire.tls import Role

INTERVAL = 0.5
SILENT = 3 * INTERVAL + 1.0  # 3 intervals, plus the watchdog's tick (as the SIGSTOP test allows)


@contextmanager
def proxied_node(pki: Pki, tmp_path: Path, node_id: str, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """An `iop node` that dials the control-plane at 127.0.0.1:``port`` (the proxy)."""
    config = node_config(pki, tmp_path, node_id, port)
    process = subprocess.Popen(
        [*IOP, "node", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait(timeout=10)


@dataclass
class Rig:
    cp: ControlPlaneApp
    proxy: FaultProxy
    admin: Connection
    edge: Connection

    def state(self, node_id: str) -> NodeState:
        return self.cp.registry.nodes[node_id].state

    async def drain(self, node_id: str) -> None:
        await self.admin.request(pb.Envelope(nodes_drain=pb.NodesDrain(node_id=node_id, reason="test")))

    async def undrain(self, node_id: str) -> None:
        await self.admin.request(pb.Envelope(nodes_undrain=pb.NodesUndrain(node_id=node_id)))

    async def unavailable_within(self, node_id: str, seconds: float, since: float) -> float:
        """Wait for ``node_id`` to be UNAVAILABLE; assert it took under ``seconds``; return how long."""
        await assert_eventually(lambda: self.state(node_id) is NodeState.UNAVAILABLE, timeout=seconds + 2)
        took = time.monotonic() - since
        assert took < seconds, f"{node_id} unavailable after {took:.2f} s, wanted < {seconds} s"
        return took

    async def on_proxied(self, model: str, run_id: str) -> tuple[RunStream, pb.RunEvent]:
        """A run placed on node-p (node-b drained meanwhile), and its start event."""
        await self.drain("node-b")
        stream = await self.edge.open_run(chat(model=model, run_id=run_id))
        start = await asyncio.wait_for(anext(stream), 5)
        assert start.WhichOneof("event") == "start" and start.start.node_id == "node-p"
        return stream, start

    async def reconnects(self, accepted: int) -> None:
        """After the link heals, node-p registers again over a connection accepted after ``accepted``."""
        self.proxy.pass_()
        await all_ready(self.cp, "node-p")
        assert self.proxy.accepted > accepted
        await assert_eventually(lambda: len(self.cp.sessions.store.events("node-p")) == 3)
        assert [state for state, _ in self.cp.sessions.store.events("node-p")] == ["ready", "unavailable", "ready"]
        events = await asyncio.wait_for(collect(await self.edge.open_run(chat())), 10)
        assert kinds(events)[-1] == "complete"


@pytest.fixture
async def rig(pki: Pki, tmp_path: Path) -> AsyncIterator[Rig]:
    async with build_control_plane(cp_settings(pki, tmp_path, heartbeat_interval=INTERVAL)) as cp:
        assert cp.listener is not None
        port = cp.listener.port
        async with FaultProxy("127.0.0.1", port) as proxy:
            with proxied_node(pki, tmp_path, "node-p", proxy.port), node_processes(pki, tmp_path, port, "node-b"):
                await all_ready(cp, "node-p", "node-b")
                admin = await client(cp, pki, "ops", Role.ADMIN)
                edge = await client(cp, pki)
                try:
                    yield Rig(cp, proxy, admin, edge)
                finally:
                    await edge.close()
                    await admin.close()


def _clean(events: list[pb.RunEvent]) -> None:
    """One start first, gapless numbers from 0."""
    assert kinds(events)[0] == "start" and kinds(events).count("start") == 1, kinds(events)
    assert sequences(events) == list(range(len(events)))


def _complete(events: list[pb.RunEvent]) -> None:
    _clean(events)
    assert kinds(events)[-1] == "complete" and "error" not in kinds(events), kinds(events)
    assert text(events)


def _node_lost(events: list[pb.RunEvent], run_id: str) -> None:
    _clean(events)
    assert kinds(events)[-1] == "error" and kinds(events).count("error") == 1, kinds(events)
    error = events[-1].error
    assert error.code == pb.ERROR_CODE_NODE_LOST and error.retryable and error.run_id == run_id, error


FAULTS: dict[str, Callable[[FaultProxy], None]] = {"stall": FaultProxy.stall, "black-hole": FaultProxy.black_hole}


async def test_a_delayed_link_still_relays_clean_runs(rig: Rig) -> None:
    rig.proxy.delay(0.05)  # 50 ms each way on every chunk
    await rig.drain("node-b")
    began = time.monotonic()
    for index in range(3):
        events = await asyncio.wait_for(collect(await rig.edge.open_run(chat(run_id=f"slow-{index}"))), 10)
        _complete(events)
        assert events[0].start.node_id == "node-p"
    assert time.monotonic() - began >= 3 * 0.1  # the delay was really there: a round trip each
    stream = await rig.edge.open_run(chat(model="mock-ttft", run_id="ttft"))
    _complete(await asyncio.wait_for(collect(stream), 10))
    # heartbeats crossing the delay keep it READY for more than 3 intervals
    deadline = time.monotonic() + 4 * INTERVAL
    while time.monotonic() < deadline:
        assert rig.state("node-p") is NodeState.READY
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_silent_link_before_first_token_fails_over(rig: Rig, fault: str) -> None:
    stream, start = await rig.on_proxied("mock-ttft", "moved")  # its first token is a second away
    await rig.undrain("node-b")
    cut, accepted = time.monotonic(), rig.proxy.accepted
    FAULTS[fault](rig.proxy)
    await rig.unavailable_within("node-p", SILENT, cut)
    events = [start, *await asyncio.wait_for(collect(stream), 10)]
    _complete(events)
    assert rig.state("node-b") is NodeState.READY
    failovers = rig.cp.metrics.registry.get_sample_value(
        "iop_control_plane_failovers_total", {"reason": "connection_lost"}
    )
    assert failovers == 1
    await rig.reconnects(accepted)


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_silent_link_mid_stream_ends_with_node_lost(rig: Rig, fault: str) -> None:
    stream, start = await rig.on_proxied("mock-slow", "cut")
    deltas = [await asyncio.wait_for(anext(stream), 5) for _ in range(3)]
    assert kinds(deltas) == ["delta"] * 3
    cut, accepted = time.monotonic(), rig.proxy.accepted
    FAULTS[fault](rig.proxy)
    rest = await asyncio.wait_for(collect(stream), SILENT + 3)  # it ends; it does not hang
    assert time.monotonic() - cut < SILENT + 0.5
    _node_lost([start, *deltas, *rest], "cut")
    assert rig.state("node-p") is NodeState.UNAVAILABLE
    await rig.undrain("node-b")
    await rig.reconnects(accepted)


async def test_a_reset_before_first_token_is_seen_at_once_and_fails_over(rig: Rig) -> None:
    stream, start = await rig.on_proxied("mock-ttft", "moved")
    await rig.undrain("node-b")
    cut, accepted = time.monotonic(), rig.proxy.accepted
    rig.proxy.reset()
    await rig.unavailable_within("node-p", 1.0, cut)
    events = [start, *await asyncio.wait_for(collect(stream), 10)]
    _complete(events)
    await rig.reconnects(accepted)


async def test_a_reset_mid_stream_ends_with_node_lost_at_once(rig: Rig) -> None:
    stream, start = await rig.on_proxied("mock-slow", "cut")
    deltas = [await asyncio.wait_for(anext(stream), 5) for _ in range(3)]
    cut, accepted = time.monotonic(), rig.proxy.accepted
    rig.proxy.reset()
    rest = await asyncio.wait_for(collect(stream), 5)
    assert time.monotonic() - cut < 1.0
    _node_lost([start, *deltas, *rest], "cut")
    assert rig.state("node-p") is NodeState.UNAVAILABLE
    await rig.undrain("node-b")
    await rig.reconnects(accepted)
