"""``iop up`` / ``iop down`` / ``iop status``: the whole platform on this machine.

``up`` starts four processes with mTLS between them: ``iop control-plane``, one ``iop node``
registered with it (no listener of its own), ``iop worker`` (OpenAI's Files and Batches: its
lines run through the control-plane) and ``iop edge``, the OpenAI-compatible HTTP API. On first
start it creates, in the state folder ``DIR``: development certificates (``DIR/certs``),
``control-plane.yaml`` (port 7400, else a free one, printed), ``node.yaml`` (mock models
``mock-small`` and ``mock-fast``), ``worker.yaml`` (port 7402, else a free one; jobs in
``worker.db``), ``edge.yaml`` (HTTP port 8000, else a free one, printed; auth by API keys in
``edge-keys.db``; its ``worker`` section names the worker) and an API key named ``local`` whose
secret is kept in ``DIR/api-key`` (0600). Existing files are kept, except that ``--port`` sets
``http.port`` in ``edge.yaml``, the node's, worker's and edge's ``control_plane.address`` follow
the control-plane's port, and the edge's ``worker.address`` the worker's (an ``edge.yaml`` of an
older ``up`` without a ``worker`` section gets one appended). Metrics are on in every generated
config (the edge serves them on its HTTP port).

``--backend URL`` rewrites ``node.yaml`` with one route per model of an OpenAI-compatible server
(``GET URL/v1/models``, adapter ``vllm``), or with ``ollama:URL`` of an Ollama server
(``GET URL/api/tags``, adapter ``ollama``), each with the ``max_concurrency`` the server takes
(``iop_cli.configs.backend_concurrency``); a backend that cannot be asked is one line, exit 2.

Before anything is written or started, ``up`` takes ``DIR/up.lock`` (a second ``up`` or a ``down``
at work is one line, exit 2) and checks every file that exists (``iop_cli.preflight``: each config
by its service's settings loader, the edge's key file, ``DIR/api-key``): a problem is one line
naming the file and key, exit 2, nothing started. So is a port in use (``--port N``, or a port an
existing config sets), and a ``node.yaml`` or ``edge.yaml`` without ``control_plane.address`` (an
older ``up``'s).

Then ``up`` starts ``iop supervise`` (``iop_cli.supervisor``) in its own session and waits until
it runs the platform: control-plane, then node and worker, then the edge; each has 30 s to write
its ready file (``DIR/<service>.ready``), then the edge's ``GET /ready`` must answer 200 (a model
is served). A service that fails to start stops the others; its log's end is printed and the exit
code is 1. Once running, the supervisor restarts a service that exits, with backoff. Logs are
``DIR/<service>.log`` (the previous start's kept as ``.log.1``) and ``DIR/supervise.log``, pids
``DIR/<service>.pid`` and ``DIR/supervise.pid``. On a running state folder ``up`` says so, prints
the base URL and key and changes nothing (exit 2 if ``--port`` asks for another port; exit 1 if
only part of the platform runs). Once up it prints ``base URL: ...``, ``API key: ...``, a
three-line OpenAI SDK example and the commands to go on, then returns; with ``--foreground`` no
supervisor: ``up`` stays attached, prints every service's output prefixed ``control-plane | ``,
``node | ``, ``worker | ``, ``edge | `` (also written to the logs), and Ctrl-C (or SIGTERM) stops
all, exit 0; if one exits by itself the others are stopped, exit 1.

``down`` stops the supervisor, which stops the edge, the worker, the node, then the control-plane,
each waited for; then any service still running (an older ``up``'s, or one whose supervisor was
killed), in the same order; it prints each one stopped; pid files of processes that are gone are
removed with a word. ``status`` prints SERVICE, PID, ADDRESS, HEALTH, RESTARTS, LAST EXIT per
service (``--json``: a list of objects): the control-plane is healthy once its ready file is
written, the node when the control-plane (asked over mTLS with the admin certificate) lists it
ready, the worker when it answers a ``batches.list`` (asked the same way), the edge when ``GET
/health`` answers 200; restarts and the last exit are the supervisor's; exit 0 if all are up.

This module holds the three commands and what they print; the files ``up`` writes are
``iop_cli.configs``'s, the processes it starts and stops ``iop_cli.platform``'s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from iop_cli.addresses import check_listen, others_use
from iop_cli.configs import (
    CONTROL_PLANE_PORT,
    EDGE_PORT,
    HTTP_TIMEOUT,
    get_json,
    prepare,
    reason,
    yaml_value,
)
from iop_cli.ops import NODE_STATES
from iop_cli.output import CliError, emit, table
from iop_cli.platform import (
    SERVICES,
    STOP_TIMEOUT,
    Platform,
    Service,
    http_status,
    is_joined,
    is_ours,
    last_dial_refused,
    read_joined,
    read_pid,
    running_pid,
    say,
    service_names,
    services,
    terminate,
)
from iop_cli.preflight import check_files, choosing_ports, only_up
from iop_cli.readyfile import read_ready
from iop_cli.shell import iop_command
from iop_cli.supervisor import read_state, state_file
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.blocking import BlockingClient
from iop_wire.tls import TlsConfig, client_context

__all__ = ["CONTROL_PLANE_PORT", "EDGE_PORT", "down", "run_attached", "start_supervised", "status", "up"]

_SUPERVISED_START = 180.0  # the supervisor's Platform.start: 30 s for each service, then the edge's /ready
_SUPERVISED_STOP = len(SERVICES) * STOP_TIMEOUT + 10  # it stops the services one after the other


def up(
    state: Path,
    port: int | None = None,
    *,
    log_level: str | None = None,
    foreground: bool = False,
    backend: str | None = None,
    listen: Sequence[str] = (),
) -> int:
    """Start the platform under ``state``; returns the exit code (CliError: one line, nothing left running).

    ``listen``: addresses of this machine other machines reach it at (``--listen``)."""
    if is_joined(state):
        options = {"--port": port is not None, "--backend": backend is not None, "--listen": bool(listen)}
        return _up_joined(state, [option for option, given in options.items() if given], log_level, foreground)
    listen = check_listen(listen)
    with contextlib.ExitStack() as lock:
        lock.enter_context(only_up(state, "up"))
        running = {s.name: pid for s in _watched(state) if (pid := running_pid(s)) is not None}
        if running:
            return _already_running(state, running, port)
        check_files(state)  # before any port check or process: a broken file is named as what it is
        lock.enter_context(choosing_ports())  # until the services listen on the ports chosen
        prepare(state, port, backend, listen)
        if foreground:
            return _foreground(Platform(state, log_level, foreground=True), started=lock.close)
        _print_started(state, start_supervised(state, log_level), foreground=False)
        return 0


def _foreground(platform: Platform, started: Callable[[], None]) -> int:
    """Start the services attached: their output relayed; Ctrl-C, SIGTERM or one exiting stops all.

    ``started`` is called once they run (the lock goes: ``iop down`` from elsewhere may stop them)."""

    def print_started(services: dict[str, dict[str, Any]]) -> None:
        _print_started(platform.state, services, foreground=True)
        started()

    return run_attached(platform, print_started)


def run_attached(platform: Platform, on_start: Callable[[dict[str, dict[str, Any]]], None]) -> int:
    """Run ``platform`` attached (``iop up --foreground``, ``iop join --foreground``): ``on_start``
    gets what each service wrote to its ready file once they run; Ctrl-C or SIGTERM stops them
    (exit 0), one exiting stops the others (its code); a CliError stops them and goes on up."""
    # Set, not inherited: a shell starting `iop up &` has it ignore SIGINT, which Python keeps.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        on_start(platform.start())
        return platform.watch()
    except CliError:
        platform.stop()
        raise
    except KeyboardInterrupt:
        say("stopping")
        platform.stop()
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def start_supervised(state: Path, log_level: str | None) -> dict[str, dict[str, Any]]:
    """Start ``iop supervise`` in its own session and wait until it runs the platform; what each service wrote."""
    state_file(state).unlink(missing_ok=True)
    supervisor = Service("supervise", state)
    level = ["--log-level", log_level] if log_level else []
    with supervisor.file(".log").open("ab") as sink:
        process = subprocess.Popen(  # noqa: S603 - our own interpreter and module, no shell
            [sys.executable, "-m", "iop_cli.main", *level, "supervise", "--dir", str(state)],
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
            start_new_session=True,  # it outlives this command and the terminal's Ctrl-C
        )
    supervisor.file(".pid").write_text(str(process.pid))
    try:
        return _wait_supervised(state, process, supervisor)
    except KeyboardInterrupt:  # Ctrl-C while it starts: nothing is left running
        terminate(process.pid, "supervise", _SUPERVISED_STOP)
        raise CliError("interrupted; stopped what had started", 130) from None


def _wait_supervised(state: Path, process: subprocess.Popen[bytes], supervisor: Service) -> dict[str, dict[str, Any]]:
    """Wait until the supervisor runs the platform; CliError if it failed to start it (or took too long)."""
    deadline = time.monotonic() + _SUPERVISED_START
    while time.monotonic() < deadline:
        found = read_state(state) or {}
        if found.get("phase") == "running":
            return {name: read_ready(state / f"{name}.ready") or {} for name in service_names(state)}
        if found.get("phase") == "failed":
            process.wait(timeout=STOP_TIMEOUT)
            supervisor.file(".pid").unlink(missing_ok=True)
            raise CliError(str(found.get("error")), int(found.get("code", 1)))
        if process.poll() is not None:
            supervisor.file(".pid").unlink(missing_ok=True)
            raise CliError(f"the supervisor exited (code {process.returncode}); see {supervisor.file('.log')}", 1)
        time.sleep(0.05)
    terminate(process.pid, "supervise", _SUPERVISED_STOP)
    raise CliError(f"the platform did not start within {_SUPERVISED_START:.0f} s; see {state}/*.log", 1)


def down(state: Path) -> int:
    """Stop what ``up`` started: the supervisor (which stops the services, edge first), then any left; the exit code."""
    if not state.is_dir():
        print(f"nothing running in {state}")
        return 0
    with only_up(state, "down"):
        before = {service.name: running_pid(service) for service in services(state)}
        supervisor = Service("supervise", state)
        if (pid := running_pid(supervisor)) is not None and not terminate(pid, "supervise", _SUPERVISED_STOP):
            raise CliError(f"the supervisor (pid {pid}) is still stopping after {_SUPERVISED_STOP:.0f} s; try again", 1)
        supervisor.file(".pid").unlink(missing_ok=True)
        state_file(state).unlink(missing_ok=True)
        return _stop_services(state, before)


def _stop_services(state: Path, stopped: dict[str, int | None]) -> int:
    """Stop each service still running, edge first; ``stopped``: the pids the supervisor had, now gone."""
    code, found = 0, False
    for service in reversed(services(state)):
        pidfile = service.file(".pid")
        pid = read_pid(pidfile)
        if pid is None:
            if (gone := stopped.get(service.name)) is not None:
                found = True
                print(f"{service.name} (pid {gone}) stopped")
            pidfile.unlink(missing_ok=True)
            continue
        found = True
        if not is_ours(pid, service.name):
            pidfile.unlink(missing_ok=True)
            service.file(".ready").unlink(missing_ok=True)
            print(
                f"{service.name} (pid {pid}) was not running: it exited without 'iop down' "
                f"(its log: {service.file('.log')}); removed the stale {pidfile}"
            )
            continue
        if not terminate(pid, service.name):
            print(f"iop down: {service.name} (pid {pid}) is still stopping after {STOP_TIMEOUT:.0f} s; try again")
            code = 1
            continue
        pidfile.unlink(missing_ok=True)
        service.file(".ready").unlink(missing_ok=True)  # gone with the process, whatever it left
        print(f"{service.name} (pid {pid}) stopped")
    if not found:
        print(f"nothing running in {state}")
    return code


def status(state: Path, *, as_json: bool = False) -> int:
    """What ``up`` started: process, address, health and restarts of each service; 0 if all are up."""
    supervised = (read_state(state) or {}).get("services", {})
    rows = [{**_status_row(service), **_restarts(supervised.get(service.name))} for service in services(state)]
    header = ["SERVICE", "PID", "ADDRESS", "HEALTH", "RESTARTS", "LAST EXIT"]
    reached = [f"{r['service']} {', '.join(r['others_use'])}" for r in rows if r.get("others_use")]
    cells = [
        [
            r["service"],
            str(r["pid"] or "-"),
            r["address"] or "-",
            r["health"],
            str(r["restarts"]),
            r["last_exit"] or "-",
        ]
        for r in rows
    ]
    text = table([header, *cells]) + (f"\nfrom other machines: {'; '.join(reached)}" if reached else "")
    emit(rows, as_json=as_json, text=text)
    return 0 if all(r["up"] for r in rows) else 1


def _restarts(supervised: dict[str, Any] | None) -> dict[str, Any]:
    """What the supervisor counted for a service: restarts, how it last exited, whether it was given up."""
    seen = supervised or {}
    row: dict[str, Any] = {"restarts": int(seen.get("restarts", 0)), "last_exit": seen.get("last_exit")}
    if seen.get("state") == "given up":
        row["health"] = "given up (crash loop; see its log)"
    elif seen.get("state") == "restarting":
        row["health"] = "restarting"
    return row


def _interrupt(signum: int, frame: object) -> None:
    """--foreground: SIGINT and SIGTERM stop the platform."""
    raise KeyboardInterrupt


# --- what up prints ----------------------------------------------------------------------------------


def _print_started(state: Path, started: dict[str, dict[str, Any]], foreground: bool) -> None:
    control_plane, node, worker, edge = (started[name] for name in SERVICES)
    base = f"http://127.0.0.1:{edge['port']}/v1"
    key = _read_key(state)
    models = _served_models(base, key)
    lines = [
        f"control-plane at 127.0.0.1:{control_plane['port']} (mTLS), pid {control_plane['pid']}"
        + _metrics(control_plane),
        f"node {node.get('node_id', 'local-node')} registered with it, pid {node['pid']}" + _metrics(node),
        f"worker at 127.0.0.1:{worker['port']} (mTLS; files and batches), pid {worker['pid']}" + _metrics(worker),
        f"edge at http://127.0.0.1:{edge['port']}, pid {edge['pid']}, metrics http://127.0.0.1:{edge['port']}/metrics",
        f"models: {', '.join(models)}",
        *_reachable(state, control_plane["port"], edge["port"]),
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
        f"logs: {', '.join(str(state / f'{name}.log') for name in SERVICES)}",
        f"run history: {iop_command('runs', 'ls', *_dir_args(state))}",
        f"batches: {iop_command('batches', 'ls', *_dir_args(state))}",
        "stop: Ctrl-C" if foreground else f"stop: {iop_command('down', *_dir_args(state))}",
    ]
    say("\n".join(lines))


def _reachable(state: Path, control_plane: int, edge: int) -> list[str]:
    """What other machines use (``--listen``): the control-plane's and the edge's addresses, how to join."""
    hosts = others_use(state / "control-plane.yaml")
    if not hosts:
        return []
    edges = [f"http://{host}:{edge}/v1" for host in others_use(state / "edge.yaml", "http")]
    return [
        f"from other machines: control-plane {', '.join(f'{host}:{control_plane}' for host in hosts)}"
        + (f", edge {', '.join(edges)}" if edges else ""),
        f"another machine joins with the line {iop_command('join-token', 'create', *_dir_args(state))} prints",
    ]


def _metrics(started: dict[str, Any]) -> str:
    port = started.get("metrics_port")
    return f", metrics http://127.0.0.1:{port}/metrics" if port else ""


def _served_models(base: str, key: str) -> list[str]:
    try:
        listing = get_json(base + "/models", key)
        return [str(model["id"]) for model in listing["data"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _read_key(state: Path) -> str:
    try:
        key = (state / "api-key").read_text().strip()
    except (OSError, UnicodeDecodeError):
        key = ""
    return key or f"(none in {state / 'api-key'}: 'iop keys create NAME --dir {state}' makes one)"


def _up_joined(state: Path, given: list[str], log_level: str | None, foreground: bool) -> int:
    """``up`` in a folder ``iop join`` made: its node started again, with the certificate it holds."""
    from iop_cli.join import start_joined  # here: iop_cli.join imports this module

    if given:
        raise CliError(
            f"{state} holds a node 'iop join' made: {', '.join(given)} apply to a platform 'iop up' made; "
            "'iop up' there starts the node as it joined",
            2,
        )
    with only_up(state, "up"):
        if (pid := running_pid(Service("node", state))) is not None:
            stop = iop_command("down", *_dir_args(state))
            print(f"the node 'iop join' made runs in {state} (pid {pid}); stop it with '{stop}'")
            return 0
        check_files(state)
    return start_joined(state, log_level, foreground=foreground)


def _already_running(state: Path, running: dict[str, int], port: int | None) -> int:
    stop = iop_command("down", *_dir_args(state))
    pids = ", ".join(f"{name} pid {pid}" for name, pid in running.items())
    if not running.keys() >= set(SERVICES):
        raise CliError(f"part of the platform runs in {state} ({pids}); stop it with '{stop}' and start again", 1)
    configured = yaml_value(state / "edge.yaml", ("http", "port"))
    if port is not None and configured is not None and configured != str(port):
        raise CliError(
            f"the edge is running ({pids}) with http.port {configured}; "
            f"stop it with '{stop}' to start it on port {port}",
            2,
        )
    print(f"the platform is already running in {state} ({pids}); stop it with '{stop}'")
    edge = read_ready(state / "edge.ready")
    if edge and edge.get("port"):
        print(f"base URL: http://127.0.0.1:{edge['port']}/v1")
    print(f"API key: {_read_key(state)}")
    return 0


def _watched(state: Path) -> list[Service]:
    """The services and the supervisor that keeps them running."""
    return [*services(state), Service("supervise", state)]


def _dir_args(state: Path) -> list[str]:
    """``--dir DIR`` when the hint's command would not find ``state`` by default."""
    default = Path(os.environ.get("IOP_STATE_DIR", ".iop"))
    return [] if state == default else ["--dir", str(state)]


