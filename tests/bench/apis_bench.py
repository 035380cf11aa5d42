"""What each client API costs over the same run: chat completions, Responses and Messages (issue 25).

Starts the platform as ``iop up`` does (its mock models, every default) and sends the same
request, one user message and an 8-token answer from ``mock-fast`` (unpaced: the platform's own
time is what is left), through each API: whole
answers one at a time (latency p50/p99 and the edge's ``x-iop-overhead-ms``), streams one at a
time (time to the first output event p50), a tool call (the mock calls the one function tool),
and whole answers 32 at a time (requests/s). The three map onto one run underneath; what differs is
the edge's mapping and rendering, which this shows. Responses are stored (``store`` is true by
default, as OpenAI's), so their rows include the store's write. Prints a table, asserts nothing.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from control_plane_bench import IOP
from table import print_table

SEQUENTIAL = 300
CONCURRENT, CONCURRENT_REQUESTS = 32, 1600
MODEL = "mock-fast"
TOKENS = 8
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _requests(*, stream: bool, tools: bool) -> dict[str, tuple[str, dict[str, Any]]]:
    """The same question through each API: (path, body)."""
    chat: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": TOKENS,
        "stream": stream,
    }
    responses: dict[str, Any] = {"model": MODEL, "input": "hello there", "max_output_tokens": TOKENS, "stream": stream}
    messages: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": TOKENS,
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": stream,
    }
    if tools:
        chat["tools"] = [{"type": "function", "function": TOOL}]
        responses["tools"] = [{"type": "function", **TOOL}]
        messages["tools"] = [
            {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
        ]
    return {
        "chat completions": ("/v1/chat/completions", chat),
        "Responses": ("/v1/responses", responses),
        "Messages": ("/v1/messages", messages),
    }


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], *, stream: bool
) -> tuple[float, float]:
    """(seconds to the whole answer, or to the first output event when streaming; x-iop-overhead-ms)."""
    began = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as answer:
        if answer.status != 200:
            raise RuntimeError(f"{url}: {answer.status} {await answer.text()}")
        overhead = float(answer.headers.get("x-iop-overhead-ms", "nan"))
        if not stream:
            await answer.read()
            return time.perf_counter() - began, overhead
        first = 0.0
        async for line in answer.content:
            if not first and (b"delta" in line or b'"content":"' in line) and line.startswith(b"data:"):
                first = time.perf_counter() - began
        return first, overhead


async def _sequential(base: str, key: str, *, stream: bool, tools: bool) -> dict[str, list[tuple[float, float]]]:
    headers = {"authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"}
    samples: dict[str, list[tuple[float, float]]] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for name, (path, body) in _requests(stream=stream, tools=tools).items():
            for _ in range(20):  # warm up
                await _one(session, base + path, body, headers, stream=stream)
            samples[name] = [await _one(session, base + path, body, headers, stream=stream) for _ in range(SEQUENTIAL)]
    return samples


async def _throughput(base: str, key: str) -> dict[str, float]:
    headers = {"authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"}
    rates: dict[str, float] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONCURRENT)) as session:
        for name, (path, body) in _requests(stream=False, tools=False).items():
            gate = asyncio.Semaphore(CONCURRENT)

            async def one(path: str = path, body: dict[str, Any] = body, gate: asyncio.Semaphore = gate) -> None:
                async with gate:
                    await _one(session, base + path, body, headers, stream=False)

            began = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(CONCURRENT_REQUESTS)))
            rates[name] = CONCURRENT_REQUESTS / (time.perf_counter() - began)
    return rates


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "up"
        started = subprocess.run(
            [*IOP, "up", "--dir", str(state), "--port", "0"], capture_output=True, text=True, check=True
        )
        try:
            printed = dict(line.split(": ", 1) for line in started.stdout.splitlines() if ": " in line)
            base, key = printed["base URL"].removesuffix("/v1"), printed["API key"]
            whole = asyncio.run(_sequential(base, key, stream=False, tools=False))
            streamed = asyncio.run(_sequential(base, key, stream=True, tools=False))
            tools = asyncio.run(_sequential(base, key, stream=False, tools=True))
            rates = asyncio.run(_throughput(base, key))
        finally:
            subprocess.run([*IOP, "down", "--dir", str(state)], capture_output=True, check=False)
    rows = []
    for name in whole:
        times = [seconds * 1000 for seconds, _ in whole[name]]
        overheads = [overhead for _, overhead in whole[name]]
        rows.append(
            (
                f"{name}: whole answer, one at a time: p50, p99 (x-iop-overhead-ms p50)",
                f"{_p(times, 50):.2f}, {_p(times, 99):.2f} ms ({statistics.median(overheads):.2f})",
            )
        )
    for name in streamed:
        firsts = [seconds * 1000 for seconds, _ in streamed[name]]
        rows.append((f"{name}: stream, first output event p50, p99", f"{_p(firsts, 50):.2f}, {_p(firsts, 99):.2f} ms"))
    for name in tools:
        times = [seconds * 1000 for seconds, _ in tools[name]]
        rows.append((f"{name}: a tool call, whole answer p50", f"{_p(times, 50):.2f} ms"))
    for name, rate in rates.items():
        rows.append((f"{name}: whole answers, {CONCURRENT} at a time", f"{rate:,.0f} requests/s"))
    print_table(rows)


if __name__ == "__main__":
    main()
