"""The whole platform as ``iop up`` starts it: real ``iop control-plane``, ``iop node`` and ``iop edge``
processes over mTLS (certificates from ``iop certs init``), on 127.0.0.1 port 0, driven over HTTP.

``stack`` (module-scoped) serves the mock models below from one node; tests that kill a node
start their own with :func:`running_stack`. Everything a process printed is in ``<root>/<name>.log``
and shown when it fails to start.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
import yaml

from iop_edge.keys import create_key
from iop_wire.certs import init_dir, tls_section

IOP = [sys.executable, "-m", "iop_cli.main"]
START_TIMEOUT = 60.0
"""How long a service may take to start: a bound on waiting, not a figure (importing the edge took 9 s
on a 2-core host at load 9)."""
MOCK_ROUTES: list[dict[str, Any]] = [
    {"model": "mock-small", "adapter": "mock", "options": {"tokens": 8, "tokens_per_second": 200}},
    {"model": "mock-slow", "adapter": "mock", "options": {"tokens": 1000, "tokens_per_second": 20}},
    {"model": "mock-ttft", "adapter": "mock", "options": {"ttft": 1, "tokens": 5}},
]


def wait_for(condition: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01, what: str = "") -> Any:
    """Poll ``condition`` until it returns something truthy (returned), failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout} s")
        time.sleep(interval)
    return result


@dataclass
class Process:
    """One ``iop`` service process and its files."""

    name: str
    root: Path
    popen: subprocess.Popen[bytes]
    service: str = ""
    """The ``iop`` subcommand it runs, for :meth:`restart`."""

    @property
    def log(self) -> Path:
        return self.root / f"{self.name}.log"

    @property
    def ready_file(self) -> Path:
        return self.root / f"{self.name}.ready"

    def wait_ready(self) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            if self.popen.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.popen.returncode}:\n{self.log.read_text()[-3000:]}")
            return json.loads(self.ready_file.read_text()) if self.ready_file.exists() else None

        return wait_for(ready, START_TIMEOUT, 0.02, f"{self.name} ready file")  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL: the process ends with no goodbye (a crashed machine, as far as peers can tell)."""
        self.popen.kill()
        self.popen.wait(timeout=10)

    def restart(self) -> dict[str, Any]:
        """Start it again with the same config (same port, same store) once it has ended; its ready file."""
        assert self.popen.poll() is not None, f"{self.name} is still running"
        self.ready_file.unlink(missing_ok=True)  # a killed process leaves its ready file behind
        self.popen = _spawn(self.root, self.name, self.service, self.root / f"{self.name}.yaml").popen
        return self.wait_ready()


@dataclass
class Stack:
    """A running control-plane, its nodes and an edge, plus an API key."""

    root: Path
    cp_port: int
    edge_port: int
    key: str
    nodes: dict[str, Process] = field(default_factory=dict)
    opened: list[openai.OpenAI | httpx.Client] = field(default_factory=list)
    worker: Process | None = None
    """The worker, when the stack has one."""
    more_workers: list[Process] = field(default_factory=list)
    """Workers started by :meth:`add_worker`, stopped with the stack."""
    control_plane: Process | None = None
    """The control-plane process (its port is pinned in its config: a restart binds ``cp_port`` again)."""
    edge: Process | None = None
    """The edge process."""

    @property
    def certs(self) -> Path:
        return self.root / "certs"

    @property
    def keys_path(self) -> Path:
        return self.root / "edge-keys.db"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.edge_port}/v1"

    def new_key(self, name: str, **limits: Any) -> str:
        """A new API key (the edge reads the key file about every second: poll before relying on it)."""
        return create_key(self.keys_path, name, **limits)

    def client(self, key: str | None = None, **options: Any) -> openai.OpenAI:
        """The official SDK pointed at the edge; no retries, so every error is seen as sent."""
        options.setdefault("max_retries", 0)
        options.setdefault("timeout", 30.0)
        client = openai.OpenAI(base_url=self.base_url, api_key=key or self.key, **options)
        self.opened.append(client)
        return client

    def http(self, key: str | None = None) -> httpx.Client:
        """A plain HTTP client with the key, for raw bodies and SSE lines."""
        headers = {"authorization": f"Bearer {key or self.key}"}
        client = httpx.Client(base_url=self.base_url, headers=headers, timeout=30.0)
        self.opened.append(client)
        return client

    def close(self) -> None:
        """Close every client handed out; stop the workers added by :meth:`add_worker`."""
        for client in self.opened:
            client.close()
        self.opened.clear()
        for process in self.more_workers:
            process.stop()

    def add_worker(self, name: str, settings: dict[str, Any]) -> Process:
        """Another worker on this control-plane (the edge does not talk to it), ready."""
        upstream = {"address": f"127.0.0.1:{self.cp_port}", "server_name": "localhost"}
        process = _start_worker(self.root, name, upstream, settings)
        self.more_workers.append(process)
        return process

    def node_db(self, node_id: str) -> Path:
        return self.root / f"{node_id}.db"

    def runs(self, node_id: str) -> list[dict[str, Any]]:
        """The node's run history, as ``iop runs ls --json`` prints it."""
        command = [*IOP, "runs", "ls", "--db", str(self.node_db(node_id)), "--json", "--limit", "1000"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
        listed: list[dict[str, Any]] = json.loads(result.stdout)
        return listed

    def running(self, model: str, caller: str | None = None) -> str | None:
        """The live node (id) with a run of ``model`` (by ``caller``) in progress, read straight from its SQLite file.

        A killed node's records stay ``running``: its process is skipped.
        """
        query, args = "SELECT 1 FROM runs WHERE model = ? AND status = 'running'", [model]
        if caller is not None:
            query, args = query + " AND caller = ?", [model, caller]
        for node_id, process in self.nodes.items():
            if process.popen.poll() is not None:
                continue
            try:
                with sqlite3.connect(f"file:{self.node_db(node_id)}?mode=ro", uri=True) as db:
                    found = db.execute(query, args).fetchone()
            except sqlite3.Error:
                continue
            if found:
                return node_id
        return None

    def run(self, node_id: str, request_id: str | None = None, caller: str | None = None) -> dict[str, Any] | None:
        """The node's record (``iop runs ls --json``) of the run of this x-request-id or caller, if any."""
        for record in self.runs(node_id):
            if (request_id is None or request_id in record["run_id"]) and caller in (None, record["caller"]):
                return record
        return None

    def admin(self, *args: str) -> subprocess.CompletedProcess[str]:
        """An ``iop nodes ...`` admin command against the control-plane, with the admin certificate."""
        command = [*IOP, "nodes", *args, "--control-plane", f"127.0.0.1:{self.cp_port}", "--certs", str(self.certs)]
        return subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)

    def edge_metric(self, series: str) -> float:
        """The value of one series of the edge's /metrics (``name{labels}`` as printed; 0 when absent)."""
        text = httpx.get(self.base_url.removesuffix("/v1") + "/metrics", timeout=5).text
        return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(series + " ")), 0.0)

    def refused(self, limit: str) -> float:
        """The edge's ``iop_edge_refused_total`` for ``limit``."""
        return self.edge_metric(f'iop_edge_refused_total{{limit="{limit}"}}')

    def worker_connected(self) -> bool:
        """The edge has a connection up to its worker (``/ready`` counts them)."""
        response = httpx.get(self.base_url.removesuffix("/v1") + "/ready", timeout=5)
        return bool(response.json().get("worker_connections"))

    def served(self) -> set[str]:
        response = httpx.get(f"{self.base_url}/models", headers={"authorization": f"Bearer {self.key}"}, timeout=5)
        return {model["id"] for model in response.json().get("data", [])} if response.status_code == 200 else set()


