"""The whole platform against a direct connection to the same upstream: latency, throughput, CPU, memory.

``iop control-plane``, one ``iop node`` (vllm adapter) and ``iop edge`` (API key on) run as
processes, as ``iop up --backend URL`` starts them, in front of ``fast_openai.py`` (a canned
OpenAI-compatible server). The client (aiohttp, one session per measurement) runs in this
process. On 2 cores everything shares the machine, as it would on the target host. Prints a
table; asserts nothing.

Rows: added latency at concurrency 1 (non-streaming, p50 and p99; streaming time to first
token, p50), measured in alternating blocks against the upstream directly; the median of the
edge's x-iop-overhead-ms header beside the added median it claims to report; streaming throughput
at concurrency 64 (64 tokens each); non-streaming requests/s at concurrency 64; the edge's RSS
with 1,000 streams open; CPU per streamed token of each service at real pacing (256 streams,
the upstream sending 50 tokens/s each); time to first token at concurrency 64 through the
platform as ``iop up --backend URL`` starts it (the route it writes, every other setting default),
beside the upstream directly.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from control_plane_bench import IOP, _wait_ready, stop
from node_bench import _cpu_seconds
from table import print_table

from iop_edge.keys import create_key
from iop_wire.certs import init_dir, tls_section

HERE = Path(__file__).parent
LATENCY_BLOCKS, LATENCY_BLOCK = 8, 50
ALTERNATING = 300
"""Requests each way in the header's first row: one through the platform, the next direct, and so on."""
UVICORN = "FastAPI-on-uvicorn (as vLLM's)"
PAUSE = 0.005
"""Seconds a client waits between requests in the header's second row (as an interactive client
does): the platform's work after an answer left (records, metrics) is then done before the next."""
THROUGHPUT_SECONDS = 5.0
PACED_STREAMS, PACE, PACED_SECONDS = 256, 50, 4.0
OPEN_STREAMS = 1000
LATENCY_ONLY = "--latency" in sys.argv
"""``python edge_bench.py --latency``: the latency rows alone (a minute instead of several)."""


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _upstream(pace: float = 0.0, *, uvicorn: bool = False) -> tuple[subprocess.Popen[bytes], int]:
    command = [sys.executable, str(HERE / "fast_openai.py"), "0", str(pace), *(["--uvicorn"] if uvicorn else [])]
    process = subprocess.Popen(command, stdout=subprocess.PIPE)
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@contextmanager
def _platform(state: Path, upstream: int) -> Iterator[tuple[dict[str, int], int, str]]:
    """control-plane, node and edge in front of the upstream: ({service: pid}, edge port, API key)."""
    certs = state / "certs"
    init_dir(certs)
    processes: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(name: str, config: Path) -> dict[str, Any]:
        ready = state / f"{name}.ready"
        command = [*IOP, name, "--config", str(config), "--ready-file", str(ready)]
        processes[name] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return _wait_ready(ready, processes[name])

    cp = {
        "listen": {"port": 0},
        "tls": tls_section(certs, "control-plane"),
        "store_path": str(state / "cp.db"),
        "queue_size": 4096,
        "log_level": "warning",
    }
    try:
        cp_port = int(spawn("control-plane", _write(state / "cp.yaml", cp))["port"])
        address = {"address": f"127.0.0.1:{cp_port}", "server_name": "localhost"}
        route = {
            "model": "fast",
            "adapter": "vllm",
            "max_concurrency": 2048,
            "queue_size": 4096,
            "options": {"base_url": f"http://127.0.0.1:{upstream}", "max_connections": 512},
        }
        node = {
            "node_id": "node-0",
            "listen": {"enabled": False},
            "tls": tls_section(certs, "node"),
            "store_path": str(state / "node.db"),
            "log_level": "warning",
            "control_plane": address,
            "routes": [route],
        }
        spawn("node", _write(state / "node.yaml", node))
        edge = {
            "http": {"port": 0, "max_in_flight": 8192},
            "control_plane": address,
            "tls": tls_section(certs, "edge"),
            "auth": "keys",
            "keys_path": str(state / "keys.db"),
            "log_level": "warning",
        }
        key = create_key(state / "keys.db", "bench")
        edge_port = int(spawn("edge", _write(state / "edge.yaml", edge))["port"])
        _until_ready(edge_port)
        yield {name: process.pid for name, process in processes.items()}, edge_port, key
    finally:
        stop(list(processes.values()))