# --- status --------------------------------------------------------------------------------------------


def _status_row(service: Service) -> dict[str, Any]:
    pid = running_pid(service)
    ready = read_ready(service.file(".ready")) if pid is not None else None
    row: dict[str, Any] = {"service": service.name, "pid": pid, "address": None, "health": "stopped", "up": False}
    if pid is None:
        return row
    if ready is None:
        return {**row, "health": "starting"}
    return {**row, **_health(service, ready), **_others_use(service, ready.get("port"))}


def _health(service: Service, ready: dict[str, Any]) -> dict[str, Any]:
    """Address, health and whether it is up, of a service that wrote its ready file."""
    port = ready.get("port")
    match service.name:
        case "control-plane":
            return {"address": f"127.0.0.1:{port}", "health": "ok", "up": True}
        case "node" if is_joined(service.state):
            return _joined_node(service.state, ready)
        case "node":
            state = _node_state(service.state, str(ready.get("node_id", "")))
            return {"address": f"registered as {ready.get('node_id')}", "health": state, "up": state == "ready"}
        case "worker":
            health = _worker_health(int(ready["port"]), service.state / "certs")
            return {"address": f"127.0.0.1:{port}", "health": health, "up": health == "ok"}
        case _:
            code = http_status(f"http://127.0.0.1:{port}/health")
            health = "ok" if code == 200 else f"HTTP {code}" if code else "not answering"
            return {"address": f"http://127.0.0.1:{port}/v1", "health": health, "up": code == 200}


