"""Failure detection: how long the control-plane takes to mark a node unavailable.

``iop control-plane`` (heartbeat interval 1 s) and one ``iop node`` run as their own processes.
Each trial starts the node, waits until it is ready, then either SIGKILLs it (its kernel closes
the socket: detected from the connection's close) or SIGSTOPs it (no close, no heartbeats:
detected after 3 silent intervals). The time is from the signal to the first ``nodes.list``
answer that shows the node unavailable, asked every 2 ms over an admin connection. Prints a
table; asserts nothing.
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml
from control_plane_bench import IOP, _wait_ready
from table import print_table

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import init_dir, tls_section
from iop_wire.connection import Connection
from iop_wire.endpoint import dial
from iop_wire.logs import configure
from iop_wire.tls import TlsConfig

INTERVAL = 1.0
TRIALS = 5
_POLL = 0.002


def _configs(state: Path) -> Path:
    data = {
        "listen": {"port": 0},
        "tls": tls_section(state / "certs", "control-plane"),
        "store_path": str(state / "cp.db"),
        "heartbeat_interval": INTERVAL,
        "log_level": "warning",
    }
    (state / "cp.yaml").write_text(yaml.safe_dump(data))
    return state / "cp.yaml"


def _node_config(state: Path, cp_port: int) -> Path:
    data = {
        "node_id": "node-0",
        "listen": {"enabled": False},
        "tls": tls_section(state / "certs", "node"),
        "store_path": str(state / "node-0.db"),
        "heartbeat_interval": INTERVAL,
        "log_level": "warning",
        "control_plane": {"address": f"127.0.0.1:{cp_port}", "server_name": "localhost", "reconnect_initial": 0.05},
        "routes": [{"model": "m", "adapter": "mock"}],
    }
    (state / "node.yaml").write_text(yaml.safe_dump(data))
    return state / "node.yaml"


async def _state(admin: Connection) -> int:
    listed = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
    return listed.nodes[0].state if listed.nodes else pb.NODE_STATE_UNSPECIFIED


async def _until(admin: Connection, state: int, timeout: float) -> float:
    """Seconds until the node is in ``state``."""
    started = time.perf_counter()
    while await _state(admin) != state:
        if time.perf_counter() - started > timeout:
            raise RuntimeError(f"node not in state {state} within {timeout} s")
        await asyncio.sleep(_POLL)
    return time.perf_counter() - started


async def _trial(admin: Connection, config: Path, how: signal.Signals) -> float:
    node = subprocess.Popen([*IOP, "node", "--config", str(config)], stderr=subprocess.DEVNULL)  # noqa: ASYNC220 - between trials, timed after it is ready
    try:
        await _until(admin, pb.NODE_STATE_READY, 30)
        await asyncio.sleep(INTERVAL * 1.5)  # a heartbeat or two in: the watchdog's timer is mid-cycle
        node.send_signal(how)
        return await _until(admin, pb.NODE_STATE_UNAVAILABLE, 10 * INTERVAL)
    finally:
        node.kill()
        node.wait(timeout=10)


async def _bench(cp_port: int, node_config: Path, certs: Path) -> list[tuple[str, str]]:
    tls = TlsConfig(enabled=True, cert=certs / "admin.crt", key=certs / "admin.key", ca=certs / "ca.crt")
    async with dial("127.0.0.1", cp_port, tls=tls, server_hostname="localhost") as admin:
        killed = [await _trial(admin, node_config, signal.SIGKILL) for _ in range(TRIALS)]
        silent = [await _trial(admin, node_config, signal.SIGSTOP) for _ in range(TRIALS)]
    return [
        (
            f"killed node (SIGKILL) -> unavailable, {TRIALS} trials: median / max",
            f"{statistics.median(killed) * 1000:.1f} / {max(killed) * 1000:.1f} ms",
        ),
        (
            f"silent node (SIGSTOP, heartbeat {INTERVAL:g} s) -> unavailable, {TRIALS} trials: median / max",
            f"{statistics.median(silent):.2f} / {max(silent):.2f} s (3 intervals: {3 * INTERVAL:g} s)",
        ),
    ]


def main() -> None:
    configure("warning")
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        init_dir(state / "certs")
        ready = state / "cp.ready"
        command = [*IOP, "control-plane", "--config", str(_configs(state)), "--ready-file", str(ready)]
        cp = subprocess.Popen(command, stderr=subprocess.DEVNULL)
        try:
            port = int(_wait_ready(ready, cp)["port"])
            rows = asyncio.run(_bench(port, _node_config(state, port), state / "certs"))
        finally:
            cp.send_signal(signal.SIGTERM)
            cp.wait(timeout=15)
    print_table(rows)


if __name__ == "__main__":
    main()