def _until_ready(port: int, timeout: float = 30.0) -> None:
    """Wait until the edge answers /ready (its control-plane connections up, a model served)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the edge on port {port} was not ready in {timeout} s")
        time.sleep(0.05)


def _body(tokens: int, *, stream: bool) -> bytes:
    body = {"model": "fast", "messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens, "stream": stream}
    return json.dumps(body).encode()


async def _whole(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes, overheads: list[float] | None = None
) -> float:
    """Seconds to the whole answer; its x-iop-overhead-ms (seconds) appended to ``overheads``."""
    started = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        if overheads is not None:
            overheads.append(float(response.headers["x-iop-overhead-ms"]) / 1000)
    return time.perf_counter() - started


async def _warm_up(
    session: aiohttp.ClientSession, *paths: tuple[str, dict[str, str]], body: bytes, rounds: int = 30
) -> None:
    """``rounds`` requests down each (url, headers) path, one after the other, before anything is measured."""
    for _ in range(rounds):
        for url, headers in paths:
            await _whole(session, url, headers, body)


async def _first_token(session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes) -> float:
    """Seconds to the first content chunk; the rest of the stream is read."""
    started = time.perf_counter()
    first = None
    async with session.post(url, data=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if first is None and b"tok " in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("no token")
    return first


async def _streamed_tokens(session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes) -> int:
    tokens = 0
    async with session.post(url, data=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            tokens += b"tok " in line
    return tokens


async def _latency(
    edge: str, direct: str, key: str, *, upstream: str = "", pause: float = 0.0
) -> list[tuple[str, str]]:
    """The latency rows, each request sent once the one before is read (after ``pause`` seconds);
    with ``upstream`` (the upstream's kind, when not the bare asyncio one) or a pause, the header's
    row alone."""
    auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    plain = {"content-type": "application/json"}
    whole, stream = _body(16, stream=False), _body(16, stream=True)
    samples: dict[str, list[float]] = {"iop": [], "direct": [], "iop_ttft": [], "direct_ttft": [], "header": []}
    async with aiohttp.ClientSession() as session:
        await _warm_up(session, (edge, auth), (direct, plain), body=whole)
        for block in range(LATENCY_BLOCKS):
            order = [("iop", edge, auth), ("direct", direct, plain)]
            for name, url, headers in order if block % 2 == 0 else reversed(order):
                overheads = samples["header"] if name == "iop" else None
                for _ in range(LATENCY_BLOCK):
                    await asyncio.sleep(pause)
                    samples[name].append(await _whole(session, url, headers, whole, overheads))
                    await asyncio.sleep(pause)
                    samples[f"{name}_ttft"].append(await _first_token(session, url, headers, stream))
    runs = LATENCY_BLOCKS * LATENCY_BLOCK

    def pct(values: list[float], q: float) -> float:
        return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000

    added50 = pct(samples["iop"], 0.5) - pct(samples["direct"], 0.5)
    added99 = pct(samples["iop"], 0.99) - pct(samples["direct"], 0.99)
    ttft = pct(samples["iop_ttft"], 0.5) - pct(samples["direct_ttft"], 0.5)
    header = pct(samples["header"], 0.5)
    if upstream or pause:
        how = f"{upstream} upstream" if upstream else f"{pause * 1000:g} ms between requests"
        return [
            (
                f"x-iop-overhead-ms p50 / added p50, non-streaming, {how} (target: within 20%)",
                f"{header:.2f} / {added50:.2f} ms ({header / added50:.0%})",
            )
        ]
    return [
        (
            f"non-streaming at concurrency 1, p50 IOP / direct ({runs} each, 16 tokens)",
            f"{pct(samples['iop'], 0.5):.2f} / {pct(samples['direct'], 0.5):.2f} ms",
        ),
        ("added latency, non-streaming, concurrency 1: p50 / p99", f"{added50:.2f} / {added99:.2f} ms"),
        (
            "x-iop-overhead-ms p50 / added p50, non-streaming (target: within 20%)",
            f"{header:.2f} / {added50:.2f} ms ({header / added50:.0%})",
        ),
        ("added time to first token, streaming, concurrency 1: p50", f"{ttft:.2f} ms"),
    ]


async def _alternating(edge: str, direct: str, key: str, *, upstream: str = "") -> list[tuple[str, str]]:
    """The header's row as the overhead was first measured: ALTERNATING non-streaming requests, one
    through the platform, the next direct, and so on (each sent once the one before is read);
    ``upstream`` names the upstream's kind when it is not the bare asyncio one."""
    auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    plain = {"content-type": "application/json"}
    whole = _body(16, stream=False)
    through: list[float] = []
    direct_times: list[float] = []
    header: list[float] = []
    async with aiohttp.ClientSession() as session:
        await _warm_up(session, (edge, auth), (direct, plain), body=whole)
        for _ in range(ALTERNATING):
            through.append(await _whole(session, edge, auth, whole, header))
            direct_times.append(await _whole(session, direct, plain, whole))
    added = statistics.median(through) - statistics.median(direct_times)
    claimed = statistics.median(header)
    return [
        (
            f"x-iop-overhead-ms p50 / added p50, non-streaming, {ALTERNATING} alternating with direct"
            + (f", {upstream} upstream" if upstream else "")
            + " (target: within 20%)",
            f"{claimed * 1000:.2f} / {added * 1000:.2f} ms ({claimed / added:.0%})",
        )
    ]


async def _throughput(edge: str, key: str, pids: dict[str, int]) -> list[tuple[str, str]]:
    auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=connector) as session:
        stream = _body(64, stream=True)
        await asyncio.gather(*(_streamed_tokens(session, edge, auth, stream) for _ in range(64)))  # warm up
        tokens = 0
        deadline = time.perf_counter() + THROUGHPUT_SECONDS
        started = time.perf_counter()

        async def streamer() -> None:
            nonlocal tokens
            while time.perf_counter() < deadline:
                got = await _streamed_tokens(session, edge, auth, stream)  # not "tokens += await": lost updates
                tokens += got

        await asyncio.gather(*(streamer() for _ in range(64)))
        stream_rate = tokens / (time.perf_counter() - started)

        whole = _body(16, stream=False)
        requests = 0
        deadline = time.perf_counter() + THROUGHPUT_SECONDS
        started = time.perf_counter()

        async def asker() -> None:
            nonlocal requests
            while time.perf_counter() < deadline:
                await _whole(session, edge, auth, whole)
                requests += 1

        await asyncio.gather(*(asker() for _ in range(64)))
        request_rate = requests / (time.perf_counter() - started)
    return [
        ("streaming at concurrency 64, 64 tokens each: tokens/s delivered", f"{stream_rate:,.0f}"),
        ("non-streaming at concurrency 64 (16 tokens): requests/s", f"{request_rate:,.0f}"),
    ]


