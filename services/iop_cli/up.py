"""``iop up`` / ``iop down`` / ``iop status``: the whole platform on this machine.

``up`` starts three processes with mTLS between them: ``iop control-plane``, one ``iop node``
registered with it (no listener of its own) and ``iop edge``, the OpenAI-compatible HTTP API. On
first start it creates, in the state folder ``DIR``: development certificates (``DIR/certs``),
``control-plane.yaml`` (port 7400, else a free one, printed), ``node.yaml`` (mock models
``mock-small`` and ``mock-fast``), ``edge.yaml`` (HTTP port 8000, else a free one, printed; auth
by API keys in ``edge-keys.db``) and an API key named ``local`` whose secret is kept in
``DIR/api-key`` (0600). Existing files are kept, except that ``--port`` sets ``http.port`` in
``edge.yaml`` and the node's and edge's ``control_plane.address`` follow the control-plane's port.
Metrics are on in every generated config (the edge serves them on its HTTP port).

``--backend URL`` rewrites ``node.yaml`` with one route per model of an OpenAI-compatible server
(``GET URL/v1/models``, adapter ``vllm``), or with ``ollama:URL`` of an Ollama server
(``GET URL/api/tags``, adapter ``ollama``); a backend that cannot be asked is one line, exit 2.

Start order: control-plane, then node and edge; each has 30 s to write its ready file
(``DIR/<service>.ready``), then the edge's ``GET /ready`` must answer 200 (a model is served).
A service that fails stops the others; its log's end is printed and the exit code is 1. Logs
are ``DIR/<service>.log`` (the previous start's kept as ``.log.1``), pids ``DIR/<service>.pid``.
A port in use (``--port N``, or a port an existing config sets) is one line naming it, exit 2;
so is a ``node.yaml`` or ``edge.yaml`` without ``control_plane.address`` (an older ``up``'s). On a
running state folder ``up`` says so, prints the base URL and key and changes nothing (exit 2 if
``--port`` asks for another port; exit 1 if only part of the platform runs). Once up it prints ``base URL: ...``,
``API key: ...``, a three-line OpenAI SDK example and the commands to go on, then returns; with
``--foreground`` it stays attached, prints every service's output prefixed ``control-plane | ``,
``node | ``, ``edge | `` (also written to the logs), and Ctrl-C (or SIGTERM) stops all three,
exit 0; if one exits by itself the others are stopped, exit 1.

``down`` sends SIGTERM to the edge, the node, then the control-plane, waits for each and prints
it stopped; pid files of processes that are gone are removed with a word. ``status`` prints
SERVICE, PID, ADDRESS, HEALTH per service (``--json``: a list of objects): the control-plane is
healthy once its ready file is written, the node when the control-plane (asked over mTLS with the
admin certificate) lists it ready, the edge when ``GET /health`` answers 200; exit 0 if all are.
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
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from iop_cli.shell import iop_command
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import init_dir
from iop_wire.endpoint import dial
from iop_wire.tls import TlsConfig

__all__ = ["CONTROL_PLANE_PORT", "EDGE_PORT", "down", "status", "up"]

CONTROL_PLANE_PORT = 7400
EDGE_PORT = 8000
_NODE_METRICS_PORT = 9464  # Prometheus' customary port for a node's metrics
_CONTROL_PLANE_METRICS_PORT = 9465
_SERVICES = ("control-plane", "node", "edge")
_START_TIMEOUT = 30.0
_STOP_TIMEOUT = 60.0
_HTTP_TIMEOUT = 5.0
_LOG_TAIL = 2000
_OUTPUT = threading.Lock()  # one line at a time on stdout in --foreground


class _Refused(Exception):
    """One line for stderr, and the exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _Service:
    """One of the platform's processes and its files in the state folder."""

    name: str
    state: Path

    def file(self, suffix: str) -> Path:
        return self.state / f"{self.name}{suffix}"

    def command(self, log_level: str | None) -> list[str]:
        level = ["--log-level", log_level] if log_level else []
        config, ready = str(self.file(".yaml")), str(self.file(".ready"))
        return [sys.executable, "-m", "iop_cli.main", *level, self.name, "--config", config, "--ready-file", ready]


def _services(state: Path) -> list[_Service]:
    return [_Service(name, state) for name in _SERVICES]


