"""The platform laid out for high availability, as real processes: one PostgreSQL (``pg_server.py``),
two control-planes sharing it (``store.url``), three nodes and two edges given both
(``control_plane.addresses``), the edges sharing their keys and limits in it, behind a real nginx
(Debian's package) started as a subprocess with a config written in the test's folder.

:class:`Streamer` is one client's loop of streamed chats through nginx, each recorded (when it
started and ended, how it ended, its run id and the edge that served it) for the tests to judge.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx2 as httpx
import pytest
from worker.pg_server import PgServer, create_database

from iop_wire.certs import init_dir, tls_section

from .conftest import IOP, START_TIMEOUT, Process, _pin_port, _spawn, _write, wait_for

NODES = ("node-a", "node-b", "node-c")
ROUTES: list[dict[str, Any]] = [
    {
        "model": "mock-small",
        "adapter": "mock",
        "max_concurrency": 32,
        "options": {"tokens": 8, "tokens_per_second": 200},
    },
    {  # 3 s, the first second before any output: a kill meets runs on both sides of their first token
        "model": "mock-stream",
        "adapter": "mock",
        "max_concurrency": 32,
        "options": {"ttft": 1.0, "tokens": 40, "tokens_per_second": 20},
    },
    {
        "model": "mock-long",
        "adapter": "mock",
        "max_concurrency": 32,
        "options": {"tokens": 1200, "tokens_per_second": 20},
    },
]
GO = [{"role": "user", "content": "go"}]
RETRYABLE = {"node_lost"}
"""The error codes a stream may end with that tell the client to send the request again."""


def nginx_binary() -> Path:
    """nginx (PATH, then Debian's /usr/sbin); skipped naming the package when missing (failed in CI,
    where ``IOP_BACKENDS_REQUIRED=1``)."""
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if found is None:
        reason = "nginx is not installed (Debian: apt-get install nginx)"
        if os.environ.get("IOP_BACKENDS_REQUIRED") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return Path(found)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


_NGINX = """\
{user}worker_processes 1;
daemon off;
pid {root}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log {root}/nginx-access.log;
    client_body_temp_path {root}/nginx-body;
    proxy_temp_path {root}/nginx-proxy;
    fastcgi_temp_path {root}/nginx-fastcgi;
    uwsgi_temp_path {root}/nginx-uwsgi;
    scgi_temp_path {root}/nginx-scgi;
    upstream edges {{
{servers}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://edges;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;                  # SSE: each chunk goes out as it arrives
            proxy_next_upstream error timeout;    # a refused connection: the next edge
            proxy_connect_timeout 2s;
            proxy_read_timeout 120s;
            add_header X-Iop-Edge $upstream_addr always;
        }}
    }}
}}
"""


@contextmanager
def nginx(root: Path, edge_ports: list[int]) -> Iterator[int]:
    """nginx on a loopback port in front of the edges (round robin); its port. Stopped on exit."""
    binary = nginx_binary()
    folder = root / "nginx"
    folder.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    servers = "\n".join(f"        server 127.0.0.1:{edge};" for edge in edge_ports)
    user = "user root;\n" if os.geteuid() == 0 else ""  # else its workers switch to nobody, barred from our folder
    config = folder / "nginx.conf"
    config.write_text(_NGINX.format(user=user, root=folder, servers=servers, port=port))
    log = (folder / "nginx.log").open("ab")
    command = [str(binary), "-p", str(folder), "-c", str(config), "-e", str(folder / "error.log")]
    popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:

        def listening() -> bool:
            if popen.poll() is not None:
                pytest.fail(f"nginx exited with {popen.returncode}: {(folder / 'error.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
            return False

        wait_for(listening, START_TIMEOUT, 0.05, "nginx listening")
        yield port
    finally:
        popen.terminate()
        try:
            popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=10)
        log.close()


@dataclass
class Platform:
    """The running processes, their ports, the database's URL and nginx's port."""

    root: Path
    server: PgServer
    url: str
    control_planes: dict[str, Process]
    cp_ports: dict[str, int]
    nodes: dict[str, Process]
    edges: dict[str, Process]
    edge_ports: dict[str, int]
    nginx_port: int = 0
    key: str = ""

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.nginx_port}"

    def keys(self, *args: str) -> str:
        """``iop keys ... --store-url`` on the shared store; what it printed."""
        command = [*IOP, "keys", *args, "--store-url", self.url]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def admin(self, control_plane: str, *args: str) -> str:
        """An admin command (``iop nodes|policy ...``) against one control-plane; what it printed."""
        address = f"127.0.0.1:{self.cp_ports[control_plane]}"
        command = [*IOP, *args, "--control-plane", address, "--certs", str(self.root / "certs")]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def ready_nodes(self, control_plane: str) -> set[str]:
        listed = json.loads(self.admin(control_plane, "nodes", "ls", "--json"))
        return {node["node_id"] for node in listed if node.get("state") == "ready"}

    def edge_ready(self, edge: str) -> dict[str, Any]:
        response = httpx.get(f"http://127.0.0.1:{self.edge_ports[edge]}/ready", timeout=5)
        return dict(response.json()) if response.status_code == 200 else {}

    def node_runs(self, model: str) -> dict[str, tuple[str, float | None]]:
        """The runs of ``model`` in the nodes' history (their SQLite files): the edge's run id (the
        node's is ``<connection>.<edge's>.<choice>``) -> its status and when it finished (unix time)."""
        found: dict[str, tuple[str, float | None]] = {}
        query = "SELECT run_id, status, finished_at FROM runs WHERE model = ?"
        for node_id in self.nodes:
            with (
                contextlib.suppress(sqlite3.Error),
                sqlite3.connect(f"file:{self.root / node_id}.db?mode=ro", uri=True, timeout=5) as db,
            ):
                found.update((run.split(".")[1], (status, at)) for run, status, at in db.execute(query, [model]))
        return found

    def running(self, model: str) -> int:
        return sum(status == "running" for status, _ in self.node_runs(model).values())

    async def ledger(self) -> list[tuple[str, str]]:
        """The run ledger in PostgreSQL: (run id, status) per row, every row."""
        connection = await asyncpg.connect(self.url)
        try:
            rows = await connection.fetch("SELECT run_id, status FROM runs")
        finally:
            await connection.close()
        return [(row[0], row[1]) for row in rows]

    async def scalar(self, sql: str, *args: object) -> Any:
        connection = await asyncpg.connect(self.url)
        try:
            return await connection.fetchval(sql, *args)
        finally:
            await connection.close()


def _upstream(ports: dict[str, int]) -> dict[str, Any]:
    return {"addresses": [f"127.0.0.1:{port}" for port in ports.values()], "server_name": "localhost"}


def _start_control_planes(root: Path, url: str, stopping: ExitStack) -> tuple[dict[str, Process], dict[str, int]]:
    processes, ports = {}, {}
    for name in ("cp-a", "cp-b"):
        settings = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "tls": tls_section(root / "certs", "control-plane"),
            "store": {"url": url},
            "heartbeat_interval": 0.5,
        }
        config = _write(root / f"{name}.yaml", settings)
        processes[name] = _spawn(root, name, "control-plane", config)
        stopping.callback(processes[name].stop)
    for name, process in processes.items():
        ports[name] = int(process.wait_ready()["port"])
        _pin_port(root / f"{name}.yaml", "listen", ports[name])
    return processes, ports


def _start_nodes(root: Path, cp_ports: dict[str, int], stopping: ExitStack) -> dict[str, Process]:
    processes = {}
    for node_id in NODES:
        settings = {
            "node_id": node_id,
            "listen": {"enabled": False},
            "control_plane": {**_upstream(cp_ports), "reconnect_initial": 0.05},
            "tls": tls_section(root / "certs", "node"),
            "store_path": str(root / f"{node_id}.db"),
            "heartbeat_interval": 0.5,
            "routes": ROUTES,
        }
        processes[node_id] = _spawn(root, node_id, "node", _write(root / f"{node_id}.yaml", settings))
        stopping.callback(processes[node_id].stop)
    return processes


def _start_edges(root: Path, url: str, cp_ports: dict[str, int], stopping: ExitStack) -> dict[str, Process]:
    processes = {}
    for name in ("edge-a", "edge-b"):
        settings = {
            "http": {"host": "127.0.0.1", "port": 0},
            "control_plane": {**_upstream(cp_ports), "capabilities_ttl": 0, "reconnect_initial": 0.05},
            "tls": tls_section(root / "certs", "edge"),
            "auth": "keys",
            "store": {"url": url},
        }
        processes[name] = _spawn(root, name, "edge", _write(root / f"{name}.yaml", settings))
        stopping.callback(processes[name].stop)
    return processes


@contextmanager
def platform(root: Path, server: PgServer, database: str) -> Iterator[Platform]:
    """Everything started, registered and connected, nginx in front, an API key ``ha`` made; stopped on exit."""
    import asyncio

    root.mkdir(parents=True, exist_ok=True)
    init_dir(root / "certs")
    url = server.url(asyncio.run(create_database(server, database)))
    with ExitStack() as stopping:
        control_planes, cp_ports = _start_control_planes(root, url, stopping)
        nodes = _start_nodes(root, cp_ports, stopping)
        edges = _start_edges(root, url, cp_ports, stopping)
        edge_ports = {name: int(process.wait_ready()["port"]) for name, process in edges.items()}
        for node in nodes.values():
            node.wait_ready()
        started = Platform(root, server, url, control_planes, cp_ports, nodes, edges, edge_ports)
        for name in control_planes:
            wait_for(lambda name=name: started.ready_nodes(name) == set(NODES), START_TIMEOUT, 0.2, f"nodes on {name}")
        connected = 2 * len(control_planes)  # control_plane.connections (2) to each
        for name in edges:
            wait_for(
                lambda name=name: started.edge_ready(name).get("control_plane_connections") == connected,
                START_TIMEOUT,
                0.05,
                f"{name} connected to both control-planes",
            )
        started.key = started.keys("create", "ha")
        started.nginx_port = stopping.enter_context(nginx(root, list(edge_ports.values())))
        wait_for(lambda: _served(started), START_TIMEOUT, 0.1, "the key served through nginx")
        yield started


def _served(started: Platform) -> bool:
    headers = {"authorization": f"Bearer {started.key}"}
    return all(httpx.get(f"{started.base}/v1/models", headers=headers, timeout=5).status_code == 200 for _ in range(4))


@dataclass
class Outcome:
    """One streamed request as its client saw it."""

    started: float
    ended: float = 0.0
    status: int = 0
    end: str = ""
    """``done``, an error event's code, ``http_<status>``, ``cut`` (the connection closed mid-stream)
    or ``timeout`` (nothing for ``read_timeout`` seconds: a hang)."""
    run_id: str = ""
    edge: str = ""
    """The edge nginx sent it to (``host:port``)."""
    first_byte: float = 0.0
    """Seconds from sending to the response's head."""
    text: str = ""
    """The content streamed."""


