"""Helpers for the control-plane policy tests: `iop node` processes with routes of their own, runs, timing."""

from __future__ import annotations

import asyncio
import datetime
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from conftest import Pki
from cp_helpers import IOP, node_config
from google.protobuf.timestamp_pb2 import Timestamp

from iop_control_plane.bootstrap import ControlPlaneApp
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection

Routes = list[dict[str, Any]]


def cp_port(app: ControlPlaneApp) -> int:
    assert app.listener is not None
    return app.listener.port


def write_policy(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


def start_node(pki: Pki, tmp_path: Path, port: int, node_id: str, routes: Routes) -> subprocess.Popen[bytes]:
    """An `iop node` registering with the control-plane at ``port``, serving ``routes`` (same config each time)."""
    config = node_config(pki, tmp_path, node_id, port)
    data = yaml.safe_load(config.read_text())
    data["routes"] = routes
    config.write_text(yaml.safe_dump(data))
    return subprocess.Popen(
        [*IOP, "node", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


class Nodes(dict[str, subprocess.Popen[bytes]]):
    """Node processes by id, each restartable with the routes it was first started with."""

    def __init__(self, pki: Pki, tmp_path: Path, port: int) -> None:
        super().__init__()
        self.pki, self.tmp_path, self.port = pki, tmp_path, port
        self.routes: dict[str, Routes] = {}

    def start(self, node_id: str, routes: Routes | None = None) -> subprocess.Popen[bytes]:
        if routes is not None:
            self.routes[node_id] = routes
        process = self[node_id] = start_node(self.pki, self.tmp_path, self.port, node_id, self.routes[node_id])
        return process

    def stop_all(self) -> None:
        for process in self.values():
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


@contextmanager
def nodes_serving(pki: Pki, tmp_path: Path, port: int, routes: Mapping[str, Routes]) -> Iterator[Nodes]:
    """`iop node` processes by id, each serving its own routes; killed (if still running) on the way out."""
    nodes = Nodes(pki, tmp_path, port)
    try:
        for node_id, node_routes in routes.items():
            nodes.start(node_id, node_routes)
        yield nodes
    finally:
        nodes.stop_all()


def deadline_in(seconds: float) -> Timestamp:
    deadline = Timestamp()
    deadline.FromDatetime(datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds))
    return deadline


@dataclass
class Timed:
    """A run's events and the monotonic time each arrived (and when it was opened)."""

    opened: float
    events: list[pb.RunEvent] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        return [str(event.WhichOneof("event")) for event in self.events]

    @property
    def node(self) -> str:
        assert self.kinds and self.kinds[0] == "start", self.events[:1]
        return self.events[0].start.node_id

    def first(self, kind: str) -> float:
        return self.times[self.kinds.index(kind)]

    @property
    def ended(self) -> float:
        return self.times[-1]


async def timed_run(connection: Connection, request: pb.RunRequest) -> Timed:
    """Open ``request`` and read it to the end, timing each event."""
    result = Timed(time.monotonic())
    async for event in await connection.open_run(request):
        result.events.append(event)
        result.times.append(time.monotonic())
    return result


async def bounded(limit: int, jobs: list[Any]) -> list[Any]:
    """Await the coroutines in ``jobs``, at most ``limit`` at a time, results in order."""
    gate = asyncio.Semaphore(limit)

    async def one(job: Any) -> Any:
        async with gate:
            return await job

    return await asyncio.gather(*(one(job) for job in jobs))