async def _open_streams(edge: str, key: str, edge_pid: int) -> list[tuple[str, str]]:
    """RSS of the edge with OPEN_STREAMS streams open (the upstream paced at 2 tokens/s)."""
    auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    idle = _rss_mb(edge_pid)
    connector = aiohttp.TCPConnector(limit=OPEN_STREAMS + 10)
    opened = asyncio.Event()
    count = 0

    async def hold(session: aiohttp.ClientSession) -> None:
        nonlocal count
        async with session.post(edge, data=_body(12, stream=True), headers=auth) as response:
            await response.content.readline()
            count += 1
            if count == OPEN_STREAMS:
                opened.set()
            async for _ in response.content:
                pass

    async with aiohttp.ClientSession(connector=connector) as session:
        holders = [asyncio.ensure_future(hold(session)) for _ in range(OPEN_STREAMS)]
        await asyncio.wait_for(opened.wait(), 60)
        rss = _rss_mb(edge_pid)
        await asyncio.gather(*holders)
    return [(f"edge RSS idle / with {OPEN_STREAMS:,} streams open", f"{idle:.0f} / {rss:.0f} MB")]


async def _paced(edge: str, key: str, pids: dict[str, int]) -> list[tuple[str, str]]:
    auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=PACED_STREAMS + 10)
    tokens = int(PACE * PACED_SECONDS)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _streamed_tokens(session, edge, auth, _body(4, stream=True))
        before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
        counts = await asyncio.gather(
            *(_streamed_tokens(session, edge, auth, _body(tokens, stream=True)) for _ in range(PACED_STREAMS))
        )
        used = {name: _cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    delivered = sum(counts)
    per = {name: used[name] / delivered * 1e6 for name in used}
    shown = ", ".join(f"{name} {per[name]:.1f}" for name in ("edge", "control-plane", "node"))
    return [
        (
            f"CPU per streamed token at {PACED_STREAMS} streams x {PACE} tokens/s (sum; per service)",
            f"{sum(per.values()):.1f} us ({shown})",
        )
    ]


USERS_CONCURRENCY, USERS_REQUESTS = 64, 640


def _users_route(upstream: int, state: Path) -> list[tuple[str, str]]:
    """TTFT at concurrency 64 through the platform as ``iop up --backend URL`` starts it (its route, its
    defaults), beside the upstream directly: what a user of a backend that batches gets."""
    url = f"http://127.0.0.1:{upstream}"
    started = subprocess.run(
        [*IOP, "up", "--dir", str(state), "--port", "0", "--backend", url], capture_output=True, text=True, check=True
    )
    try:
        printed = dict(line.split(": ", 1) for line in started.stdout.splitlines() if ": " in line)
        route = yaml.safe_load((state / "node.yaml").read_text())["routes"][0]
        through = asyncio.run(_ttft_at(printed["base URL"] + "/chat/completions", printed["API key"]))
        direct = asyncio.run(_ttft_at(url + "/v1/chat/completions", None))
    finally:
        subprocess.run([*IOP, "down", "--dir", str(state)], capture_output=True, check=False)
    return [
        ("route 'iop up --backend' writes: max_concurrency", str(route.get("max_concurrency", "(node default)"))),
        (
            f"time to first token at concurrency {USERS_CONCURRENCY}, 'iop up --backend' / direct: p50, p99",
            f"{through[0]:.1f}, {through[1]:.1f} / {direct[0]:.1f}, {direct[1]:.1f} ms",
        ),
    ]


async def _ttft_at(url: str, key: str | None) -> tuple[float, float]:
    """p50 and p99 time to first token (ms) of USERS_REQUESTS streams, USERS_CONCURRENCY at once."""
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    body = _body(16, stream=True)
    samples: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=USERS_CONCURRENCY)) as session:

        async def one_by_one(count: int) -> None:
            samples.extend([await _first_token(session, url, headers, body) for _ in range(count)])

        await asyncio.gather(*(one_by_one(USERS_REQUESTS // USERS_CONCURRENCY) for _ in range(USERS_CONCURRENCY)))
    samples.sort()
    return samples[len(samples) // 2] * 1000, samples[int(len(samples) * 0.99)] * 1000


def main() -> None:
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        fast, port = _upstream()
        try:
            with _platform(Path(tmp) / "fast", port) as (pids, edge_port, key):
                edge = f"http://127.0.0.1:{edge_port}/v1/chat/completions"
                direct = f"http://127.0.0.1:{port}/v1/chat/completions"
                rows += asyncio.run(_latency(edge, direct, key))
                rows += asyncio.run(_alternating(edge, direct, key))
                rows += asyncio.run(_latency(edge, direct, key, pause=PAUSE))
                if not LATENCY_ONLY:
                    rows += asyncio.run(_throughput(edge, key, pids))
            if not LATENCY_ONLY:
                rows += _users_route(port, Path(tmp) / "up")
        finally:
            fast.terminate()
        served, port = _upstream(uvicorn=True)
        try:
            with _platform(Path(tmp) / "uvicorn", port) as (pids, edge_port, key):
                edge = f"http://127.0.0.1:{edge_port}/v1/chat/completions"
                direct = f"http://127.0.0.1:{port}/v1/chat/completions"
                rows += asyncio.run(_latency(edge, direct, key, upstream=UVICORN))
                rows += asyncio.run(_alternating(edge, direct, key, upstream=UVICORN))
        finally:
            served.terminate()
        if LATENCY_ONLY:
            print_table(rows)
            return
        paced, port = _upstream(PACE)
        try:
            with _platform(Path(tmp) / "paced", port) as (pids, edge_port, key):
                edge = f"http://127.0.0.1:{edge_port}/v1/chat/completions"
                rows += asyncio.run(_paced(edge, key, pids))
        finally:
            paced.terminate()
        slow, port = _upstream(2)
        try:
            with _platform(Path(tmp) / "slow", port) as (pids, edge_port, key):
                edge = f"http://127.0.0.1:{edge_port}/v1/chat/completions"
                rows += asyncio.run(_open_streams(edge, key, pids["edge"]))
        finally:
            slow.terminate()
    print_table(rows)


if __name__ == "__main__":
    main()