ENDS = {"completed", "failed", "expired", "cancelled"}
"""The statuses a batch ends in."""


def batch_ended(client: openai.OpenAI, batch_id: str, timeout: float = 30.0) -> Any:
    """The batch once it has ended (a status in ``ENDS``), asked every 0.1 s; errors of a worker or
    control-plane restarting behind the edge count as not yet."""

    def ended() -> Any:
        try:
            batch = client.batches.retrieve(batch_id)
        except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
            return None  # the worker behind the edge is restarting
        return batch if batch.status in ENDS else None

    return wait_for(ended, timeout, 0.1, f"batch {batch_id} ending")


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    """The JSON lines of an output or error file (none for no file)."""
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _spawn(root: Path, name: str, service: str, config: Path) -> Process:
    ready = root / f"{name}.ready"
    command = [*IOP, service, "--config", str(config), "--ready-file", str(ready)]
    with (root / f"{name}.log").open("ab") as log:  # appended: a restarted process keeps the first one's log
        popen = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    return Process(name, root, popen, service)


def _pin_port(config: Path, section: str, port: int) -> None:
    """Write the port a process picked (it was started with port 0) into its config, so a restart binds it again."""
    data = yaml.safe_load(config.read_text())
    data[section]["port"] = port
    _write(config, data)


def _start_worker(root: Path, name: str, upstream: dict[str, Any], settings: dict[str, Any]) -> Process:
    """A worker (``settings`` added to its config), ready, its port pinned in its config."""
    config = _write(
        root / f"{name}.yaml",
        {
            "worker_id": name,
            "listen": {"host": "127.0.0.1", "port": 0},
            "tls": tls_section(root / "certs", "worker"),
            "control_plane": {**upstream, "reconnect_initial": 0.05},
            "store": {"path": str(root / f"{name}.db")},
            # Not 0.5 s as the others: at its default CPU priority (SCHED_IDLE) the worker gets a
            # slice every 1-3 s on a host whose cores are all busy, as CI's are, and missed a 1.5 s window.
            "heartbeat_interval": 2.0,
            **settings,
        },
    )
    process = _spawn(root, name, "worker", config)
    try:
        _pin_port(config, "listen", int(process.wait_ready()["port"]))
    except BaseException:
        process.stop()
        raise
    return process


