"""`iop nodes` / `iop policy` against a real `iop control-plane` process, and its SIGHUP reload."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Pki, assert_eventually
from cp_helpers import IOP, node_processes
from node_helpers import chat, collect, kinds

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.endpoint import dial
from iop_wire.errors import IopError
from iop_wire.tls import Role

FIRST = "defaults: {policy: round-robin}\n"
SECOND = "defaults: {policy: least-loaded, attempts: 3}\n"
THIRD = "aliases: {gpt: mock-small}\n"
INVALID = "defaults: {policy: random}\n"


@dataclass
class ControlPlane:
    port: int
    state: Path
    policy: Path
    log: Path
    process: subprocess.Popen[bytes]


def _certs(pki: Pki, folder: Path, name: str, role: Role) -> Path:
    """A certs folder as `iop certs init` leaves it: admin.crt, admin.key, ca.crt."""
    tls = pki.config(name, role)
    folder.mkdir(parents=True)
    assert tls.cert and tls.key and tls.ca
    shutil.copy(tls.cert, folder / "admin.crt")
    shutil.copy(tls.key, folder / "admin.key")
    shutil.copy(tls.ca, folder / "ca.crt")
    return folder


@pytest.fixture
async def cp(pki: Pki, tmp_path: Path) -> AsyncIterator[ControlPlane]:
    state = tmp_path / "state"
    _certs(pki, state / "certs", "ops", Role.ADMIN)
    policy = tmp_path / "policy.yaml"
    policy.write_text(FIRST)
    tls = pki.config("cp", Role.CONTROL_PLANE)
    config = tmp_path / "cp.yaml"
    settings = {
        "listen": {"port": 0},
        "tls": {"enabled": True, "cert": str(tls.cert), "key": str(tls.key), "ca": str(tls.ca)},
        "store_path": str(tmp_path / "cp.db"),
        "heartbeat_interval": 0.5,
        "policy_path": str(policy),
        "log_level": "info",
    }
    config.write_text(yaml.safe_dump(settings))
    ready, log = tmp_path / "ready.json", tmp_path / "cp.log"
    command = [*IOP, "control-plane", "--config", str(config), "--ready-file", str(ready)]
    with log.open("wb") as sink, subprocess.Popen(command, stdout=sink, stderr=sink) as process:  # noqa: ASYNC220 - started once, before anything runs on the loop
        try:
            await assert_eventually(ready.exists, timeout=20)
            port = json.loads(ready.read_text())["port"]
            yield ControlPlane(port, state, policy, log, process)
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0


async def _iop(
    cp: ControlPlane | None, *args: str, port: int | None = None, python: Sequence[str] = ()
) -> tuple[int, str, str]:
    """Run `iop ARGS` (the interpreter given ``python``'s options) against the control-plane; (exit code,
    stdout, stderr)."""
    where = ["--control-plane", f"127.0.0.1:{port or (cp.port if cp else 1)}"]
    state = ["--dir", str(cp.state)] if cp else []
    process = await asyncio.create_subprocess_exec(
        IOP[0], *python, *IOP[1:], *args, *where, *state, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def _nodes(cp: ControlPlane) -> dict[str, dict[str, object]]:
    code, out, err = await _iop(cp, "nodes", "ls", "--json", python=["-X", "importtime"])
    assert code == 0, err[-500:]
    _without_pure_python_protobuf(imported(err))
    return {node["node_id"]: node for node in json.loads(out)}


def _without_pure_python_protobuf(modules: set[str]) -> None:
    """What upb serves was loaded, protobuf's pure-Python message module and its imports were not
    (iop_cli.oneshot leaves it unexecuted; run, it would bring text_format and the decoder)."""
    assert {"google.protobuf.timestamp_pb2", "google.protobuf.internal.well_known_types"} <= modules
    pure_python = {
        "google.protobuf.internal.python_message",
        "google.protobuf.text_format",
        "google.protobuf.internal.decoder",
    }
    assert not modules & pure_python, modules & pure_python


async def _version_in_force(cp: ControlPlane, pki: Pki) -> str:
    tls = pki.config("ops", Role.ADMIN)
    async with dial("127.0.0.1", cp.port, tls=tls, server_hostname="localhost") as admin:
        return (await admin.request(pb.Envelope(policy_show=pb.PolicyShow()))).policy_shown.version


def _version(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


async def test_nodes_ls_drain_undrain(cp: ControlPlane, pki: Pki, tmp_path: Path) -> None:
    with node_processes(pki, tmp_path, cp.port, "node-a"):
        tls = pki.config("ops", Role.ADMIN)
        async with dial("127.0.0.1", cp.port, tls=tls, server_hostname="localhost") as admin:
            for _ in range(400):
                listed = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
                if [node.state for node in listed.nodes] == [pb.NODE_STATE_READY]:
                    break
                await asyncio.sleep(0.05)
        code, out, err = await _iop(cp, "nodes", "ls", python=["-X", "importtime"])
        assert code == 0, err[-500:]
        _without_pure_python_protobuf(imported(err))
        header, row = out.splitlines()
        assert header.split()[:6] == ["NODE", "STATE", "MODELS", "IN-FLIGHT", "HEARTBEAT", "ADDRESS"]
        assert row.startswith("node-a") and " ready " in row and "mock-small" in row and "127.0.0.1:" in row
        assert "0/12" in row and "s ago" in row  # 4 slots for each of the 3 mock models

        node = (await _nodes(cp))["node-a"]
        assert node["state"] == "ready" and node["in_flight"] == 0 and node["capacity"] == 12
        assert {m["model"] for m in node["models"]} == {"mock-small", "mock-slow", "mock-ttft"}  # type: ignore[attr-defined]
        assert isinstance(node["last_heartbeat_age_s"], float) and node["last_heartbeat_age_s"] < 5
        assert str(node["address"]).startswith("127.0.0.1:")

        code, out, err = await _iop(cp, "nodes", "drain", "node-a", "--reason", "maintenance")
        assert (code, out.strip()) == (0, "node node-a draining"), err
        node = (await _nodes(cp))["node-a"]
        assert (node["state"], node["reason"]) == ("draining", "maintenance")

        code, out, err = await _iop(cp, "nodes", "undrain", "node-a")
        assert code == 0 and "ready" in out, err
        assert (await _nodes(cp))["node-a"]["state"] == "ready"

        code, out, err = await _iop(cp, "nodes", "drain", "node-z")
        assert code == 1 and out == "" and err.strip() == "iop nodes: no node 'node-z' is registered"


async def test_policy_show_apply_and_sighup(cp: ControlPlane, pki: Pki, tmp_path: Path) -> None:
    code, out, err = await _iop(cp, "policy", "show")
    assert code == 0, err
    assert out.splitlines()[0].startswith(f"# policy version {_version(FIRST)}, from {cp.policy}")
    assert out.splitlines()[1:] == FIRST.splitlines()

    valid, invalid = tmp_path / "valid.yaml", tmp_path / "invalid.yaml"
    valid.write_text(SECOND)
    invalid.write_text(INVALID)
    code, out, err = await _iop(cp, "policy", "apply", str(valid))
    assert (code, out.strip()) == (0, f"policy {_version(SECOND)} in force (from {valid})"), err

    code, out, err = await _iop(cp, "policy", "apply", str(invalid))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"iop policy: {invalid} refused: defaults.policy"), err
    code, out, err = await _iop(cp, "policy", "show")
    assert code == 0 and out.splitlines()[1:] == SECOND.splitlines() and str(valid) in out.splitlines()[0]

    # SIGHUP: the policy file again; valid -> in force and logged, invalid -> logged, old one stays.
    cp.policy.write_text(THIRD)
    cp.process.send_signal(signal.SIGHUP)
    await assert_eventually(lambda: f'"version": "{_version(THIRD)}"' in cp.log.read_text(), timeout=5)
    assert await _version_in_force(cp, pki) == _version(THIRD)

    cp.policy.write_text(INVALID)
    cp.process.send_signal(signal.SIGHUP)
    await assert_eventually(lambda: "policy reload refused" in cp.log.read_text(), timeout=5)
    refused = next(line for line in cp.log.read_text().splitlines() if "policy reload refused" in line)
    assert "policy_path" in refused and "defaults.policy" in refused and _version(THIRD) in refused
    assert await _version_in_force(cp, pki) == _version(THIRD)
    assert cp.process.poll() is None


async def test_errors_are_one_line(cp: ControlPlane, pki: Pki, tmp_path: Path) -> None:
    code, out, err = await _iop(cp, "nodes", "ls", port=1)  # nothing listens on port 1
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith("iop nodes: cannot reach the control-plane at 127.0.0.1:1"), err

    code, _, err = await _iop(None, "policy", "show", "--certs", str(tmp_path / "none"))
    assert code == 2 and err.startswith(f"iop policy: no {tmp_path / 'none' / 'admin.crt'}"), err

    edge = _certs(pki, tmp_path / "edge-certs", "edge-1", Role.EDGE)  # not an admin certificate
    code, out, err = await _iop(cp, "nodes", "drain", "node-x", "--certs", str(edge))  # an edge may only read
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "may not send nodes_drain" in err, err

    code, _, err = await _iop(cp, "policy", "apply", str(tmp_path / "missing.yaml"))
    assert code == 2 and "cannot read" in err and len(err.splitlines()) == 1


async def _ledger(cp: ControlPlane, *args: str) -> list[dict[str, Any]]:
    code, out, err = await _iop(cp, "runs", "ls", "--json", *args)
    assert code == 0, err
    runs: list[dict[str, Any]] = json.loads(out)
    return runs


async def _four_runs(cp: ControlPlane, pki: Pki, tmp_path: Path) -> str:
    """Completed, cancelled, refused, and failed over from the node killed (returned) before its first token."""
    with node_processes(pki, tmp_path, cp.port, "node-a", "node-b") as processes:
        edge_tls = pki.config("edge-1", Role.EDGE)
        async with dial("127.0.0.1", cp.port, tls=edge_tls, server_hostname="localhost") as edge:
            for _ in range(400):  # both nodes registered
                if len((await edge.capabilities()).adapters) and await _both_ready(cp, pki):
                    break
                await asyncio.sleep(0.05)
            done = await collect(await edge.open_run(chat(run_id="ok-1", caller=pb.Caller(id="alice"))))
            assert kinds(done)[-1] == "complete"

            slow = await edge.open_run(chat(model="mock-slow", run_id="cancel-1"))
            assert [kinds([await anext(slow)]) for _ in range(2)] == [["start"], ["delta"]]
            await slow.cancel("enough")
            assert kinds(await collect(slow))[-1] == "error"

            refused = await collect(await edge.open_run(chat(model="no-such-model", run_id="nope")))
            assert refused[-1].error.code == pb.ERROR_CODE_MODEL_NOT_FOUND

            moved = await edge.open_run(chat(model="mock-ttft", run_id="moved"))  # 1 s to its first token
            start = await anext(moved)
            first = start.start.node_id
            processes[first].kill()
            events = [start, *await collect(moved)]
            assert kinds(events)[-1] == "complete" and kinds(events).count("start") == 1

            # An edge may submit runs and read the ledger (for the console), but not operate.
            assert (await edge.request(pb.Envelope(runs_list=pb.RunsList()))).runs_listed.runs
            with pytest.raises(IopError) as denied:
                await edge.request(pb.Envelope(policy_show=pb.PolicyShow()))
            assert denied.value.code == pb.ERROR_CODE_PERMISSION_DENIED

    return first


async def test_the_run_ledger_records_every_run_and_iop_runs_reads_it(
    cp: ControlPlane, pki: Pki, tmp_path: Path
) -> None:
    first = await _four_runs(cp, pki, tmp_path)
    other = "node-b" if first == "node-a" else "node-a"
    runs: list[dict[str, Any]] = []
    for _ in range(100):  # the ledger is written in batches, off the relay's path
        if len(runs := await _ledger(cp)) == 4:
            break
        await asyncio.sleep(0.1)
    assert [run["run_id"] for run in runs] == ["moved", "nope", "cancel-1", "ok-1"]  # newest first
    by_id = {run["run_id"]: run for run in runs}

    ok = by_id["ok-1"]
    assert (ok["status"], ok["requester"], ok["caller"], ok["model"]) == ("completed", "edge-1", "alice", "mock-small")
    assert ok["completion_tokens"] > 0 and ok["finish_reason"] == "stop" and ok["outputs"] > 0
    assert 0 < ok["ttft_ms"] <= ok["duration_ms"]
    assert [a["outcome"] for a in ok["attempts"]] == ["completed"] and ok["node_id"] == ok["attempts"][0]["node_id"]

    cancelled = by_id["cancel-1"]
    assert (cancelled["status"], cancelled["error_code"]) == ("cancelled", "CANCELLED")
    assert [a["outcome"] for a in cancelled["attempts"]] == ["cancelled"]

    nope = by_id["nope"]
    assert (nope["status"], nope["error_code"], nope["attempts"], nope["node_id"]) == (
        "failed",
        "MODEL_NOT_FOUND",
        [],
        "",
    )
    assert nope["ttft_ms"] is None

    failover = by_id["moved"]
    assert failover["status"] == "completed" and failover["node_id"] == other
    assert [(a["node_id"], a["outcome"]) for a in failover["attempts"]] == [(first, "node_lost"), (other, "completed")]
    assert (
        failover["attempts"][0]["reason"].startswith("NODE_LOST") or "connection" in failover["attempts"][0]["reason"]
    )
    assert failover["ttft_ms"] >= 1000 and failover["completion_tokens"] == 5  # mock-ttft: 1 s, then 5 tokens

    assert [run["run_id"] for run in await _ledger(cp, "--status", "cancelled")] == ["cancel-1"]
    assert [run["run_id"] for run in await _ledger(cp, "--model", "mock-ttft")] == ["moved"]
    assert "moved" in [run["run_id"] for run in await _ledger(cp, "--node", first)]
    assert all(first in [a["node_id"] for a in run["attempts"]] for run in await _ledger(cp, "--node", first))
    assert [run["run_id"] for run in await _ledger(cp, "--limit", "2")] == ["moved", "nope"]

    await _ledger_text(cp, first, other)
    await _usage(cp, ok)


async def _usage(cp: ControlPlane, ok: dict[str, Any]) -> None:
    """`iop usage`: the same four runs summed per key and model, as JSON and as a table; a bad --since."""
    code, out, err = await _iop(cp, "usage", "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["bucket"] == "hour" and (shown["totals"]["requests"], shown["totals"]["failed"]) == (4, 2)
    keys = [(row["key"], row["model"], row["requests"], row["failed"]) for row in shown["rows"]]
    assert sorted(keys) == [  # a model no node serves counts under (unknown): names a client makes up stay one row
        ("alice", "mock-small", 1, 0),
        ("edge-1", "(unknown)", 1, 1),
        ("edge-1", "mock-slow", 1, 1),
        ("edge-1", "mock-ttft", 1, 0),
    ]
    (alice,) = (row for row in shown["rows"] if row["key"] == "alice")
    assert (alice["prompt_tokens"], alice["completion_tokens"]) == (ok["prompt_tokens"], ok["completion_tokens"])
    code, out, err = await _iop(cp, "usage", "--key", "alice", "--by", "day", "--since", "2d")
    assert code == 0, err
    header, row, total = out.splitlines()
    assert header.split() == ["START", "KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "FAILED"]
    assert row.split()[1:] == ["alice", "mock-small", "1", str(ok["prompt_tokens"]), str(ok["completion_tokens"]), "0"]
    assert row.split()[0].endswith("T00:00Z") and total.split()[:2] == ["TOTAL", "1"]
    code, out, err = await _iop(cp, "usage", "--since", "last tuesday")
    assert (code, out, len(err.splitlines())) == (2, "", 1) and err.startswith("iop usage: --since: cannot read"), err


async def _ledger_text(cp: ControlPlane, first: str, other: str) -> None:
    """The same ledger as text, and bad arguments as one line."""
    code, out, err = await _iop(cp, "runs", "ls")
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split()[:6] == ["RECEIVED", "RUN", "CALLER", "MODEL", "NODE", "STATUS"] and len(rows) == 4
    code, out, err = await _iop(cp, "runs", "show", "moved")
    assert code == 0, err
    assert "status: completed" in out and "attempts:" in out and f"1. node_id={first}, " in out
    assert f"2. node_id={other}, model=mock-ttft, outcome=completed" in out

    code, out, err = await _iop(cp, "runs", "show", "never")
    assert (code, out) == (1, "") and "no run 'never'" in err
    code, out, err = await _iop(cp, "runs", "ls", "--status", "running")
    assert (
        code == 2
        and out == ""
        and err.strip() == ("iop runs: unknown status 'running'; valid: completed, failed, cancelled, interrupted")
    )
    code, _, err = await _iop(cp, "runs", "ls", "--since", "yesterday")
    assert code == 2 and "cannot read since 'yesterday'" in err and len(err.splitlines()) == 1


async def _both_ready(cp: ControlPlane, pki: Pki) -> bool:
    tls = pki.config("ops", Role.ADMIN)
    async with dial("127.0.0.1", cp.port, tls=tls, server_hostname="localhost") as admin:
        listed = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
    return [node.state for node in listed.nodes] == [pb.NODE_STATE_READY] * 2


# What `iop nodes ls` loads: an operator runs it often, a new process each time (README: under 200 ms).
_SERVICES = {"fastapi", "uvicorn", "asyncpg", "aiosqlite", "sqlite3", "pydantic", "yaml", "cryptography"}
_SERVICES |= {"iop_control_plane", "iop_node", "iop_edge", "iop_worker"}


def imported(stderr: str) -> set[str]:
    """The modules ``python -X importtime`` reported, and the top-level packages they belong to."""
    names = {line.rpartition("|")[2].strip() for line in stderr.splitlines() if line.startswith("import time:")}
    return names | {name.split(".")[0] for name in names}


async def test_nodes_ls_starts_without_the_services_asyncio_logging_or_metrics(cp: ControlPlane) -> None:
    where = ["--control-plane", f"127.0.0.1:{cp.port}", "--dir", str(cp.state)]
    command = [sys.executable, "-X", "importtime", *IOP[1:], "nodes", "ls", *where]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert (process.returncode, out.decode().strip()) == (0, "no nodes registered"), err.decode()[-500:]
    modules = imported(err.decode())
    assert {"iop_cli", "iop_wire.blocking", "ssl"} <= modules  # what it needs is seen: the check can fail
    # A blocking client: the asyncio connection's imports (with structlog and prometheus_client) were
    # most of the command's time. rich: `iop` refuses it (an attempt shows as "rich").
    unwanted = _SERVICES | {"asyncio", "structlog", "prometheus_client", "iop_wire.connection", "rich.console"}
    unwanted |= {"pygments"}
    # dataclasses (iop_wire.tls's types) imports inspect, ast and tokenize: a tenth of the command's start.
    unwanted |= {"dataclasses", "inspect"}
    assert not modules & unwanted, modules & unwanted


def test_help_starts_without_the_wire_the_services_or_the_package_metadata() -> None:
    version = subprocess.run([*IOP, "--version"], capture_output=True, text=True, timeout=60, check=False)
    assert version.stdout.startswith("iop ") and version.stdout.strip()[4:][0].isdigit(), (
        version
    )  # looked up when asked
    for args in (["--help"], ["nodes", "ls", "--help"]):
        command = [sys.executable, "-X", "importtime", *IOP[1:], *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0 and done.stdout, done.stderr[-500:]
        modules = imported(done.stderr)
        assert "iop_cli" in modules
        unwanted = _SERVICES | {"iop_wire", "structlog", "google", "importlib.metadata"}
        assert not modules & unwanted, modules & unwanted


_GC_AT_EXIT = (
    "import atexit, gc, sys; from iop_cli.main import console;"
    " atexit.register(lambda: print('collector', gc.isenabled(), gc.get_freeze_count() > 0, file=sys.stderr));"
    " sys.argv[0] = 'iop'; console()"
)


async def test_an_admin_request_leaves_its_objects_to_the_exit_and_other_commands_do_not(cp: ControlPlane) -> None:
    """``iop nodes ls`` runs without the cyclic collector and freezes what it made (iop_cli.oneshot);
    ``iop version``, like the services, keeps it."""
    where = ["--control-plane", f"127.0.0.1:{cp.port}", "--dir", str(cp.state)]
    for args, expected in ((["nodes", "ls", *where], "collector False True"), (["version"], "collector True False")):
        command = [sys.executable, "-c", _GC_AT_EXIT, *args]
        done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0 and done.stdout, done.stderr[-500:]
        assert done.stderr.splitlines()[-1] == expected, (args, done.stderr[-500:])
