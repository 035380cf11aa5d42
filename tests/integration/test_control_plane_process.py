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

from conftest import Pki, assert_eventually
from cp_helpers import IOP, ROUTES, cp_config, node_process, node_processes
from node_helpers import chat, collect, kinds

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection, ConnectionConfig
from iop_wire.endpoint import dial
from iop_wire.tls import Role


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
    config = cp_config(pki, tmp_path, attempts=0)
    result = _start(config)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("iop control-plane: bad config: attempts (line"), result.stderr

    (tmp_path / "policy.yaml").write_text("defaults: {policy: random}\n")
    config = cp_config(pki, tmp_path, policy_path="policy.yaml")
    result = _start(config)
    assert result.returncode == 2 and "policy_path" in result.stderr and "defaults.policy" in result.stderr


async def test_control_plane_process_serves_nodes_and_edges(pki: Pki, tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    config = cp_config(pki, tmp_path, metrics={"port": 0})
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
    command = [*IOP, "control-plane", "--config", str(cp_config(pki, tmp_path)), "--ready-file", str(ready)]
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


_SECONDS_RUN = {"model": "mock-seconds", "adapter": "mock", "options": {"tokens": 40, "tokens_per_second": 10}}


def _hold_ledger_writes(path: Path, run_id: str) -> sqlite3.Connection:
    """Take the control-plane file's write lock (its writer then waits) while ``run_id`` is placed and has
    no ledger row: from here on, that run's ledger row cannot be committed."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    placed = "SELECT COUNT(*) FROM open_runs WHERE run_id = ? AND node_id IS NOT NULL"
    assert db.execute(placed, (run_id,)).fetchone() == (1,)
    assert db.execute("SELECT COUNT(*) FROM runs WHERE run_id = ?", (run_id,)).fetchone() == (0,)
    return db


async def test_a_run_completed_just_before_a_kill_is_recorded_as_its_node_recorded_it(pki: Pki, tmp_path: Path) -> None:
    """Issue 20 item 6: a run that completed for its client while its ledger row waited for the writer
    (held here by the file's write lock, in place of the 20 ms commit window) and the control-plane
    then killed: after the restart the ledger shows it completed with its usage, as its node recorded
    it, not interrupted. A run left open that the node never ran stays interrupted."""
    ready, store, log = tmp_path / "ready.json", tmp_path / "cp.db", tmp_path / "cp.log"
    command = [*IOP, "control-plane", "--config", str(cp_config(pki, tmp_path)), "--ready-file", str(ready)]
    tls, config = pki.config("ops", Role.ADMIN), ConnectionConfig(heartbeat_interval=0.5)
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as process:  # noqa: ASYNC220 - started once, before anything runs on the loop
        await assert_eventually(ready.exists, timeout=20)
        port = json.loads(ready.read_text())["port"]
        with node_process(pki, tmp_path, port, "node-a", [*ROUTES, _SECONDS_RUN]):
            admin = await dial("127.0.0.1", port, tls=tls, server_hostname="localhost", config=config)
            await _until_registered(admin)
            stream = await admin.open_run(chat(model="mock-seconds", run_id="late"))
            assert [(await anext(stream)).WhichOneof("event") for _ in range(2)] == ["start", "delta"]
            await assert_eventually(lambda: _placed(store, "late"), timeout=10)
            held = _hold_ledger_writes(store, "late")
            try:
                events = await collect(stream)  # the run completes for its client: its row waits for the lock
                assert kinds(events)[-1] == "complete"
                process.kill()  # SIGKILL while its ledger row is uncommitted
                process.wait(timeout=10)
                # Left open by the same kill (owner is any other control-plane), on node-a, which never ran it.
                held.execute(
                    "INSERT INTO open_runs (run_id, requester, connection, caller, model, received_at, owner, "
                    "node_id, node_model, attempt, placed_after) "
                    "VALUES ('unknown', 'ops', 'conn-x', 'ops', 'mock-small', 1.0, 'killed', 'node-a', 'mock-small', "
                    "1, 0.0)"
                )
                held.execute("COMMIT")
            finally:
                held.close()
            await admin.close()
            usage = events[-1].complete.usage
            ready.unlink()
            again = [*IOP, "control-plane", "--config", str(cp_config(pki, tmp_path, listen={"port": port}))]
            with (
                log.open("wb") as output,
                subprocess.Popen(  # noqa: ASYNC220 - as above
                    [*again, "--ready-file", str(ready)], stdout=output, stderr=subprocess.STDOUT
                ) as restarted,
            ):
                try:
                    await assert_eventually(ready.exists, timeout=20)
                    async with dial("127.0.0.1", port, tls=tls, server_hostname="localhost", config=config) as admin:
                        await _until_registered(admin)  # node-a back: it is asked how the runs left open ended
                        listed = await _until_settled(admin, "late")
                        asked = "run left open stays interrupted: its node has no record of its end"
                        await assert_eventually(lambda: asked in log.read_text(), timeout=10)  # about "unknown"
                        listed = (await admin.request(pb.Envelope(runs_list=pb.RunsList()))).runs_listed
                finally:
                    restarted.send_signal(signal.SIGTERM)
                    assert restarted.wait(timeout=15) == 0
    runs = {run.run_id: run for run in listed.runs}
    late, unknown = runs["late"], runs["unknown"]
    assert (late.status, late.node_id, late.error_code) == ("completed", "node-a", pb.ERROR_CODE_UNSPECIFIED)
    assert (late.usage.prompt_tokens, late.usage.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert late.usage.completion_tokens > 0 and late.finish_reason == events[-1].complete.finish_reason
    assert [attempt.outcome for attempt in late.attempts] == ["completed"]
    assert (unknown.status, [a.outcome for a in unknown.attempts]) == ("interrupted", ["interrupted"])
    assert "run left open recorded as its node recorded it" in log.read_text()


def _placed(path: Path, run_id: str) -> bool:
    """Whether the file notes ``run_id`` in progress on a node (committed)."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        sql = "SELECT COUNT(*) FROM open_runs WHERE run_id = ? AND node_id IS NOT NULL"
        return bool(db.execute(sql, (run_id,)).fetchone()[0])


async def _until_settled(admin: Connection, run_id: str) -> pb.RunsListed:
    """The ledger once ``run_id`` is no longer interrupted (the node's answer comes after its registration)."""
    for _ in range(300):
        listed = (await admin.request(pb.Envelope(runs_list=pb.RunsList()))).runs_listed
        if any(run.run_id == run_id and run.status != "interrupted" for run in listed.runs):
            return listed
        await asyncio.sleep(0.05)
    raise AssertionError(f"{run_id} is still recorded interrupted: {listed}")
