"""Control-plane benchmarks: relay rate and CPU in bursts and at real pacing, added TTFT.

``iop control-plane`` runs as its own process pinned to core 0; three ``iop node`` processes
(mock adapter, registered with it over mTLS) and this client share core 1. Node ``node-0`` also
listens, so the same run can go client -> node directly, for the TTFT comparison; only it serves
the model ``one`` that comparison uses. Control-plane CPU is read from /proc. Prints a table;
asserts nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from node_bench import _cpu_seconds, _request
from table import print_table

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import init_dir, tls_section
from iop_wire.connection import Connection
from iop_wire.endpoint import dial
from iop_wire.logs import configure
from iop_wire.tls import TlsConfig

IOP = [sys.executable, "-m", "iop_cli.main"]
NODES = ("node-0", "node-1", "node-2")
BURST_RUNS, BURST_TOKENS = 100, 2000
PACED_STREAMS, PACE, PACED_SECONDS = 256, 50, 4.0
TTFT_BLOCKS, TTFT_BLOCK = 10, 25  # 250 runs each way, in interleaved blocks
_ids = itertools.count()


def _cp_config(state: Path) -> Path:
    data = {
        "listen": {"port": 0},
        "tls": tls_section(state / "certs", "control-plane"),
        "store_path": str(state / "cp.db"),
        "queue_size": 1024,
        "log_level": "warning",
    }
    path = state / "cp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _node_config(state: Path, node_id: str, cp_port: int, *, listen: bool) -> Path:
    routes: list[dict[str, Any]] = [
        {
            "model": "fast",
            "adapter": "mock",
            "max_concurrency": 256,
            "queue_size": 1024,
            "options": {"tokens": 100_000},
        },
        {
            "model": "paced",
            "adapter": "mock",
            "max_concurrency": 256,
            "queue_size": 1024,
            "options": {"tokens": 10_000, "tokens_per_second": PACE},
        },
    ]
    if listen:
        routes.append({"model": "one", "adapter": "mock", "max_concurrency": 16, "options": {"tokens": 2, "ttft": 0}})
    data = {
        "node_id": node_id,
        "listen": {"port": 0} if listen else {"enabled": False},
        "tls": tls_section(state / "certs", "node"),
        "store_path": str(state / f"{node_id}.db"),
        "log_level": "warning",
        "event_loop": "uvloop",
        "control_plane": {"address": f"127.0.0.1:{cp_port}", "server_name": "localhost"},
        "routes": routes,
    }
    path = state / f"{node_id}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _wait_ready(ready: Path, process: subprocess.Popen[bytes], timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{process.args!r} wrote no ready file in {timeout} s")
        time.sleep(0.02)
    info: dict[str, Any] = json.loads(ready.read_text())
    return info


def _spawn(core: int, *args: str) -> subprocess.Popen[bytes]:
    command = ["taskset", "-c", str(core), *IOP, *args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextmanager
def _platform(state: Path) -> Iterator[tuple[int, int, int]]:
    """Control-plane on core 0, three registered nodes on core 1: (cp pid, cp port, node-0 port)."""
    init_dir(state / "certs")
    processes: list[subprocess.Popen[bytes]] = []
    try:
        ready = state / "cp.ready"
        cp = _spawn(0, "control-plane", "--config", str(_cp_config(state)), "--ready-file", str(ready))
        processes.append(cp)
        cp_port = int(_wait_ready(ready, cp)["port"])
        node_port = 0
        for index, node_id in enumerate(NODES):
            ready = state / f"{node_id}.ready"
            config = _node_config(state, node_id, cp_port, listen=index == 0)
            node = _spawn(1, "node", "--config", str(config), "--ready-file", str(ready))
            processes.append(node)
            info = _wait_ready(ready, node)
            if index == 0:
                node_port = int(info["port"])
        yield cp.pid, cp_port, node_port
    finally:
        stop(processes)


def stop(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process, the last started first; SIGKILL those still running 15 s later."""
    for process in reversed(processes):
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


async def _until_registered(admin: Connection, nodes: int = len(NODES)) -> None:
    for _ in range(600):
        listed = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
        if sum(node.state == pb.NODE_STATE_READY for node in listed.nodes) == nodes:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the nodes did not register")


async def _drain(connection: Connection, model: str, tokens: int) -> int:
    stream = await connection.open_run(_request(f"r{next(_ids)}", model, tokens))
    events = [event async for event in stream]
    if events[-1].WhichOneof("event") != "complete":
        raise RuntimeError(f"run ended with {events[-1]}")
    return len(events)