def up(
    state: Path,
    port: int | None = None,
    *,
    log_level: str | None = None,
    foreground: bool = False,
    backend: str | None = None,
) -> int:
    """Start the platform under ``state``; returns the exit code."""
    running = {s.name: pid for s in _services(state) if (pid := _running(s)) is not None}
    try:
        if running:
            return _already_running(state, running, port)
        _prepare(state, port, backend)
    except _Refused as exc:
        print(f"iop up: {exc}", file=sys.stderr)
        return exc.code
    platform = _Platform(state, log_level, foreground)
    # Set, not inherited: a shell starting `iop up &` has it ignore SIGINT, which Python keeps.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)} if foreground else {}
    try:
        _print_started(state, platform.start(), foreground)
        return platform.watch() if foreground else 0
    except _Refused as exc:
        platform.stop()
        print(f"iop up: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM in --foreground): stop all, in order
        if foreground:
            _say("stopping")
        platform.stop()
        return 0 if foreground else 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def down(state: Path) -> int:
    """Stop what ``up`` started, edge first; returns the exit code."""
    code, found = 0, False
    for service in reversed(_services(state)):
        pidfile = service.file(".pid")
        pid = _read_pid(pidfile)
        if pid is None:
            pidfile.unlink(missing_ok=True)
            continue
        found = True
        if not _is_ours(pid, service.name):
            pidfile.unlink(missing_ok=True)
            service.file(".ready").unlink(missing_ok=True)
            print(
                f"{service.name} (pid {pid}) was not running: it exited without 'iop down' "
                f"(its log: {service.file('.log')}); removed the stale {pidfile}"
            )
            continue
        if not _terminate(pid, service.name):
            print(f"iop down: {service.name} (pid {pid}) is still stopping after {_STOP_TIMEOUT:.0f} s; try again")
            code = 1
            continue
        pidfile.unlink(missing_ok=True)
        service.file(".ready").unlink(missing_ok=True)  # gone with the process, whatever it left
        print(f"{service.name} (pid {pid}) stopped")
    if not found:
        print(f"nothing running in {state}")
    return code


def status(state: Path, *, as_json: bool = False) -> int:
    """What ``up`` started: process, address and health of each service; 0 if all are up."""
    rows = [_status_row(service) for service in _services(state)]
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        table = [["SERVICE", "PID", "ADDRESS", "HEALTH"]]
        table += [[r["service"], str(r["pid"] or "-"), r["address"] or "-", r["health"]] for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(4)]
        for row in table:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0 if all(r["up"] for r in rows) else 1


# --- first start: certificates, configs, the API key --------------------------------------------------


def _prepare(state: Path, port: int | None, backend: str | None) -> None:
    if port:
        _check_free(port)
    state.mkdir(parents=True, exist_ok=True)
    certs = state / "certs"
    if not (certs / "ca.crt").exists():
        init_dir(certs)
        print(f"minted a development CA and per-role certificates in {certs}")
    routes = _backend_routes(backend) if backend else None
    control_plane = _prepare_control_plane(state)
    node = state / "node.yaml"
    if routes is not None or not node.exists():
        node.write_text(yaml.safe_dump(_node_config(state, control_plane, routes), sort_keys=False))
        print(f"wrote {node} ({'models of ' + str(backend) if routes else 'mock models'}; edit it to add routes)")
    _prepare_edge(state, control_plane, port)
    for config in (node, state / "edge.yaml"):  # up points them at the control-plane it started
        if _yaml_node(config, ("control_plane", "address")) is None:
            raise _Refused(
                f"{config} has no control_plane.address (written by an older 'iop up'?): "
                "add one, or remove the file to have it rewritten",
                2,
            )
    _ensure_key(state)


def _prepare_control_plane(state: Path) -> int:
    config = state / "control-plane.yaml"
    if not config.exists():
        port = _default_or_free(CONTROL_PLANE_PORT, "the control-plane")
        config.write_text(yaml.safe_dump(_control_plane_config(state, port), sort_keys=False))
        print(f"wrote {config}")
        return port
    port = _port_of(config, ("listen", "port"), CONTROL_PLANE_PORT)
    if port and not _free(port):
        raise _Refused(f"127.0.0.1:{port} (listen.port of {config}) is in use", 2)
    return port


def _prepare_edge(state: Path, control_plane: int, port: int | None) -> None:
    config = state / "edge.yaml"
    if not config.exists():
        chosen = _default_or_free(EDGE_PORT, "the edge") if port is None else port
        config.write_text(yaml.safe_dump(_edge_config(state, control_plane, chosen), sort_keys=False))
        print(f"wrote {config}")
        return
    if port is not None:
        _set_value(config, ("http", "port"), port)
    configured = _port_of(config, ("http", "port"), EDGE_PORT)
    if port is None and configured and not _free(configured):
        raise _Refused(f"127.0.0.1:{configured} (http.port of {config}) is in use; pass --port N, or 0 for any", 2)


def _check_free(port: int) -> None:
    if not _free(port):
        raise _Refused(f"port {port} is in use on 127.0.0.1; pass another --port, or 0 for any free one", 2)


def _default_or_free(port: int, who: str) -> int:
    if _free(port):
        return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        chosen: int = probe.getsockname()[1]
    print(f"port {port} is in use: {who} takes port {chosen}")
    return chosen


def _tls(state: Path, role: str) -> dict[str, object]:
    certs = (state / "certs").resolve()
    return {
        "enabled": True,
        "cert": str(certs / f"{role}.crt"),
        "key": str(certs / f"{role}.key"),
        "ca": str(certs / "ca.crt"),
    }


def _control_plane_config(state: Path, port: int) -> dict[str, object]:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "tls": _tls(state, "control-plane"),
        "store_path": str((state / "control-plane.db").resolve()),
        "metrics": {
            "host": "127.0.0.1",
            "port": _CONTROL_PLANE_METRICS_PORT if _free(_CONTROL_PLANE_METRICS_PORT) else 0,
        },
    }


