"""OpenAI Batch jobs end to end, and what they cost interactive traffic.

``iop control-plane``, one ``iop node`` (mock model, 1-token answers), ``iop worker`` and ``iop edge``
(API key on) run as processes, once with the worker on SQLite and once on PostgreSQL (a
throwaway server, as ``tests/worker/pg_server.py`` starts it; skipped without initdb/pg_ctl).
The client (aiohttp) runs in this process; on 2 cores everything shares the machine.

Rows, per store: lines/s of a BATCH_LINES-line chat batch, timed from ``POST /v1/batches`` to
status ``completed`` (validation, every line run at priority -10, the output file written);
CPU per line of each service over that time (PostgreSQL's own processes not counted);
interactive streaming TTFT p50 with nothing else running, and while a second such batch is in
progress (checked after the measurement), and their ratio; for PostgreSQL that ratio once more
with the server's processes moved to idle CPU priority (a stand-in for a server on a machine of
its own). Prints a table; asserts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from control_plane_bench import IOP, _wait_ready, stop
from edge_bench import _until_ready
from node_bench import _cpu_seconds
from table import print_table

from iop_edge.keys import create_key
from iop_wire.certs import init_dir, tls_section

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/: the PostgreSQL helper of the store suite
from worker.pg_server import PgServer, find_binaries, pg_server

BATCH_LINES = 10_000
MODEL = "mock-one"
TTFT_SAMPLES = 200
POLL = 0.1
"""Seconds between status polls: each one counts the batch's lines in the worker's store."""
ENDS = {"completed", "failed", "expired", "cancelled"}


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@contextmanager
def _platform(state: Path, store: dict[str, Any]) -> Iterator[tuple[dict[str, int], int, str]]:
    """control-plane, node, worker (``store`` settings) and edge: ({service: pid}, edge port, API key)."""
    certs = state / "certs"
    init_dir(certs)
    processes: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(name: str, config: dict[str, Any]) -> dict[str, Any]:
        ready = state / f"{name}.ready"
        path = _write(state / f"{name}.yaml", {"log_level": "warning", **config})
        command = [*IOP, name, "--config", str(path), "--ready-file", str(ready)]
        with (state / f"{name}.log").open("wb") as log:
            processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        return _wait_ready(ready, processes[name])

    try:
        cp = {"listen": {"port": 0}, "tls": tls_section(certs, "control-plane"), "store_path": str(state / "cp.db")}
        cp_port = int(spawn("control-plane", {**cp, "queue_size": 4096})["port"])
        address = {"address": f"127.0.0.1:{cp_port}", "server_name": "localhost"}
        route = {
            "model": MODEL,
            "adapter": "mock",
            "max_concurrency": 512,
            "queue_size": 4096,
            "options": {"tokens": 1},
        }
        node = {"node_id": "node-0", "listen": {"enabled": False}, "tls": tls_section(certs, "node"), "routes": [route]}
        spawn("node", {**node, "store_path": str(state / "node.db"), "control_plane": address})
        worker = {"listen": {"port": 0}, "tls": tls_section(certs, "worker"), "control_plane": address, "store": store}
        worker_port = int(spawn("worker", worker)["port"])
        edge = {
            "http": {"port": 0},
            "control_plane": address,
            "worker": {"address": f"127.0.0.1:{worker_port}", "server_name": "localhost"},
            "tls": tls_section(certs, "edge"),
            "auth": "keys",
            "keys_path": str(state / "keys.db"),
        }
        key = create_key(state / "keys.db", "bench")
        edge_port = int(spawn("edge", edge)["port"])
        _until_ready(edge_port)
        yield {name: process.pid for name, process in processes.items()}, edge_port, key
    finally:
        stop(list(processes.values()))


def _batch_file() -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    lines = (
        json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        for i in range(BATCH_LINES)
    )
    return "".join(f"{line}\n" for line in lines).encode()


class _Client:
    """The edge's Files, Batches and chat endpoints over one aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, port: int, key: str) -> None:
        self.session, self.base = session, f"http://127.0.0.1:{port}/v1"
        self.auth = {"authorization": f"Bearer {key}"}

    async def _json(self, method: str, path: str, **options: Any) -> dict[str, Any]:
        async with self.session.request(method, self.base + path, headers=self.auth, **options) as response:
            answer: dict[str, Any] = await response.json()
            if response.status != 200:
                raise RuntimeError(f"{method} {path}: HTTP {response.status}: {answer}")
            return answer

    async def upload(self, data: bytes) -> str:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data, filename="batch.jsonl", content_type="application/jsonl")
        return str((await self._json("POST", "/files", data=form))["id"])

    async def create(self, file_id: str) -> str:
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        return str((await self._json("POST", "/batches", json=body))["id"])

    async def batch(self, batch_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/batches/{batch_id}")

    async def cancel(self, batch_id: str) -> None:
        with contextlib.suppress(RuntimeError):  # it may have ended already
            await self._json("POST", f"/batches/{batch_id}/cancel")

    async def until(self, batch_id: str, *, completed: int = 0, timeout: float = 300.0) -> dict[str, Any]:
        """The batch once ``completed`` lines are done (any number: once it has ended)."""
        deadline = time.monotonic() + timeout
        while True:
            batch = await self.batch(batch_id)
            reached = batch["request_counts"]["completed"] >= completed if completed else batch["status"] in ENDS
            if reached:
                return batch
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch_id} not there in {timeout} s: {batch['request_counts']}")
            await asyncio.sleep(POLL)

    async def first_token(self) -> float:
        """Seconds to the first content chunk of a streamed 1-token chat; the rest is read."""
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "stream": True}
        started = time.perf_counter()
        first = None
        async with self.session.post(f"{self.base}/chat/completions", json=body, headers=self.auth) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
            async for line in response.content:
                if first is None and b'"content":"' in line and b'"content":""' not in line:
                    first = time.perf_counter() - started
        if first is None:
            raise RuntimeError("no token")
        return first

    async def ttft_p50(self, samples: int = TTFT_SAMPLES) -> float:
        times = [await self.first_token() for _ in range(samples)]
        return sorted(times)[len(times) // 2]


async def _measure(
    pids: dict[str, int], port: int, key: str, label: str, then: Callable[[], str] | None = None
) -> list[tuple[str, str]]:
    """The rows of one platform; ``then`` (if any) changes something and the TTFT row is measured again."""
    data = _batch_file()
    async with aiohttp.ClientSession() as session:
        client = _Client(session, port, key)
        await client.ttft_p50(20)  # warm up
        idle = await client.ttft_p50()
        file_id = await client.upload(data)
        before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
        started = time.perf_counter()
        batch_id = await client.create(file_id)
        done = await client.until(batch_id)
        elapsed = time.perf_counter() - started
        used = {name: (_cpu_seconds(pid) - before[name]) / BATCH_LINES * 1e6 for name, pid in pids.items()}
        counts = done["request_counts"]
        if done["status"] != "completed" or counts["completed"] != BATCH_LINES:
            raise RuntimeError(f"batch ended {done['status']}: {counts}")
        rows = [
            (f"{label}: {BATCH_LINES:,}-line chat batch, create to completed", f"{BATCH_LINES / elapsed:,.0f} lines/s"),
            (f"{label}: CPU per line (sum; per service)", f"{sum(used.values()):.0f} us ({_per_service(used)})"),
            await _interactive(client, data, idle, f"{label}: interactive TTFT p50 idle / during a batch"),
        ]
        if then is not None:
            how = then()
            rows.append(await _interactive(client, data, idle, f"{label}, {how}: interactive TTFT p50 idle / during"))
    return rows


def _per_service(used: dict[str, float]) -> str:
    """CPU per line of each service, for the table."""
    return ", ".join(f"{name} {used[name]:.0f}" for name in used)


async def _interactive(client: _Client, data: bytes, idle: float, label: str) -> tuple[str, str]:
    """The TTFT row: p50 while a second batch runs (checked after), against ``idle``."""
    second = await client.create(await client.upload(data))
    await client.until(second, completed=BATCH_LINES // 10)  # past validation, lines running
    during = await client.ttft_p50()
    still = (await client.batch(second))["status"]
    await client.cancel(second)
    await client.until(second)
    note = "" if still == "in_progress" else f" (batch {still} before the end: not all during)"
    value = f"{idle * 1000:.2f} / {during * 1000:.2f} ms ({during / idle:.2f}x)"
    return f"{label} ({TTFT_SAMPLES} each){note}", value


def _idle_postgres(server: PgServer) -> str:
    """Put the server's processes at idle CPU priority, as if PostgreSQL had a machine of its own."""
    assert server.data is not None
    postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
    pids = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                    pids.append(int(entry.name))
    try:
        for pid in pids:
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except PermissionError:
        return "its server's priority unchanged (not permitted)"
    return "its server at idle CPU priority"


def main() -> None:
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        sqlite_store = {"path": str(Path(tmp) / "sqlite" / "worker.db")}
        with _platform(Path(tmp) / "sqlite", sqlite_store) as (pids, port, key):
            rows += asyncio.run(_measure(pids, port, key, "SQLite"))
        binaries = find_binaries()
        if binaries is None:
            rows.append(("PostgreSQL", "skipped: no initdb/pg_ctl"))
        else:
            with pg_server(binaries) as server, _platform(Path(tmp) / "pg", {"url": server.url()}) as (pids, port, key):
                idle = functools.partial(_idle_postgres, server)
                rows += asyncio.run(_measure(pids, port, key, "PostgreSQL", then=idle))
    print_table(rows)


if __name__ == "__main__":
    main()
