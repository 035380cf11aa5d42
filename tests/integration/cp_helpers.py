"""Helpers for control-plane tests: its settings, `iop node` processes registered with it, clients."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import yaml
from conftest import Pki, assert_eventually

from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_control_plane.registry import NodeState
from iop_control_plane.settings import Settings
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection, ConnectionConfig, Handler
from iop_wire.endpoint import dial
from iop_wire.errors import IopError
from iop_wire.runs import EventSink
from iop_wire.tls import Role

IOP = [sys.executable, "-m", "iop_cli.main"]
ROUTES: list[dict[str, Any]] = [
    {"model": "mock-small", "adapter": "mock"},
    {"model": "mock-slow", "adapter": "mock", "options": {"tokens": 1000, "tokens_per_second": 20}},
    {"model": "mock-ttft", "adapter": "mock", "options": {"ttft": 1, "tokens": 5}},
]


def cp_settings(pki: Pki, tmp_path: Path, **extra: Any) -> Settings:
    """A control-plane on 127.0.0.1 port 0 with mTLS, fast heartbeats and a fresh audit file."""
    tls = pki.config("cp", Role.CONTROL_PLANE)
    data = {
        "listen": {"port": 0},
        "tls": {"enabled": True, "cert": tls.cert, "key": tls.key, "ca": tls.ca},
        "store_path": tmp_path / "cp.db",
        "heartbeat_interval": 0.5,
        **extra,
    }
    return Settings.model_validate(data)


def cp_config(pki: Pki, folder: Path, **extra: object) -> Path:
    """An `iop control-plane` config file in ``folder``, as :func:`cp_settings` (for a process)."""
    tls = pki.config("cp", Role.CONTROL_PLANE)
    data = {
        "listen": {"port": 0},
        "tls": {"enabled": True, "cert": str(tls.cert), "key": str(tls.key), "ca": str(tls.ca)},
        "store_path": str(folder / "cp.db"),
        "heartbeat_interval": 0.5,
        **extra,
    }
    path = folder / "cp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def node_config(
    pki: Pki, tmp_path: Path, node_id: str, port: int, routes: list[dict[str, Any]] | None = None, **settings: Any
) -> Path:
    """An `iop node` config registering with the control-plane at ``port`` (no listener of its own), serving
    ``routes`` (default: ROUTES), with ``settings`` over it."""
    tls = pki.config(node_id, Role.NODE)
    data = {
        "node_id": node_id,
        "listen": {"enabled": False},
        "tls": {"enabled": True, "cert": str(tls.cert), "key": str(tls.key), "ca": str(tls.ca)},
        "store_path": str(tmp_path / f"{node_id}.db"),
        "heartbeat_interval": 0.5,
        "event_loop": "asyncio",
        "control_plane": {"address": f"127.0.0.1:{port}", "server_name": "localhost", "reconnect_initial": 0.05},
        "routes": ROUTES if routes is None else routes,
        **settings,
    }
    path = tmp_path / f"{node_id}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def admin_certs(pki: Pki, state: Path) -> Path:
    """``state``/certs as `iop certs init` leaves it for an admin (admin.crt, admin.key, ca.crt): the
    state folder `iop nodes ...` reads with ``--dir``."""
    certs = state / "certs"
    certs.mkdir(parents=True)
    tls = pki.config("ops", Role.ADMIN)
    assert tls.cert and tls.key and tls.ca
    for source, name in ((tls.cert, "admin.crt"), (tls.key, "admin.key"), (tls.ca, "ca.crt")):
        shutil.copy(source, certs / name)
    return state


@contextmanager
def node_process(
    pki: Pki, tmp_path: Path, port: int, node_id: str, routes: list[dict[str, Any]], **settings: Any
) -> Iterator[None]:
    """One `iop node` process serving ``routes`` (``settings`` over its config); killed on the way out."""
    config = node_config(pki, tmp_path, node_id, port, routes, **settings)
    process = subprocess.Popen(
        [*IOP, "node", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield
    finally:
        process.kill()
        process.wait(timeout=10)


@asynccontextmanager
async def with_node(
    pki: Pki, tmp_path: Path, routes: list[dict[str, Any]], **settings: Any
) -> AsyncIterator[ControlPlaneApp]:
    """A control-plane (``settings`` over :func:`cp_settings`) with one ready `iop node`, node-a, serving ``routes``."""
    async with build_control_plane(cp_settings(pki, tmp_path, **settings)) as app:
        assert app.listener is not None
        with node_process(pki, tmp_path, app.listener.port, "node-a", routes):
            await all_ready(app, "node-a")
            yield app


@contextmanager
def node_processes(
    pki: Pki, tmp_path: Path, port: int, *node_ids: str, routes: list[dict[str, Any]] | None = None, **settings: Any
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """`iop node` processes by id, serving ``routes`` (default: ROUTES), ``settings`` over their configs; killed
    (if still running) on the way out."""
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for node_id in node_ids:
            config = node_config(pki, tmp_path, node_id, port, routes, **settings)
            command = [*IOP, "node", "--config", str(config)]
            processes[node_id] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        yield processes
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


async def all_ready(app: ControlPlaneApp, *node_ids: str) -> None:
    """Wait until every node is registered and ready."""

    def ready() -> bool:
        nodes = app.registry.nodes
        return all(node_id in nodes and nodes[node_id].state is NodeState.READY for node_id in node_ids)

    await assert_eventually(ready, timeout=20)


async def client(app: ControlPlaneApp, pki: Pki, name: str = "edge-1", role: Role = Role.EDGE) -> Connection:
    assert app.listener is not None
    return await dial(
        "127.0.0.1",
        app.listener.port,
        tls=pki.config(name, role),
        server_hostname="localhost",
        config=ConnectionConfig(heartbeat_interval=0.5),
    )


def sequences(events: list[pb.RunEvent]) -> list[int]:
    return [event.sequence for event in events]


def listening_port(app: ControlPlaneApp) -> int:
    assert app.listener is not None
    return app.listener.port


def one_stream(events: list[pb.RunEvent]) -> None:
    """What a requester must see of a run however many nodes served it: one start first, gapless numbers from 0."""
    assert [event.WhichOneof("event") for event in events].count("start") == 1, events[:2]
    assert events[0].WhichOneof("event") == "start"
    assert sequences(events) == list(range(len(events)))


class BusyNode:
    """A node written with the wire API: registers ``node_id``, then refuses every run RESOURCE_EXHAUSTED
    (retryable), noting the run ids it was sent."""

    def __init__(self, node_id: str, model: str = "mock-small", *, certificate: str | None = None) -> None:
        self.node_id, self.model = node_id, model
        self.certificate = certificate or node_id
        """The name its certificate is issued to (the node id unless given)."""
        self.runs: list[str] = []

    async def run(self, request: pb.RunRequest, sink: EventSink) -> None:
        self.runs.append(request.run_id)
        await sink.error(IopError(pb.ERROR_CODE_RESOURCE_EXHAUSTED, "full"))

    async def register(self, app: ControlPlaneApp, pki: Pki) -> Connection:
        assert app.listener is not None
        connection = await dial(
            "127.0.0.1",
            app.listener.port,
            tls=pki.config(self.certificate, Role.NODE),
            server_hostname="localhost",
            handler=Handler(run=self.run),
            config=ConnectionConfig(heartbeat_interval=0.5),
        )
        model = pb.ModelInfo(name=self.model, max_concurrency=4, available=True)
        adapters = [pb.AdapterInfo(name="fake", models=[model])]
        capabilities = pb.CapabilityResponse(node_id=self.node_id, adapters=adapters)
        status = pb.NodeStatus(models=[pb.ModelLoad(model=self.model, capacity=4, available=True)])
        register = pb.NodeRegister(node_id=self.node_id, capabilities=capabilities, status=status)
        await connection.request(pb.Envelope(node_register=register))
        return connection