def _node_config(state: Path, control_plane: int, routes: list[dict[str, Any]] | None) -> dict[str, object]:
    return {
        "node_id": "local-node",
        "listen": {"enabled": False},
        "control_plane": {"address": f"127.0.0.1:{control_plane}", "server_name": "localhost"},
        "tls": _tls(state, "node"),
        "store_path": str((state / "node-runs.db").resolve()),
        "metrics": {"host": "127.0.0.1", "port": _NODE_METRICS_PORT if _free(_NODE_METRICS_PORT) else 0},
        "routes": routes
        or [
            {"model": "mock-small", "adapter": "mock", "options": {"tokens": 64, "tokens_per_second": 200}},
            {"model": "mock-fast", "adapter": "mock", "max_concurrency": 64, "options": {"tokens": 256}},
        ],
    }


def _edge_config(state: Path, control_plane: int, port: int) -> dict[str, object]:
    return {
        "http": {"host": "127.0.0.1", "port": port},
        "control_plane": {"address": f"127.0.0.1:{control_plane}", "server_name": "localhost"},
        "tls": _tls(state, "edge"),
        "auth": "keys",
        "keys_path": str((state / "edge-keys.db").resolve()),
    }


def _backend_routes(backend: str) -> list[dict[str, Any]]:
    """One route per model the backend lists; _Refused (exit 2) if it cannot be asked."""
    ollama = backend.startswith("ollama:")
    url = backend.removeprefix("ollama:")
    base = url.rstrip("/").removesuffix("/v1")
    try:
        listing = _get_json(base + ("/api/tags" if ollama else "/v1/models"))
        names = [m["name"] for m in listing["models"]] if ollama else [m["id"] for m in listing["data"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _Refused(f"cannot list the models of the backend at {url}: {_reason(exc)}", 2) from None
    if not names:
        raise _Refused(f"the backend at {url} serves no models", 2)
    adapter = "ollama" if ollama else "vllm"
    return [{"model": str(name), "adapter": adapter, "options": {"base_url": base}} for name in names]


def _ensure_key(state: Path) -> None:
    secret = state / "api-key"
    if secret.exists():
        return
    from iop_edge.keys import create_key  # the edge's key store: imported only on first start

    value = create_key((state / "edge-keys.db").resolve(), "local")
    secret.touch(mode=0o600)
    secret.write_text(value + "\n")
    print(f"created the API key 'local' (kept in {secret})")


# --- YAML values set in place, the rest of the file as the user left it ------------------------------


def _yaml_node(config: Path, keys: tuple[str, str]) -> yaml.ScalarNode | None:
    try:
        tree = yaml.compose(config.read_text(), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return None
    for section, value in tree.value if isinstance(tree, yaml.MappingNode) else ():
        if section.value == keys[0] and isinstance(value, yaml.MappingNode):
            for key, found in value.value:
                if key.value == keys[1] and isinstance(found, yaml.ScalarNode):
                    return found
    return None


def _yaml_value(config: Path, keys: tuple[str, str]) -> str | None:
    node = _yaml_node(config, keys)
    return None if node is None else str(node.value)


def _port_of(config: Path, keys: tuple[str, str], default: int) -> int:
    """The port set at ``keys`` (``default`` when unset); 0 when it is no number: the service will say so."""
    value = _yaml_value(config, keys)
    if value is None:
        return default
    return int(value) if value.isdigit() else 0


def _set_value(config: Path, keys: tuple[str, str], value: int | str) -> None:
    """Write ``value`` at ``keys`` into ``config``, the rest untouched; _Refused if there is no such key."""
    node = _yaml_node(config, keys)
    name = ".".join(keys)
    if node is None:
        raise _Refused(f"{config} has no {name} to set to {value}: add one, or remove the file to have it rewritten", 2)
    if node.value != str(value):
        text = config.read_text()
        written = str(value) if isinstance(value, int) else json.dumps(value)
        config.write_text(text[: node.start_mark.index] + written + text[node.end_mark.index :])
        print(f"{config}: {name} {node.value} -> {value}")


# --- starting, watching and stopping the processes ----------------------------------------------------


class _Platform:
    """The processes one ``up`` started, in start order."""

    def __init__(self, state: Path, log_level: str | None, foreground: bool) -> None:
        self.state, self.log_level, self.foreground = state, log_level, foreground
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.readers: list[threading.Thread] = []

    def start(self) -> dict[str, dict[str, Any]]:
        """Start all three and wait until the edge serves a model; what each wrote to its ready file."""
        control_plane, node, edge = _services(self.state)
        started = {"control-plane": self._start(control_plane)}
        address = f"127.0.0.1:{started['control-plane']['port']}"
        for config in (node.file(".yaml"), edge.file(".yaml")):
            _set_value(config, ("control_plane", "address"), address)
        self._spawn(node)
        self._spawn(edge)
        started["node"] = self._wait(node)
        started["edge"] = self._wait(edge)
        self._wait_served(edge, int(started["edge"]["port"]))
        return started

    def _start(self, service: _Service) -> dict[str, Any]:
        self._spawn(service)
        return self._wait(service)

    def _spawn(self, service: _Service) -> None:
        log = service.file(".log")
        if log.exists() and log.stat().st_size:  # the last start's log (a crash's story) is kept
            log.replace(log.with_name(log.name + ".1"))
        service.file(".ready").unlink(missing_ok=True)
        with log.open("ab") as sink:
            process = subprocess.Popen(  # noqa: S603 - our own interpreter and module, no shell
                service.command(self.log_level),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.foreground else sink,
                stderr=subprocess.STDOUT if self.foreground else sink,
                start_new_session=True,  # Ctrl-C reaches `iop up` only, which stops them in order
            )
        self.processes[service.name] = process
        service.file(".pid").write_text(str(process.pid))
        if self.foreground:
            assert process.stdout is not None
            reader = threading.Thread(target=_relay, args=(service.name, process.stdout, log), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _wait(self, service: _Service) -> dict[str, Any]:
        process, ready = self.processes[service.name], service.file(".ready")
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline and process.poll() is None:
            if (started := _read_ready(ready)) is not None:
                return started
            time.sleep(0.05)
        raise self._failed(service)

    def _wait_served(self, edge: _Service, port: int) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline and all(p.poll() is None for p in self.processes.values()):
            if _http_status(f"http://127.0.0.1:{port}/ready") == 200:
                return
            time.sleep(0.1)
        dead = next((s for s in _services(self.state) if self.processes[s.name].poll() is not None), None)
        raise self._failed(dead or edge, None if dead else "serves no model (GET /ready)")

    def _failed(self, service: _Service, what: str | None = None) -> _Refused:
        code = self.processes[service.name].poll()
        if what is None:
            what = f"exited (code {code})" if code is not None else "did not start"
        for reader in self.readers:
            reader.join(timeout=1)
        log = service.file(".log")
        tail = log.read_text(errors="replace")[-_LOG_TAIL:] if log.exists() else ""
        return _Refused(f"the {service.name} {what} within {_START_TIMEOUT:.0f} s; the end of {log}:\n{tail}", 1)

    def stop(self) -> None:
        """SIGTERM the edge, the node, then the control-plane, each waited for (SIGKILL if it hangs)."""
        for name in reversed(_SERVICES):
            process = self.processes.get(name)
            if process is None:
                continue
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=_STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            for suffix in (".pid", ".ready"):
                (self.state / f"{name}{suffix}").unlink(missing_ok=True)
        for reader in self.readers:
            reader.join(timeout=5)

    def watch(self) -> int:
        """--foreground: wait; a service that exits by itself stops the others (exit 1)."""
        while all(process.poll() is None for process in self.processes.values()):
            time.sleep(0.1)
        gone = next(name for name, process in self.processes.items() if process.poll() is not None)
        _say(f"{gone} exited (code {self.processes[gone].returncode}); stopping the others")
        self.stop()
        return 1


def _interrupt(signum: int, frame: object) -> None:
    """--foreground: SIGINT and SIGTERM stop the platform."""
    raise KeyboardInterrupt


def _relay(name: str, stream: IO[bytes], log: Path) -> None:
    """--foreground: a service's output, line by line, to stdout (prefixed) and to its log."""
    with log.open("ab") as sink:
        for line in stream:
            sink.write(line)
            sink.flush()
            _say(f"{name} | {line.decode(errors='replace').rstrip()}")


def _say(line: str) -> None:
    with _OUTPUT:
        print(line, flush=True)


def _terminate(pid: int, name: str) -> bool:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_TIMEOUT
    while _is_ours(pid, name) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _is_ours(pid, name)


# --- what up prints ----------------------------------------------------------------------------------


def _print_started(state: Path, started: dict[str, dict[str, Any]], foreground: bool) -> None:
    control_plane, node, edge = started["control-plane"], started["node"], started["edge"]
    base = f"http://127.0.0.1:{edge['port']}/v1"
    key = _read_key(state)
    models = _served_models(base, key)
    lines = [
        f"control-plane at 127.0.0.1:{control_plane['port']} (mTLS), pid {control_plane['pid']}"
        + _metrics(control_plane),
        f"node {node.get('node_id', 'local-node')} registered with it, pid {node['pid']}" + _metrics(node),
        f"edge at http://127.0.0.1:{edge['port']}, pid {edge['pid']}, metrics http://127.0.0.1:{edge['port']}/metrics",
        f"models: {', '.join(models)}",
        "",
        f"base URL: {base}",
        f"API key: {key}",
        "",
        "from openai import OpenAI",
        f'client = OpenAI(base_url="{base}", api_key="{key}")',
        f'print(client.chat.completions.create(model="{models[0] if models else "mock-small"}", '
        'messages=[{"role": "user", "content": "hi"}]).choices[0].message.content)',
        "",
        f"chat: {iop_command('chat', *_dir_args(state), 'hello')}",
        f"status: {iop_command('status', *_dir_args(state))}",
        f"logs: {state / 'control-plane.log'}, {state / 'node.log'}, {state / 'edge.log'}",
        f"run history: {iop_command('runs', 'ls', *_dir_args(state))}",
        "stop: Ctrl-C" if foreground else f"stop: {iop_command('down', *_dir_args(state))}",
    ]
    _say("\n".join(lines))


def _metrics(started: dict[str, Any]) -> str:
    port = started.get("metrics_port")
    return f", metrics http://127.0.0.1:{port}/metrics" if port else ""


def _served_models(base: str, key: str) -> list[str]:
    try:
        listing = _get_json(base + "/models", key)
        return [str(model["id"]) for model in listing["data"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _read_key(state: Path) -> str:
    try:
        return (state / "api-key").read_text().strip()
    except OSError:
        return "(none: remove the state folder's edge-keys.db and start again)"


def _already_running(state: Path, running: dict[str, int], port: int | None) -> int:
    stop = iop_command("down", *_dir_args(state))
    pids = ", ".join(f"{name} pid {pid}" for name, pid in running.items())
    if len(running) < len(_SERVICES):
        raise _Refused(f"part of the platform runs in {state} ({pids}); stop it with '{stop}' and start again", 1)
    configured = _yaml_value(state / "edge.yaml", ("http", "port"))
    if port is not None and configured is not None and configured != str(port):
        raise _Refused(
            f"the edge is running ({pids}) with http.port {configured}; "
            f"stop it with '{stop}' to start it on port {port}",
            2,
        )
    print(f"the platform is already running in {state} ({pids}); stop it with '{stop}'")
    edge = _read_ready(state / "edge.ready")
    if edge and edge.get("port"):
        print(f"base URL: http://127.0.0.1:{edge['port']}/v1")
    print(f"API key: {_read_key(state)}")
    return 0


def _dir_args(state: Path) -> list[str]:
    """``--dir DIR`` when the hint's command would not find ``state`` by default."""
    default = Path(os.environ.get("IOP_STATE_DIR", ".iop"))
    return [] if state == default else ["--dir", str(state)]


# --- status --------------------------------------------------------------------------------------------


def _status_row(service: _Service) -> dict[str, Any]:
    pid = _running(service)
    ready = _read_ready(service.file(".ready")) if pid is not None else None
    row: dict[str, Any] = {"service": service.name, "pid": pid, "address": None, "health": "stopped", "up": False}
    if pid is None:
        return row
    if ready is None:
        return {**row, "health": "starting"}
    match service.name:
        case "control-plane":
            return {**row, "address": f"127.0.0.1:{ready['port']}", "health": "ok", "up": True}
        case "node":
            state = _node_state(service.state, str(ready.get("node_id", "")))
            return {**row, "address": f"registered as {ready.get('node_id')}", "health": state, "up": state == "ready"}
        case _:
            code = _http_status(f"http://127.0.0.1:{ready['port']}/health")
            health = "ok" if code == 200 else f"HTTP {code}" if code else "not answering"
            return {**row, "address": f"http://127.0.0.1:{ready['port']}/v1", "health": health, "up": code == 200}


def _node_state(state: Path, node_id: str) -> str:
    """The node's state as the control-plane sees it (asked over mTLS as an admin)."""
    control_plane = _read_ready(state / "control-plane.ready")
    if not control_plane:
        return "no control-plane"
    try:
        listed = asyncio.run(_nodes_list(int(control_plane["port"]), state / "certs"))
    except Exception as exc:  # noqa: BLE001 - any failure to ask is shown, not raised
        return f"unknown ({_reason(exc)})"
    names = {pb.NODE_STATE_READY: "ready", pb.NODE_STATE_UNAVAILABLE: "unavailable", pb.NODE_STATE_DRAINING: "draining"}
    for node in listed.nodes:
        if node.node_id == node_id:
            return names.get(node.state, "unspecified")
    return "not registered"


async def _nodes_list(port: int, certs: Path) -> pb.NodesListed:
    tls = TlsConfig(enabled=True, cert=certs / "admin.crt", key=certs / "admin.key", ca=certs / "ca.crt")
    connection = await dial("127.0.0.1", port, tls=tls, server_hostname="localhost", timeout=_HTTP_TIMEOUT)
    try:
        answer = await connection.request(pb.Envelope(nodes_list=pb.NodesList()), timeout=_HTTP_TIMEOUT)
    finally:
        await connection.close("status done")
    return answer.nodes_listed


# --- small helpers -------------------------------------------------------------------------------------


def _get_json(url: str, key: str | None = None) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})  # noqa: S310 - http(s) URLs only
    with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT) as answer:  # noqa: S310 - see above
        return json.loads(answer.read())


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT) as answer:  # noqa: S310 - our own edge on loopback
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        return str(getattr(exc.reason, "strerror", None) or exc.reason)
    return str(getattr(exc, "strerror", None) or exc) or type(exc).__name__


def _free(port: int) -> bool:
    """Whether a server could listen on ``port`` (servers reuse addresses: TIME_WAIT does not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _read_ready(ready: Path) -> dict[str, Any] | None:
    try:
        started = json.loads(ready.read_text())
    except (OSError, ValueError):
        return None
    return started if isinstance(started, dict) else None


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text())
    except (OSError, ValueError):
        return None


def _running(service: _Service) -> int | None:
    """The pid in the service's pid file if it is a process ``up`` started that still runs."""
    pid = _read_pid(service.file(".pid"))
    return pid if pid is not None and _is_ours(pid, service.name) else None


def _is_ours(pid: int, name: str) -> bool:
    """Whether ``pid`` runs ``iop NAME``: not exited, not a zombie, not a new process that got the pid."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or someone else's process took the pid
        return False
    proc = Path(f"/proc/{pid}")
    try:
        state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        command = (proc / "cmdline").read_bytes()
    except (OSError, IndexError):
        return True  # no /proc here: the signal check is all there is
    return state not in ("Z", "X") and b"iop_cli.main" in command and f"\0{name}\0".encode() in command