def _others_use(service: Service, port: object) -> dict[str, Any]:
    """The addresses other machines reach a listening service at (``iop up --listen``)."""
    if service.name == "node":
        return {}
    if service.name == "edge":
        return {"others_use": [f"http://{host}:{port}/v1" for host in others_use(service.file(".yaml"), "http")]}
    return {"others_use": [f"{host}:{port}" for host in others_use(service.file(".yaml"))]}


def _joined_node(state: Path, ready: dict[str, Any]) -> dict[str, Any]:
    """A joined node's row: registered with the control-plane ``iop join`` named, once it said so."""
    joined = read_joined(state)
    address = f"registered as {ready.get('node_id')} with {joined.get('address', '?')}"
    if not ready.get("registered"):
        return {"address": address, "health": "not registered", "up": False}
    if refused := last_dial_refused(state / "node.log"):  # removed since, or the control-plane is away
        return {"address": address, "health": f"not registered: {refused}", "up": False}
    return {"address": address, "health": "ready", "up": True}


def _node_state(state: Path, node_id: str) -> str:
    """The node's state as the control-plane sees it (asked over mTLS as an admin)."""
    control_plane = read_ready(state / "control-plane.ready")
    if not control_plane:
        return "no control-plane"
    try:
        listed = admin_ask(int(control_plane["port"]), state / "certs", pb.Envelope(nodes_list=pb.NodesList()))
    except Exception as exc:  # noqa: BLE001 - any failure to ask is shown, not raised
        return f"unknown ({reason(exc)})"
    for node in listed.nodes_listed.nodes:
        if node.node_id == node_id:
            return NODE_STATES.get(node.state, "unspecified")
    return "not registered"


def _worker_health(port: int, certs: Path) -> str:
    """ "ok" once the worker answers a batches.list (asked over mTLS as an admin)."""
    try:
        admin_ask(port, certs, pb.Envelope(batches_list=pb.BatchesList(limit=1)))
    except Exception as exc:  # noqa: BLE001 - any failure to ask is shown, not raised
        return f"not answering ({reason(exc)})"
    return "ok"


def admin_ask(port: int, certs: Path, request: pb.Envelope) -> pb.Envelope:
    """One request to a service on 127.0.0.1:``port``, over mTLS as an admin; its answer (the blocking
    client, as ``iop nodes`` uses: no event loop for one question)."""
    tls = TlsConfig(enabled=True, cert=certs / "admin.crt", key=certs / "admin.key", ca=certs / "ca.crt")
    context = client_context(tls)
    with BlockingClient.connect(
        "127.0.0.1", port, context=context, server_hostname="localhost", timeout=HTTP_TIMEOUT
    ) as client:
        return client.request(request, timeout=HTTP_TIMEOUT)
