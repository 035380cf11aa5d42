"""Relay CPU at the pace real backends emit: node CPU per token, 64 streams at 20, 50, 100 tokens/s.

Backends emit tokens one by one; a benchmark that only bursts flatters a relay, because a burst
lets every read, parse and write carry many tokens at once. Here the benchmark server
(fast_openai.py) sends each stream's chunks on a schedule; the node (vllm adapter) is pinned to
core 0, the server and this client to core 1. The burst figure is relay_bench.py's.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from node_bench import _cpu_seconds, _request, _start
from relay_bench import _config
from table import print_table

from iop_wire.connection import Connection
from iop_wire.endpoint import dial
from iop_wire.logs import configure
from iop_wire.tls import TlsConfig

STREAMS = 64
SECONDS = 4.0
_ids = itertools.count()


async def _stream(connection: Connection, tokens: int) -> int:
    stream = await connection.open_run(_request(f"paced-{next(_ids)}", "fast", tokens))
    return sum([1 async for event in stream if event.WhichOneof("event") == "delta"])


async def _cpu_per_token(node_port: int, node_pid: int, certs: Path, pace: float) -> tuple[float, float]:
    """Node CPU per token (us) and tokens/s delivered, over ``STREAMS`` streams of ``SECONDS`` s each."""
    tls = TlsConfig(enabled=True, cert=certs / "edge.crt", key=certs / "edge.key", ca=certs / "ca.crt")
    connection = await dial("127.0.0.1", node_port, tls=tls, server_hostname="localhost")
    await _stream(connection, 4)  # warm: the backend's connection pool and code paths
    tokens = int(pace * SECONDS)
    before, started = _cpu_seconds(node_pid), time.perf_counter()
    counts = await asyncio.gather(*(_stream(connection, tokens) for _ in range(STREAMS)))
    cpu, elapsed = _cpu_seconds(node_pid) - before, time.perf_counter() - started
    await connection.close()
    return cpu / sum(counts) * 1e6, sum(counts) / elapsed


def _measure(pace: float) -> tuple[float, float]:
    here = Path(__file__).parent
    command = ["taskset", "-c", "1", sys.executable, str(here / "fast_openai.py"), "0", str(pace)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    server_port = int(server.stdout.readline())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            state = Path(tmp)
            node, node_port = _start(_config(state, server_port))
            try:
                return asyncio.run(_cpu_per_token(node_port, node.pid, state / "certs", pace))
            finally:
                node.terminate()
                node.wait(timeout=30)
    finally:
        server.kill()
        server.wait()


def main() -> None:
    configure("warning")
    os.sched_setaffinity(0, {1})
    rows = []
    for pace in (20, 50, 100):
        cpu, rate = _measure(pace)
        name = f"vllm adapter: node CPU per relayed token, {STREAMS} streams x {pace} tokens/s each"
        rows.append((name, f"{cpu:.1f} us ({rate:,.0f} tokens/s)"))
    print_table(rows)


if __name__ == "__main__":
    main()