def stream_once(http: httpx.Client, model: str, outcome: Outcome, stop: threading.Event | None = None) -> Outcome:
    """Send one streamed chat through ``http`` and fill ``outcome`` with how it ended; leave it
    (``left``, the client gone) once ``stop`` is set."""
    body = {"model": model, "messages": GO, "stream": True}
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            outcome.first_byte = time.monotonic() - outcome.started
            outcome.status = response.status_code
            outcome.run_id = response.headers.get("x-request-id", "")
            outcome.edge = response.headers.get("x-iop-edge", "")
            if response.status_code != 200:
                response.read()
                outcome.end = f"http_{response.status_code}"
            else:
                outcome.end = _read_stream(response, outcome, stop)
    except httpx.TimeoutException:
        outcome.end = "timeout"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError):
        outcome.end = "cut"
    outcome.ended = time.monotonic()
    return outcome


def _read_stream(response: httpx.Response, outcome: Outcome, stop: threading.Event | None) -> str:
    """How a 200 stream ended: ``done``, its error event's code, or ``left``."""
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            return "done"
        chunk = json.loads(payload)
        if "error" in chunk:
            return str(chunk["error"].get("code"))
        for choice in chunk.get("choices") or []:
            outcome.text += choice["delta"].get("content") or ""
        if stop is not None and stop.is_set():
            return "left"
    return "cut"  # closed without [DONE] nor an error event