async def _burst(edge: Connection, cp_pid: int) -> tuple[float, float, float]:
    """Events/s delivered, cp CPU per relayed event (us), events per cp CPU second."""
    await asyncio.gather(*(_drain(edge, "fast", 200) for _ in range(30)))  # warm up
    before, started = _cpu_seconds(cp_pid), time.perf_counter()
    counts = await asyncio.gather(*(_drain(edge, "fast", BURST_TOKENS) for _ in range(BURST_RUNS)))
    cpu, elapsed = _cpu_seconds(cp_pid) - before, time.perf_counter() - started
    events = sum(counts)
    return events / elapsed, cpu / events * 1e6, events / cpu if cpu else float("inf")


async def _paced(edge: Connection, cp_pid: int) -> tuple[float, float, float]:
    """cp CPU per relayed event (us), events/s delivered, cp CPU share of a core."""
    await _drain(edge, "paced", 4)
    before, started = _cpu_seconds(cp_pid), time.perf_counter()
    tokens = int(PACE * PACED_SECONDS)
    counts = await asyncio.gather(*(_drain(edge, "paced", tokens) for _ in range(PACED_STREAMS)))
    cpu, elapsed = _cpu_seconds(cp_pid) - before, time.perf_counter() - started
    events = sum(counts)
    return cpu / events * 1e6, events / elapsed, cpu / elapsed


async def _ttft(connection: Connection) -> float:
    """Seconds from opening a run to its first delta; the rest of the run is drained."""
    started = time.perf_counter()
    stream = await connection.open_run(_request(f"f{next(_ids)}", "one", 2))
    first = None
    async for event in stream:
        if first is None and event.WhichOneof("event") == "delta":
            first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("no delta")
    return first


async def _added_ttft(via_cp: Connection, direct: Connection) -> tuple[float, float]:
    """Median TTFT (ms) through the control-plane and directly, interleaved in blocks."""
    for _ in range(50):  # warm up both paths
        await _ttft(via_cp)
        await _ttft(direct)
    samples: dict[str, list[float]] = {"cp": [], "direct": []}
    for block in range(TTFT_BLOCKS):
        order = [("cp", via_cp), ("direct", direct)]
        for name, connection in order if block % 2 == 0 else reversed(order):
            for _ in range(TTFT_BLOCK):
                samples[name].append(await _ttft(connection))
    return statistics.median(samples["cp"]) * 1000, statistics.median(samples["direct"]) * 1000


async def _bench(cp_pid: int, cp_port: int, node_port: int, certs: Path) -> list[tuple[str, str]]:
    def tls(name: str) -> TlsConfig:
        return TlsConfig(enabled=True, cert=certs / f"{name}.crt", key=certs / f"{name}.key", ca=certs / "ca.crt")

    async with dial("127.0.0.1", cp_port, tls=tls("admin"), server_hostname="localhost") as admin:
        await asyncio.wait_for(_until_registered(admin), 60)
    async with (
        dial("127.0.0.1", cp_port, tls=tls("edge"), server_hostname="localhost") as edge,
        dial("127.0.0.1", node_port, tls=tls("edge"), server_hostname="localhost") as direct,
    ):
        rate, burst_cpu, per_core = await asyncio.wait_for(_burst(edge, cp_pid), 120)
        paced_cpu, paced_rate, share = await asyncio.wait_for(_paced(edge, cp_pid), 120)
        via_cp, straight = await asyncio.wait_for(_added_ttft(edge, direct), 180)
    runs = TTFT_BLOCKS * TTFT_BLOCK
    return [
        (f"burst, {BURST_RUNS} runs x {BURST_TOKENS:,} tokens over 3 nodes: events/s delivered", f"{rate:,.0f}"),
        ("burst: control-plane CPU per relayed event", f"{burst_cpu:.2f} us"),
        ("burst: events per second per core of control-plane CPU", f"{per_core:,.0f}"),
        (
            f"paced, {PACED_STREAMS} streams x {PACE} tokens/s over 3 nodes: control-plane CPU per relayed event",
            f"{paced_cpu:.1f} us ({paced_rate:,.0f} events/s, cp {share:.1%} of a core)",
        ),
        (f"TTFT median, client -> cp -> node ({runs} runs, mock ttft 0)", f"{via_cp:.3f} ms"),
        (f"TTFT median, client -> node ({runs} runs, interleaved blocks of {TTFT_BLOCK})", f"{straight:.3f} ms"),
        ("TTFT added by the control-plane hop (difference of medians)", f"{via_cp - straight:.3f} ms"),
    ]


def main() -> None:
    configure("warning")
    os.sched_setaffinity(0, {1})
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        with _platform(state) as (cp_pid, cp_port, node_port):
            rows = asyncio.run(_bench(cp_pid, cp_port, node_port, state / "certs"))
    print_table(rows)


if __name__ == "__main__":
    main()
