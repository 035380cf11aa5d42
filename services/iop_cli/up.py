"""``iop up`` / ``iop down``: run the platform on this machine, in the background.

``up`` makes sure ``DIR`` holds development certificates (``DIR/certs``) and a node config
(``DIR/node.yaml``, mock models), starts ``iop node`` detached (log ``DIR/node.log``, pid
``DIR/node.pid``), and returns once the node answers a capability request over mTLS.
``down`` stops it with SIGTERM, which lets in-flight runs finish. Services join as they land.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import init_dir
from iop_wire.endpoint import dial
from iop_wire.tls import Role, TlsConfig

__all__ = ["down", "up"]

_START_TIMEOUT = 30.0


def _tls(certs: Path, role: Role) -> TlsConfig:
    return TlsConfig(enabled=True, cert=certs / f"{role}.crt", key=certs / f"{role}.key", ca=certs / "ca.crt")


def _node_config(state: Path, port: int) -> dict[str, object]:
    certs = (state / "certs").resolve()
    return {
        "node_id": "local-node",
        "listen": {"host": "127.0.0.1", "port": port},
        "tls": {
            "enabled": True,
            "cert": str(certs / "node.crt"),
            "key": str(certs / "node.key"),
            "ca": str(certs / "ca.crt"),
        },
        "store_path": str((state / "node-runs.db").resolve()),
        "routes": [
            {"model": "mock-small", "adapter": "mock", "options": {"tokens": 64, "tokens_per_second": 200}},
            {"model": "mock-fast", "adapter": "mock", "max_concurrency": 64, "options": {"tokens": 256}},
        ],
    }


def _running(pidfile: Path) -> int | None:
    """The pid in ``pidfile`` if that process is alive."""
    try:
        pid = int(pidfile.read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def up(state: Path, port: int = 7401) -> int:
    """Start the platform under ``state``; returns the exit code."""
    certs = state / "certs"
    if not (certs / "ca.crt").exists():
        init_dir(certs)
        print(f"minted a development CA and per-role certificates in {certs}")
    config = state / "node.yaml"
    if not config.exists():
        config.write_text(yaml.safe_dump(_node_config(state, port), sort_keys=False))
        print(f"wrote {config} (mock models; edit it to add cli routes)")
    pidfile, log = state / "node.pid", state / "node.log"
    if (pid := _running(pidfile)) is not None:
        print(f"node already running (pid {pid}); stop it with 'iop down'")
        return 0
    with log.open("wb") as sink:
        process = subprocess.Popen(  # noqa: S603 - our own interpreter and module, no shell
            [sys.executable, "-m", "iop_cli.main", "--log-level", "info", "node", "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
            start_new_session=True,
        )
    pidfile.write_text(str(process.pid))
    started = _wait_started(process, log)
    if started is None:
        print(f"the node did not start; the end of {log}:\n{log.read_text()[-2000:]}", file=sys.stderr)
        pidfile.unlink(missing_ok=True)
        return 1
    capabilities = asyncio.run(_capabilities(started, certs))
    models = ", ".join(m.name for a in capabilities.adapters for m in a.models)
    print(f"node {capabilities.node_id} up at 127.0.0.1:{started} (mTLS, certificates in {certs}), pid {process.pid}")
    print(f"models: {models}; log: {log}; run history: iop runs ls --config {config}; stop: iop down")
    return 0


async def _capabilities(port: int, certs: Path) -> pb.CapabilityResponse:
    """Ask the node what it serves, over mTLS as an admin: proof that it is up."""
    connection = await dial("127.0.0.1", port, tls=_tls(certs, Role.ADMIN), server_hostname="localhost")
    try:
        return await connection.capabilities()
    finally:
        await connection.close("up check done")


def _wait_started(process: subprocess.Popen[bytes], log: Path) -> int | None:
    """The node's port once its log says it started; None if it exited or took too long."""
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline and process.poll() is None:
        for line in log.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "node started":
                return int(event["port"])
        time.sleep(0.05)
    return None


def down(state: Path) -> int:
    """Stop what ``up`` started; returns the exit code."""
    pidfile = state / "node.pid"
    pid = _running(pidfile)
    if pid is None:
        print("no node running")
        pidfile.unlink(missing_ok=True)
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while _running(pidfile) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    pidfile.unlink(missing_ok=True)
    print(f"node (pid {pid}) stopped")
    return 0
