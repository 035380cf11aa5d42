"""A stream that outlives its control-plane: two `iop control-plane` processes, two mock nodes
registered with both, a run read through ``open_run_anywhere`` as an edge does. ``kill -9`` of
the control-plane carrying the run mid-stream: the reader sees one stream whose text is the
uninterrupted run's byte for byte, one start, gapless sequence numbers and the same usage. With
no control-plane left to continue on, the run ends NODE_LOST saying so."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from conftest import Pki, assert_eventually
from cp_helpers import IOP, cp_config
from node_helpers import chat, kinds, node_settings, text

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.bootstrap import build_node
from iop_wire.connection import ConnectionConfig
from iop_wire.dialer import KeepConnected, Links, Target
from iop_wire.endpoint import dial
from iop_wire.failover import FailoverStream, open_run_anywhere
from iop_wire.tls import Role

STREAM: list[dict[str, Any]] = [
    {"model": "mock-stream", "adapter": "mock", "options": {"tokens": 40, "tokens_per_second": 40}}
]
NODES = ("node-1", "node-2")


@contextmanager
def _control_plane(pki: Pki, folder: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """An `iop control-plane` process on port 0 and its port; killed on the way out."""
    folder.mkdir()
    ready = folder / "ready.json"
    command = [*IOP, "control-plane", "--config", str(cp_config(pki, folder)), "--ready-file", str(ready)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(400):
            if ready.exists():
                break
            if process.poll() is not None:
                raise AssertionError(f"the control-plane in {folder} exited {process.returncode}")
            time.sleep(0.05)  # before the test's loop runs anything
        yield process, int(json.loads(ready.read_text())["port"])
    finally:
        process.kill()
        process.wait(timeout=10)


async def _nodes_ready(pki: Pki, port: int) -> None:
    """Until the control-plane at ``port`` lists both nodes ready."""
    tls, config = pki.config("ops", Role.ADMIN), ConnectionConfig(heartbeat_interval=0.5)
    async with dial("127.0.0.1", port, tls=tls, server_hostname="localhost", config=config) as admin:
        for _ in range(400):
            listed = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
            if sorted(node.node_id for node in listed.nodes if node.state == pb.NODE_STATE_READY) == list(NODES):
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"the nodes did not register with the control-plane at {port}")


@asynccontextmanager
async def _platform(pki: Pki, tmp_path: Path) -> AsyncIterator[tuple[dict[int, subprocess.Popen[bytes]], Links]]:
    """Control-plane processes by port, mock nodes registered with both, and an edge's links to both."""
    with _control_plane(pki, tmp_path / "cp-a") as (cp_a, port_a), _control_plane(pki, tmp_path / "cp-b") as cp_b:
        processes = {port_a: cp_a, cp_b[1]: cp_b[0]}
        addresses = [f"127.0.0.1:{port}" for port in processes]
        async with AsyncExitStack() as stack:
            for node_id in NODES:
                tls = pki.config(node_id, Role.NODE)
                settings = node_settings(
                    pki,
                    tmp_path,
                    STREAM,
                    node_id=node_id,
                    listen={"enabled": False},
                    control_plane={"addresses": addresses, "server_name": "localhost", "reconnect_initial": 0.05},
                    store_path=tmp_path / f"{node_id}.db",
                    tls={"enabled": True, "cert": tls.cert, "key": tls.key, "ca": tls.ca},
                )
                node = await build_node(settings).start()
                stack.push_async_callback(node.stop, 0)
            for port in processes:
                await _nodes_ready(pki, port)
            tls, config = pki.config("edge-t", Role.EDGE), ConnectionConfig(heartbeat_interval=0.5)
            links = Links([KeepConnected(Target("localhost", port, tls=tls, connection=config)) for port in processes])
            links.start()
            stack.push_async_callback(links.stop)
            await assert_eventually(lambda: len(links.up()) == len(processes), timeout=10)
            yield processes, links


async def _read_killing(
    stream: FailoverStream, processes: dict[int, subprocess.Popen[bytes]], *, after: int
) -> list[pb.RunEvent]:
    """Every event of ``stream``; the control-plane carrying it killed (-9) once ``after`` deltas were read."""
    events: list[pb.RunEvent] = []
    async with asyncio.timeout(30), stream:
        async for event in stream:
            events.append(event)
            if kinds(events).count("delta") == after:
                carrier = processes[int(stream.address.rpartition(":")[2])]
                carrier.kill()
                await asyncio.to_thread(carrier.wait, 10)
    return events


async def test_a_stream_goes_on_through_the_other_control_plane_when_its_own_is_killed(
    pki: Pki, tmp_path: Path
) -> None:
    async with _platform(pki, tmp_path) as (processes, links):
        prompt = "tell me a long story"
        whole = await open_run_anywhere(links, chat("mock-stream", prompt))
        async with asyncio.timeout(30), whole:
            uninterrupted = [event async for event in whole]
        assert kinds(uninterrupted)[-1] == "complete" and whole.migrated == 0

        cut = await open_run_anywhere(links, chat("mock-stream", prompt))
        events = await _read_killing(cut, processes, after=10)
        assert cut.migrated == 1, [event for event in events if event.HasField("error")]
        assert kinds(events) == kinds(uninterrupted), "one start, every delta once, one complete"
        assert text(events).encode() == text(uninterrupted).encode()
        assert [event.sequence for event in events] == list(range(len(events)))
        usage, whole_usage = events[-1].complete.usage, uninterrupted[-1].complete.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            whole_usage.prompt_tokens,
            whole_usage.completion_tokens,
        )
        assert 10 <= usage.continuation_prompt_tokens < usage.completion_tokens, "the delivered tokens, re-read once"

        # The survivor carries the next run alone: killed too, nothing is left to continue on.
        last = await open_run_anywhere(links, chat("mock-stream", prompt))
        events = await _read_killing(last, processes, after=5)
    assert kinds(events)[:6] == ["start"] + ["delta"] * 5 and kinds(events)[-1] == "error" and last.migrated == 0
    assert text(events) == text(uninterrupted)[: len(text(events))]
    assert [event.sequence for event in events] == list(range(len(events)))
    error = events[-1].error
    assert error.code == pb.ERROR_CODE_NODE_LOST and error.retryable
    assert "not continued: no other control-plane could take it" in error.message, error.message
