"""Relay benchmark: the vllm adapter in front of a fast local OpenAI-compatible server.

Node CPU per relayed token, and the time to first token a client sees through the node
compared with talking to the server directly, at concurrency 1. The node runs pinned to
core 0; the server (tests/bench/fast_openai.py) and this client share core 1.
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
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from node_bench import _cpu_seconds, _request, _start, write_config
from table import print_table

from iop_node.adapters.httpclient import HttpClient
from iop_wire.connection import Connection
from iop_wire.endpoint import dial
from iop_wire.logs import configure
from iop_wire.tls import TlsConfig


def _config(state: Path, server_port: int) -> Path:
    options = {"base_url": f"http://127.0.0.1:{server_port}"}
    return write_config(state, [{"model": "fast", "adapter": "vllm", "max_concurrency": 64, "options": options}])


_BODY = {"model": "fast", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


async def _first(started: float, items: AsyncIterator[Any], matches: Callable[[Any], bool]) -> float:
    """Milliseconds from ``started`` to the first of ``items`` that ``matches``; reads them all."""
    first = None
    async for item in items:
        if first is None and matches(item):
            first = time.perf_counter()
    assert first is not None
    return (first - started) * 1000


def _is_chunk(line: bytes) -> bool:
    return line.startswith(b"data: {")


async def _aiohttp_ttft(session: aiohttp.ClientSession, port: int) -> float:
    """Straight from the server, with aiohttp."""
    started = time.perf_counter()
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=_BODY) as response:
        return await _first(started, response.content, _is_chunk)


async def _iop_client_ttft(client: HttpClient) -> float:
    """Straight from the server, with the HTTP client the node itself uses (adapters/httpclient.py)."""
    started = time.perf_counter()
    response = await client.request("POST", "/v1/chat/completions", _BODY_BYTES, connect_timeout=5, head_timeout=5)
    try:
        return await _first(started, response.lines(), _is_chunk)
    finally:
        response.release()


async def _node_ttft(connection: Connection) -> float:
    """Through the node."""
    started = time.perf_counter()
    stream = await connection.open_run(_request(f"ttft-{next(_ids)}", "fast", 8))
    return await _first(started, stream, lambda event: event.WhichOneof("event") == "delta")


_BODY_BYTES = json.dumps(_BODY).encode()
_ids = itertools.count()


async def _ttft(connection: Connection, port: int) -> tuple[float, float, float]:
    """Medians of the three ways to the first token, taken in interleaved blocks.

    The host's speed drifts over tens of seconds; four blocks of each, taken in turn, put each
    way through the same drifts. A block's first 10 runs are not counted: they settle caches
    after the client moved between cores and the other clients ran. The direct clients run where
    the node runs (core 0), so that both paths cross the same cores: an idle core's wake-up,
    not IOP, would otherwise be most of the difference.
    """
    direct: list[float] = []
    lean: list[float] = []
    relayed: list[float] = []
    client = HttpClient(f"http://127.0.0.1:{port}", max_connections=1)
    async with aiohttp.ClientSession() as session:
        for _ in range(4):
            os.sched_setaffinity(0, {0})
            direct += [await _aiohttp_ttft(session, port) for _ in range(85)][10:]
            lean += [await _iop_client_ttft(client) for _ in range(85)][10:]
            os.sched_setaffinity(0, {1})
            relayed += [await _node_ttft(connection) for _ in range(85)][10:]
    await client.aclose()
    return statistics.median(direct), statistics.median(lean), statistics.median(relayed)


async def _cpu_per_token(connection: Connection, pid: int, runs: int, tokens: int) -> float:
    before = _cpu_seconds(pid)
    counts = await asyncio.gather(*(_count(connection, f"cpu-{i}", tokens) for i in range(runs)))
    return (_cpu_seconds(pid) - before) / sum(counts) * 1e6


async def _count(connection: Connection, run_id: str, tokens: int) -> int:
    return sum(
        [
            1
            async for e in await connection.open_run(_request(run_id, "fast", tokens))
            if e.WhichOneof("event") == "delta"
        ]
    )


async def _bench(node_port: int, node_pid: int, server_port: int, certs: Path) -> list[tuple[str, str]]:
    tls = TlsConfig(enabled=True, cert=certs / "edge.crt", key=certs / "edge.key", ca=certs / "ca.crt")
    connection = await dial("127.0.0.1", node_port, tls=tls, server_hostname="localhost")
    direct, lean, relayed = await _ttft(connection, server_port)
    cpu = await _cpu_per_token(connection, node_pid, 10, 5000)
    await connection.close()
    return [
        ("vllm adapter: node CPU per relayed token (10 runs x 5,000 tokens)", f"{cpu:.1f} us"),
        ("time to first token, aiohttp client -> server directly (median of 300)", f"{direct:.2f} ms"),
        ("time to first token, IOP's HTTP client -> server directly (median of 300)", f"{lean:.2f} ms"),
        ("time to first token, client -> node (mTLS) -> server (median of 300)", f"{relayed:.2f} ms"),
        ("time to first token added by the node, against the aiohttp client", f"{relayed - direct:.2f} ms"),
        ("time to first token added by the node, against IOP's HTTP client", f"{relayed - lean:.2f} ms"),
    ]


def main() -> None:
    configure("warning")
    here = Path(__file__).parent
    server = subprocess.Popen(
        ["taskset", "-c", "1", sys.executable, str(here / "fast_openai.py"), "0"], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    server_port = int(server.stdout.readline())
    os.sched_setaffinity(0, {1})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            state = Path(tmp)
            node, node_port = _start(_config(state, server_port))
            try:
                rows = asyncio.run(_bench(node_port, node.pid, server_port, state / "certs"))
            finally:
                node.terminate()
                node.wait(timeout=30)
    finally:
        server.kill()
        server.wait()
    print_table(rows)


if __name__ == "__main__":
    main()
