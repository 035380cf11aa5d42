"""``iop up`` / ``iop down``: run the platform on this machine, in the background.

``up`` makes sure ``DIR`` holds development certificates (``DIR/certs``) and a node config
(``DIR/node.yaml``: mock models, metrics on), starts ``iop node`` detached (log ``DIR/node.log``,
the previous start's kept as ``node.log.1``; pid ``DIR/node.pid``), waits for the ready file the
node writes once it serves (``DIR/node.ready``: its pid and ports), and checks that it answers a
capability request over mTLS. ``--port`` sets ``listen.port`` in the config, new or existing.
``down`` stops it with SIGTERM, which lets in-flight runs finish. Services join as they land.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from iop_cli.shell import iop_command
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import init_dir
from iop_wire.endpoint import dial
from iop_wire.tls import TlsConfig

__all__ = ["DEFAULT_PORT", "down", "up"]

DEFAULT_PORT = 7401
_METRICS_PORT = 9464  # Prometheus' customary port for a node's metrics
_START_TIMEOUT = 30.0
_STOP_TIMEOUT = 60.0
_LOG_TAIL = 2000


def up(state: Path, port: int | None = None, *, log_level: str | None = None) -> int:
    """Start the platform under ``state``; returns the exit code."""
    certs = state / "certs"
    if not (certs / "ca.crt").exists():
        init_dir(certs)
        print(f"minted a development CA and per-role certificates in {certs}")
    config, pidfile, log, ready = state / "node.yaml", state / "node.pid", state / "node.log", state / "node.ready"
    if (pid := _running(pidfile)) is not None:
        return _already_running(state, pid, port)
    if not config.exists():
        listen = DEFAULT_PORT if port is None else port
        config.write_text(yaml.safe_dump(_node_config(state, listen), sort_keys=False))
        print(f"wrote {config} (mock models; edit it to add routes)")
    elif port is not None and (refused := _set_port(config, port)):
        return refused
    _keep_previous(log)
    ready.unlink(missing_ok=True)
    command = [sys.executable, "-m", "iop_cli.main", *(["--log-level", log_level] if log_level else [])]
    with log.open("ab") as sink:
        process = subprocess.Popen(  # noqa: S603 - our own interpreter and module, no shell
            [*command, "node", "--config", str(config), "--ready-file", str(ready)],
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
            start_new_session=True,
        )
    pidfile.write_text(str(process.pid))
    started = _wait_ready(process, ready)
    if started is None:
        _abandon(process, pidfile)
        print(f"iop up: the node did not start; the end of {log}:\n{_tail(log)}", file=sys.stderr)
        return 1
    capabilities = asyncio.run(_capabilities(int(started["port"]), certs))
    _print_started(state, capabilities, started, certs, log)
    return 0


def down(state: Path) -> int:
    """Stop what ``up`` started; returns the exit code."""
    pidfile, ready = state / "node.pid", state / "node.ready"
    pid = _read_pid(pidfile)
    if pid is None:
        print("no node running")
        pidfile.unlink(missing_ok=True)
        return 0
    if not _is_our_node(pid):
        pidfile.unlink(missing_ok=True)
        ready.unlink(missing_ok=True)
        print(
            f"node (pid {pid}) was not running: it exited without 'iop down' (its log: {state / 'node.log'}); "
            f"removed the stale {pidfile}"
        )
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_TIMEOUT
    while _is_our_node(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _is_our_node(pid):
        print(f"iop down: node (pid {pid}) is still stopping after {_STOP_TIMEOUT:.0f} s; try again", file=sys.stderr)
        return 1
    pidfile.unlink(missing_ok=True)
    print(f"node (pid {pid}) stopped")
    return 0


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
        # With --port 0 (any free port), metrics take any free port too; the node reports both.
        "metrics": {"host": "127.0.0.1", "port": _METRICS_PORT if port and _free(_METRICS_PORT) else 0},
        "routes": [
            {"model": "mock-small", "adapter": "mock", "options": {"tokens": 64, "tokens_per_second": 200}},
            {"model": "mock-fast", "adapter": "mock", "max_concurrency": 64, "options": {"tokens": 256}},
        ],
    }


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _listen_port(config: Path) -> yaml.ScalarNode | None:
    """The ``listen.port`` value of the YAML file, as a node that knows where it is written."""
    try:
        tree = yaml.compose(config.read_text(), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return None
    for section, value in tree.value if isinstance(tree, yaml.MappingNode) else ():
        if section.value == "listen" and isinstance(value, yaml.MappingNode):
            for key, port in value.value:
                if key.value == "port" and isinstance(port, yaml.ScalarNode):
                    return port
    return None


def _set_port(config: Path, port: int) -> int | None:
    """Write ``port`` as ``listen.port`` into ``config``, the rest of it untouched; an exit code if it cannot."""
    node = _listen_port(config)
    if node is None:
        print(
            f"iop up: {config} has no listen.port to set to {port}: add one, or remove the file to have it rewritten",
            file=sys.stderr,
        )
        return 2
    if node.value != str(port):
        text = config.read_text()
        config.write_text(text[: node.start_mark.index] + str(port) + text[node.end_mark.index :])
        print(f"{config}: listen.port {node.value} -> {port}")
    return None


def _already_running(state: Path, pid: int, port: int | None) -> int:
    configured = _listen_port(state / "node.yaml")
    stop = iop_command("down", *_dir_args(state))
    if port is not None and configured is not None and configured.value != str(port):
        print(
            f"iop up: the node is running (pid {pid}) with listen.port {configured.value}; "
            f"stop it with '{stop}' to start it on port {port}",
            file=sys.stderr,
        )
        return 2
    where = _read_ready(state / "node.ready")
    at = f" at 127.0.0.1:{where['port']}" if where and where.get("port") else ""
    print(f"node already running (pid {pid}){at}; stop it with '{stop}'")
    return 0


def _keep_previous(log: Path) -> None:
    """Keep the last start's log (a crash's story) as ``node.log.1``; the new start writes a fresh one."""
    if log.exists() and log.stat().st_size:
        log.replace(log.with_name(log.name + ".1"))


def _wait_ready(process: subprocess.Popen[bytes], ready: Path) -> dict[str, Any] | None:
    """What the node wrote to its ready file once it served; None if it exited or took too long."""
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline and process.poll() is None:
        if (started := _read_ready(ready)) is not None:
            return started
        time.sleep(0.05)
    return None


def _read_ready(ready: Path) -> dict[str, Any] | None:
    try:
        started = json.loads(ready.read_text())
    except (OSError, ValueError):
        return None
    return started if isinstance(started, dict) else None


def _abandon(process: subprocess.Popen[bytes], pidfile: Path) -> None:
    """A node that did not start in time is stopped, not left behind unready."""
    if process.poll() is None:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=_STOP_TIMEOUT)
    pidfile.unlink(missing_ok=True)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-_LOG_TAIL:]


async def _capabilities(port: int, certs: Path) -> pb.CapabilityResponse:
    """Ask the node what it serves, over mTLS as an admin: proof that it is up."""
    tls = TlsConfig(enabled=True, cert=certs / "admin.crt", key=certs / "admin.key", ca=certs / "ca.crt")
    connection = await dial("127.0.0.1", port, tls=tls, server_hostname="localhost")
    try:
        return await connection.capabilities()
    finally:
        await connection.close("up check done")


def _print_started(
    state: Path, capabilities: pb.CapabilityResponse, started: dict[str, Any], certs: Path, log: Path
) -> None:
    models = ", ".join(m.name for a in capabilities.adapters for m in a.models)
    print(
        f"node {capabilities.node_id} up at 127.0.0.1:{started['port']} "
        f"(mTLS, certificates in {certs}), pid {started['pid']}"
    )
    print(f"models: {models}")
    if started.get("metrics_port"):
        print(f"metrics: http://127.0.0.1:{started['metrics_port']}/metrics")
    print(f"log: {log}")
    print(f"run history: {iop_command('runs', 'ls', *_dir_args(state))}")
    print(f"stop: {iop_command('down', *_dir_args(state))}")


def _dir_args(state: Path) -> list[str]:
    """``--dir DIR`` when the hint's command would not find ``state`` by default."""
    default = Path(os.environ.get("IOP_STATE_DIR", ".iop"))
    return [] if state == default else ["--dir", str(state)]


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text())
    except (OSError, ValueError):
        return None


def _running(pidfile: Path) -> int | None:
    """The pid in ``pidfile`` if it is a node ``up`` started that is still running."""
    pid = _read_pid(pidfile)
    return pid if pid is not None and _is_our_node(pid) else None


def _is_our_node(pid: int) -> bool:
    """Whether ``pid`` runs: not exited, not a zombie nobody reaped, not a new process that got the pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the pid
        return False
    proc = Path(f"/proc/{pid}")
    try:
        state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        command = (proc / "cmdline").read_bytes()
    except (OSError, IndexError):
        return True  # no /proc here: the signal check is all there is
    return state not in ("Z", "X") and b"iop_cli.main" in command and b"\0node\0" in command
