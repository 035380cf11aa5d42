"""Two control-planes, active-active, as real processes: two nodes registered with both, an edge
connected to both (``control_plane.addresses``). ``kill -9`` of one control-plane: runs past their
first output through it are continued through the other (the client, the official OpenAI SDK among
them, sees one stream with the uninterrupted text), runs before it are opened again through the
other and complete as one clean stream, requests started afterwards succeed; nothing hangs (every
wait bounded)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from iop_edge.keys import create_key
from iop_wire.certs import init_dir, tls_section

from .conftest import IOP, START_TIMEOUT, Process, _pin_port, _spawn, _write, wait_for
from .sse import events

ROUTES: list[dict[str, Any]] = [
    {"model": "mock-small", "adapter": "mock", "options": {"tokens": 8, "tokens_per_second": 200}},
    {"model": "mock-stream", "adapter": "mock", "options": {"tokens": 60, "tokens_per_second": 20}},
    {"model": "mock-ttft", "adapter": "mock", "options": {"ttft": 1.5, "tokens": 5}},
]
GO = [{"role": "user", "content": "go"}]


@dataclass
class TwoControlPlanes:
    root: Path
    control_planes: dict[str, Process]
    ports: dict[str, int]
    edge: Process
    edge_port: int
    key: str

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.edge_port}"

    def ready(self) -> httpx.Response:
        return httpx.get(f"{self.base}/ready", timeout=5)

    def nodes_on(self, name: str) -> set[str]:
        """The ready nodes control-plane ``name`` lists (``iop nodes ls --json``)."""
        address = f"127.0.0.1:{self.ports[name]}"
        command = [*IOP, "nodes", "ls", "--control-plane", address, "--certs", str(self.root / "certs"), "--json"]
        listed = json.loads(subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout)
        return {node["node_id"] for node in listed if node.get("state") == "ready"}

    def running(self, model: str) -> int:
        """Runs of ``model`` in progress on the nodes, read from their SQLite files."""
        count = 0
        for node_id in ("node-a", "node-b"):
            with (
                contextlib.suppress(sqlite3.Error),
                sqlite3.connect(f"file:{self.root / node_id}.db?mode=ro", uri=True) as db,
            ):
                query = "SELECT COUNT(*) FROM runs WHERE model = ? AND status = 'running'"
                count += db.execute(query, [model]).fetchone()[0]
        return int(count)

    def stream(self, model: str) -> dict[str, Any]:
        """One streamed chat completion: its status, text, and how it ended ("done" or the error code)."""
        body = {"model": model, "messages": GO, "stream": True}
        headers = {"authorization": f"Bearer {self.key}"}
        with (
            httpx.Client(base_url=self.base, headers=headers, timeout=30.0) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            if response.status_code != 200:
                response.read()
                return {"status": response.status_code, "end": response.json()["error"].get("code"), "text": ""}
            payloads = events(response)
        chunks = [json.loads(payload) for payload in payloads if payload != "[DONE]"]
        error = next((chunk["error"] for chunk in chunks if "error" in chunk), None)
        deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk.get("choices")]
        return {
            "status": 200,
            "end": "done" if payloads[-1] == "[DONE]" else (error or {}).get("code"),
            "text": "".join(delta.get("content") or "" for delta in deltas),
            "roles": sum("role" in delta for delta in deltas),
        }


@contextmanager
def two_control_planes(root: Path) -> Iterator[TwoControlPlanes]:
    root.mkdir(parents=True, exist_ok=True)
    certs = root / "certs"
    init_dir(certs)
    key = create_key(root / "edge-keys.db", "e2e")
    with ExitStack() as stopping:
        control_planes, ports = {}, {}
        for name in ("cp-a", "cp-b"):
            config = _write(
                root / f"{name}.yaml",
                {
                    "listen": {"host": "127.0.0.1", "port": 0},
                    "tls": tls_section(certs, "control-plane"),
                    "store_path": str(root / f"{name}.db"),
                    "heartbeat_interval": 0.5,
                },
            )
            control_planes[name] = _spawn(root, name, "control-plane", config)
            stopping.callback(control_planes[name].stop)
            ports[name] = int(control_planes[name].wait_ready()["port"])
            _pin_port(config, "listen", ports[name])
        upstream = {"addresses": [f"127.0.0.1:{port}" for port in ports.values()], "server_name": "localhost"}
        nodes = []
        for node_id in ("node-a", "node-b"):
            config = _write(
                root / f"{node_id}.yaml",
                {
                    "node_id": node_id,
                    "listen": {"enabled": False},
                    "control_plane": {**upstream, "reconnect_initial": 0.05},
                    "tls": tls_section(certs, "node"),
                    "store_path": str(root / f"{node_id}.db"),
                    "heartbeat_interval": 0.5,
                    "routes": ROUTES,
                },
            )
            nodes.append(_spawn(root, node_id, "node", config))
            stopping.callback(nodes[-1].stop)
        edge_config = _write(
            root / "edge.yaml",
            {
                "http": {"host": "127.0.0.1", "port": 0},
                "control_plane": {**upstream, "capabilities_ttl": 0, "reconnect_initial": 0.05},
                "tls": tls_section(certs, "edge"),
                "auth": "keys",
                "keys_path": str(root / "edge-keys.db"),
            },
        )
        edge = _spawn(root, "edge", "edge", edge_config)
        stopping.callback(edge.stop)
        for node in nodes:
            node.wait_ready()
        started = TwoControlPlanes(root, control_planes, ports, edge, int(edge.wait_ready()["port"]), key)
        for name in control_planes:
            wait_for(lambda name=name: started.nodes_on(name) == {"node-a", "node-b"}, START_TIMEOUT, 0.2, name)
        wait_for(lambda: started.ready().json().get("control_plane_connections") == 4, START_TIMEOUT, 0.05, "edge")
        yield started


@pytest.fixture
def ha(tmp_path: Path) -> Iterator[TwoControlPlanes]:
    with two_control_planes(tmp_path / "ha") as started:
        yield started


def _sdk_stream(ha: TwoControlPlanes, model: str) -> str:
    """One streamed chat completion through the official OpenAI SDK: its text (an error event raises)."""
    client = openai.OpenAI(base_url=f"{ha.base}/v1", api_key=ha.key, timeout=30.0, max_retries=0)
    chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "go"}], stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


def _edge_log(ha: TwoControlPlanes, event: str) -> int:
    return sum(
        json.loads(line).get("event") == event for line in ha.edge.log.read_text().splitlines() if line[:1] == "{"
    )


def test_kill_9_of_a_control_plane_under_streams(ha: TwoControlPlanes) -> None:
    """In flight: each goes on through the other control-plane to the uninterrupted text, none hangs;
    started after the kill: all succeed."""
    assert ha.ready().json()["models"] == len(ROUTES)
    with ThreadPoolExecutor(16) as pool:
        in_flight = [pool.submit(ha.stream, "mock-stream") for _ in range(7)]
        through_sdk = pool.submit(_sdk_stream, ha, "mock-stream")
        wait_for(lambda: ha.running("mock-stream") == 8, 20, 0.05, "8 streams running")
        time.sleep(0.3)  # every stream past its first tokens
        ha.control_planes["cp-a"].kill()
        after = [pool.submit(ha.stream, model) for model in ("mock-small", "mock-ttft") * 8]
        uninterrupted = pool.submit(ha.stream, "mock-stream")  # the same request: the same text (mock)
        ended = [future.result(timeout=60) for future in in_flight]
        sdk_text = through_sdk.result(timeout=60)
        later = [future.result(timeout=60) for future in after]
        whole = uninterrupted.result(timeout=60)
    assert whole["end"] == "done" and len(whole["text"].split()) == 60, whole
    assert all(result["status"] == 200 and result["end"] == "done" for result in ended), (
        ended,
        ha.edge.log.read_text()[-3000:],
    )
    assert all(result["text"] == whole["text"] and result["roles"] == 1 for result in ended), ended
    assert sdk_text == whole["text"]
    assert _edge_log(ha, "run continued") >= 1, "no stream was carried by cp-a"
    assert _edge_log(ha, "run not continued") == 0
    assert all(result["status"] == 200 and result["end"] == "done" for result in later), later
    wait_for(lambda: ha.ready().json().get("control_plane_connections") == 2, 10, 0.05, "the edge seeing cp-a gone")
    ready = ha.ready()
    assert ready.status_code == 200 and ready.json()["models"] == len(ROUTES)


def test_runs_before_their_first_output_survive_their_control_plane(ha: TwoControlPlanes) -> None:
    """Runs awaiting their first token (1.5 s) when cp-a dies complete through cp-b: one clean stream each."""
    with ThreadPoolExecutor(8) as pool:
        waiting = [pool.submit(ha.stream, "mock-ttft") for _ in range(8)]
        wait_for(lambda: ha.running("mock-ttft") == 8, 20, 0.05, "8 runs awaiting their first token")
        ha.control_planes["cp-a"].kill()
        results = [future.result(timeout=60) for future in waiting]
    for result in results:
        assert result["status"] == 200 and result["end"] == "done", results
        assert len(result["text"].split()) == 5 and result["roles"] == 1, result
    assert _edge_log(ha, "run opened again") >= 1, "no run was waiting on cp-a"


def test_the_console_overview_sums_every_control_plane(ha: TwoControlPlanes) -> None:
    admin = create_key(ha.root / "edge-keys.db", "ops", admin=True)
    headers = {"authorization": f"Bearer {admin}"}
    wait_for(
        lambda: httpx.get(f"{ha.base}/console/api/me", headers=headers, timeout=5).status_code == 200,
        10,
        0.05,
        "the edge reading the admin key",
    )
    chats = 6  # the edge opens runs on its connections in turn: both control-planes get some
    for _ in range(chats):
        assert ha.stream("mock-small")["end"] == "done"

    def summed() -> dict[str, Any] | None:
        overview: dict[str, Any] = httpx.get(f"{ha.base}/console/api/overview", headers=headers, timeout=10).json()
        return overview if sum(model["requests"] for model in overview["models"]) == chats else None

    overview = wait_for(summed, 10, 0.1, "both control-planes' runs in the overview")
    assert len(overview["control_planes"]) == 2, overview["control_planes"]
    assert overview["nodes"]["total"] == 2 and overview["failed"] == 0
