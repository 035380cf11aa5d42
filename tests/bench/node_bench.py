"""Node benchmarks: mock tokens/s to one connection, node CPU per one-token run, cancel latency.

The node runs as its own process pinned to core 0 (``iop node``, mock adapter, history in
SQLite); this client is pinned to core 1. Prints a table; asserts nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from table import print_table

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import init_dir, tls_section
from iop_wire.connection import Connection
from iop_wire.endpoint import dial
from iop_wire.logs import configure
from iop_wire.tls import TlsConfig

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def write_config(state: Path, routes: list[dict[str, object]]) -> Path:
    """Certificates and a node config under ``state``, for a node on 127.0.0.1 port 0 with mTLS."""
    certs = state / "certs"
    init_dir(certs)
    data = {
        "node_id": "bench",
        "listen": {"port": 0},
        "tls": tls_section(certs, "node"),
        "store_path": str(state / "runs.db"),
        "log_level": "warning",
        "routes": routes,
    }
    path = state / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _config(state: Path) -> Path:
    return write_config(
        state,
        [
            {
                "model": "fast",
                "adapter": "mock",
                "max_concurrency": 128,
                "queue_size": 1024,
                "options": {"tokens": 100_000},
            },
            {
                "model": "paced",
                "adapter": "mock",
                "max_concurrency": 64,
                "options": {"tokens": 10_000, "tokens_per_second": 200},
            },
        ],
    )


def _start(config: Path) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "IOP_LOG_LEVEL": "info"}
    command = ["taskset", "-c", "0", sys.executable, "-m", "iop_cli.main", "node", "--config", str(config)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    assert process.stderr is not None
    for line in process.stderr:
        event = json.loads(line)
        if event.get("event") == "node started":
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, int(event["port"])
    raise RuntimeError("node did not start")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _request(run_id: str, model: str, tokens: int) -> pb.RunRequest:
    """A chat request built as a relay builds one: upb, no betterproto2 conversion."""
    return pb.RunRequest(
        run_id=run_id,
        model=model,
        stream=True,
        sampling=pb.Sampling(max_tokens=tokens),
        messages=[pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text="benchmark prompt")])],
    )


async def _drain(connection: Connection, request: pb.RunRequest) -> int:
    return len([event async for event in await connection.open_run(request)])


async def _throughput(connection: Connection, runs: int, tokens: int) -> float:
    start = time.perf_counter()
    counts = await asyncio.gather(*(_drain(connection, _request(f"t{i}", "fast", tokens)) for i in range(runs)))
    return (sum(counts) - 2 * runs) / (time.perf_counter() - start)


async def _cpu_per_run(connection: Connection, pid: int, runs: int, concurrency: int) -> float:
    semaphore = asyncio.Semaphore(concurrency)

    async def one(index: int) -> None:
        async with semaphore:
            await _drain(connection, _request(f"one-{index}", "fast", 1))

    await asyncio.gather(*(one(i) for i in range(200)))  # warm up
    before = _cpu_seconds(pid)
    await asyncio.gather(*(one(i) for i in range(200, 200 + runs)))
    return (_cpu_seconds(pid) - before) / runs * 1e6


async def _cancel_latency(connection: Connection, runs: int) -> list[float]:
    latencies = []
    for index in range(runs):
        stream = await connection.open_run(_request(f"c{index}", "paced", 10_000))
        await anext(stream)  # start
        await anext(stream)  # first token: the run is streaming
        started = time.perf_counter()
        await stream.cancel("bench")
        events = [event async for event in stream]
        assert events[-1].WhichOneof("event") == "error"
        latencies.append((time.perf_counter() - started) * 1000)
    return latencies


async def _bench(port: int, pid: int, certs: Path) -> list[tuple[str, str]]:
    tls = TlsConfig(enabled=True, cert=certs / "edge.crt", key=certs / "edge.key", ca=certs / "ca.crt")
    connection = await dial("127.0.0.1", port, tls=tls, server_hostname="localhost")
    tokens = await _throughput(connection, 100, 2000)
    alone = await _cpu_per_run(connection, pid, 1000, 1)
    together = await _cpu_per_run(connection, pid, 2000, 16)
    cancels = await _cancel_latency(connection, 40)
    rows = [
        ("mock tokens/s to one connection, 100 concurrent runs (node on one core)", f"{tokens:,.0f}"),
        ("node CPU per one-token run, one at a time (request in, events out, row written)", f"{alone:,.0f} us"),
        ("node CPU per one-token run, 16 in flight", f"{together:,.0f} us"),
        (
            "cancel round trip while streaming, median / max (client -> node -> client)",
            f"{statistics.median(cancels):.1f} / {max(cancels):.1f} ms",
        ),
    ]
    await connection.close()
    return rows


def main() -> None:
    configure("warning")
    os.sched_setaffinity(0, {1})
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        process, port = _start(_config(state))
        try:
            rows = asyncio.run(_bench(port, process.pid, state / "certs"))
        finally:
            process.terminate()
            process.wait(timeout=30)
    print_table(rows)


if __name__ == "__main__":
    main()
