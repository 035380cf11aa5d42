"""`iop control-plane` as a real process: bad config, ready file, a node registering, SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import subprocess
import urllib.request
from pathlib import Path

import yaml
from conftest import Pki, assert_eventually
from cp_helpers import IOP, node_processes
from node_helpers import chat, collect, kinds

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection, ConnectionConfig
from iop_wire.endpoint import dial
from iop_wire.tls import Role


def _config(pki: Pki, tmp_path: Path, **extra: object) -> Path:
    tls = pki.config("cp", Role.CONTROL_PLANE)
    data = {
        "listen": {"port": 0},
        "tls": {"enabled": True, "cert": str(tls.cert), "key": str(tls.key), "ca": str(tls.ca)},
        "store_path": str(tmp_path / "cp.db"),
        "heartbeat_interval": 0.5,
        **extra,
    }
    path = tmp_path / "cp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def _until_registered(admin: Connection) -> None:
    """Ask nodes.list until the one node is ready."""
    for _ in range(400):
        listed = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
        if [node.state for node in listed.nodes] == [pb.NODE_STATE_READY]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the node did not register")


def _open_runs(path: Path) -> int:
    """Runs the control-plane's file notes in progress (committed)."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        (count,) = db.execute("SELECT COUNT(*) FROM open_runs").fetchone()
    return int(count)


def _start(config: Path) -> subprocess.CompletedProcess[str]:
    command = [*IOP, "control-plane", "--config", str(config)]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)


def test_bad_config_exits_2_with_one_line(pki: Pki, tmp_path: Path) -> None:
    config = _config(pki, tmp_path, attempts=0)
    result = _start(config)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("iop control-plane: bad config: attempts (line"), result.stderr

    (tmp_path / "policy.yaml").write_text("defaults: {policy: random}\n")
    config = _config(pki, tmp_path, policy_path="policy.yaml")
    result = _start(config)
    assert result.returncode == 2 and "policy_path" in result.stderr and "defaults.policy" in result.stderr


async def test_control_plane_process_serves_nodes_and_edges(pki: Pki, tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    config = _config(pki, tmp_path, metrics={"port": 0})
    command = [*IOP, "control-plane", "--config", str(config), "--ready-file", str(ready)]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as process:  # noqa: ASYNC220 - started once, before anything runs on the loop
        try:
            await assert_eventually(ready.exists, timeout=20)
            ready_info = json.loads(ready.read_text())
            port = ready_info["port"]
            url = f"http://127.0.0.1:{ready_info['metrics_port']}/metrics"
            scraped = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
            assert 'iop_control_plane_nodes{state="ready"} 0.0' in scraped and "iop_wire_" in scraped
            with node_processes(pki, tmp_path, port, "node-a"):
                tls = pki.config("ops", Role.ADMIN)
                config = ConnectionConfig(heartbeat_interval=0.5)
                async with dial("127.0.0.1", port, tls=tls, server_hostname="localhost", config=config) as admin:
                    await _until_registered(admin)
                    events = await collect(await admin.open_run(chat()))
                    assert kinds(events)[-1] == "complete"
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0
    assert not ready.exists()


async def test_runs_in_flight_when_killed_are_interrupted_in_the_ledger_after_a_restart(
    pki: Pki, tmp_path: Path
) -> None:
    ready = tmp_path / "ready.json"
    command = [*IOP, "control-plane", "--config", str(_config(pki, tmp_path)), "--ready-file", str(ready)]
    tls, config = pki.config("ops", Role.ADMIN), ConnectionConfig(heartbeat_interval=0.5)
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as process:  # noqa: ASYNC220 - started once, before anything runs on the loop
        await assert_eventually(ready.exists, timeout=20)
        port = json.loads(ready.read_text())["port"]
        with node_processes(pki, tmp_path, port, "node-a"):
            admin = await dial("127.0.0.1", port, tls=tls, server_hostname="localhost", config=config)
            await _until_registered(admin)
            assert kinds(await collect(await admin.open_run(chat(run_id="done"))))[-1] == "complete"
            streams = [await admin.open_run(chat(model="mock-slow", run_id=f"long-{n}")) for n in range(3)]
            for stream in streams:  # each placed on the node and streaming
                assert [(await anext(stream)).WhichOneof("event") for _ in range(2)] == ["start", "delta"]
            await assert_eventually(lambda: _open_runs(tmp_path / "cp.db") == 3)  # the writer committed them
            process.kill()  # SIGKILL: no run gets to end
            process.wait(timeout=10)
            await admin.close()
    ready.unlink()
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as process:  # noqa: ASYNC220 - as above
        try:
            await assert_eventually(ready.exists, timeout=20)
            port = json.loads(ready.read_text())["port"]
            async with dial("127.0.0.1", port, tls=tls, server_hostname="localhost", config=config) as admin:
                listed = (await admin.request(pb.Envelope(runs_list=pb.RunsList()))).runs_listed
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0
    status = {run.run_id: run.status for run in listed.runs}
    assert status == {"done": "completed", "long-0": "interrupted", "long-1": "interrupted", "long-2": "interrupted"}
    interrupted = [run for run in listed.runs if run.status == "interrupted"]
    assert all(run.node_id == "node-a" and run.error_code == pb.ERROR_CODE_UNAVAILABLE for run in interrupted)
    assert all([a.outcome for a in run.attempts] == ["interrupted"] for run in interrupted)