@contextmanager
def running_stack(
    root: Path,
    nodes: dict[str, list[dict[str, Any]]],
    *,
    control_plane: dict[str, Any] | None = None,
    edge_settings: dict[str, Any] | None = None,
    worker: dict[str, Any] | None = None,
    node_settings: dict[str, Any] | None = None,
) -> Iterator[Stack]:
    """Control-plane, then the nodes (id -> routes), a worker when ``worker`` is given (its extra
    settings), and the edge; stopped (SIGTERM) on the way out.

    ``control_plane``, ``node_settings`` (every node's) and ``edge_settings`` add settings to their configs.
    """
    root.mkdir(parents=True, exist_ok=True)
    certs = root / "certs"
    init_dir(certs)
    key = create_key(root / "edge-keys.db", "e2e")
    with ExitStack() as stopping:
        cp_config = _write(
            root / "control-plane.yaml",
            {
                "listen": {"host": "127.0.0.1", "port": 0},
                "tls": tls_section(certs, "control-plane"),
                "store_path": str(root / "control-plane.db"),
                "heartbeat_interval": 0.5,
                **(control_plane or {}),
            },
        )
        cp = _spawn(root, "control-plane", "control-plane", cp_config)
        stopping.callback(cp.stop)
        cp_port = int(cp.wait_ready()["port"])
        _pin_port(cp_config, "listen", cp_port)
        upstream = {"address": f"127.0.0.1:{cp_port}", "server_name": "localhost"}
        started: dict[str, Process] = {}
        for node_id, routes in nodes.items():
            config = _write(
                root / f"{node_id}.yaml",
                {
                    "node_id": node_id,
                    "listen": {"enabled": False},
                    "control_plane": {**upstream, "reconnect_initial": 0.05},
                    "tls": tls_section(certs, "node"),
                    "store_path": str(root / f"{node_id}.db"),
                    "heartbeat_interval": 0.5,
                    "routes": routes,
                    **(node_settings or {}),
                },
            )
            started[node_id] = _spawn(root, node_id, "node", config)
            stopping.callback(started[node_id].stop)
        worker_settings: dict[str, Any] = {}
        worker_process: Process | None = None
        if worker is not None:
            worker_process = _start_worker(root, "worker", upstream, worker)
            stopping.callback(worker_process.stop)
            worker_port = yaml.safe_load((root / "worker.yaml").read_text())["listen"]["port"]
            worker_settings = {"worker": {"address": f"127.0.0.1:{worker_port}", "server_name": "localhost"}}
        edge_config = _write(
            root / "edge.yaml",
            {
                "http": {"host": "127.0.0.1", "port": 0},
                "control_plane": {**upstream, "capabilities_ttl": 0},
                "tls": tls_section(certs, "edge"),
                "auth": "keys",
                "keys_path": str(root / "edge-keys.db"),
                **worker_settings,
                **(edge_settings or {}),
            },
        )
        edge = _spawn(root, "edge", "edge", edge_config)
        stopping.callback(edge.stop)
        for process in started.values():
            process.wait_ready()
        edge_port = int(edge.wait_ready()["port"])
        stack = Stack(root, cp_port, edge_port, key, started, worker=worker_process, control_plane=cp, edge=edge)
        models = {route["model"] for routes in nodes.values() for route in routes}
        stopping.callback(stack.close)
        wait_for(lambda: models <= stack.served(), START_TIMEOUT, 0.05, f"the edge serving {sorted(models)}")
        if worker_process is not None:  # else the first file or batch request may meet a 503
            wait_for(stack.worker_connected, START_TIMEOUT, 0.05, "the edge's connection to the worker")
        yield stack


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[Stack]:
    """A stack of this test's own with two nodes serving the mock models, for tests that kill one."""
    with running_stack(tmp_path / "stack", {"node-a": MOCK_ROUTES, "node-b": MOCK_ROUTES}) as started:
        yield started


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One node serving the mock models, shared by the module."""
    with running_stack(tmp_path_factory.mktemp("stack"), {"node-a": MOCK_ROUTES}) as started:
        yield started


_LOGGED = 40  # lines of each process's log attached to a failed test's report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used a stack gets its processes' warnings and errors in the report: the logs
    are in a temporary folder that is gone by the time anyone reads a CI failure."""
    report = yield
    if not report.failed:
        return report
    for stack in (value for value in getattr(item, "funcargs", {}).values() if isinstance(value, Stack)):
        for log in sorted(stack.root.glob("*.log")):
            if lines := _warnings_and_errors(log):
                report.sections.append(
                    (f"{log.name} (warnings and errors, last {_LOGGED})", "\n".join(lines[-_LOGGED:]))
                )
    return report


def _warnings_and_errors(path: Path) -> list[str]:
    """The log's lines above info level (every line a JSON object with its level)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if '"level": "info"' not in line and '"level": "debug"' not in line]