@dataclass
class Streamer:
    """One client sending streamed chats one after another until told to stop; every request recorded."""

    base: str
    key: str
    model: str
    read_timeout: float = 30.0
    delay: float = 0.0
    """Seconds to wait before the first request (clients started apart meet a kill in every phase of a run)."""
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    """Send no more requests."""
    leave: threading.Event = field(default_factory=threading.Event)
    """Leave the stream in progress too (the client goes away, which cancels its run)."""

    def run(self, count: int | None = None) -> list[Outcome]:
        """Send requests until :attr:`stop` is set (or ``count`` of them); the outcomes."""
        headers = {"authorization": f"Bearer {self.key}"}
        timeout = httpx.Timeout(self.read_timeout, connect=5.0)
        self.stop.wait(self.delay)
        with httpx.Client(base_url=self.base, headers=headers, timeout=timeout) as http:
            for _ in itertools.repeat(None) if count is None else range(count):
                if self.stop.is_set():
                    break
                outcome = Outcome(time.monotonic())
                self.outcomes.append(outcome)  # seen while in progress: its edge and run id once its head came
                stream_once(http, self.model, outcome, self.leave)
        return self.outcomes


@contextmanager
def sending(streamers: list[Streamer]) -> Iterator[None]:
    """Each streamer sending on a thread of its own until the block ends; then stopped, and every
    request it had in progress waited for (bounded by its read timeout: none may hang)."""
    with ThreadPoolExecutor(len(streamers)) as pool:
        running = [pool.submit(streamer.run) for streamer in streamers]
        try:
            yield
        finally:
            for streamer in streamers:
                streamer.stop.set()
            for future in running:
                future.result(timeout=2 * max(streamer.read_timeout for streamer in streamers))
