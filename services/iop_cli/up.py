"""``iop up`` / ``iop down``: the whole platform on this machine (``iop status``: ``iop_cli.status``).

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
``--model PATH.gguf[=NAME]`` (repeatable) rewrites it with one route per GGUF file whose server the
node runs (``engine: llama.cpp``, ``iop_cli.ggufs``), with the Python that has llama-cpp-python's
server (``--llama-python``, else found or installed: ``iop_cli.llama``); a missing or non-GGUF file
is one line, exit 2, before anything else.

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
all, exit 0; if one exits by itself the others are stopped, exit 1. When ``node.yaml`` has routes
with an ``engine`` the edge's ``GET /ready`` is not waited for: ``up`` waits instead (asking the
control-plane, up to ``_SERVED_WAIT``) until each such model is ready (``model smol: ready
(llama.cpp, pid 1234, port 40123) in 6.1 s``, counted from the platform's start) or failed (the
node's reason); a failed model, or one still starting at the limit, is one line on stderr and
exit 1, the platform left running.

``down`` stops the supervisor, which stops the edge, the worker, the node, then the control-plane,
each waited for; then any service still running (an older ``up``'s, or one whose supervisor was
killed), in the same order; it prints each one stopped; pid files of processes that are gone are
removed with a word (the node stops the model servers it runs).

This module holds the two commands and what they print; the files ``up`` writes are
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
    get_json,
    prepare,
    yaml_value,
)
from iop_cli.ggufs import engine_logs, engine_models, gguf_models, llama_routes
from iop_cli.llama import llama_python
from iop_cli.output import CliError
from iop_cli.platform import (
    SERVICES,
    STOP_TIMEOUT,
    Platform,
    Service,
    is_joined,
    is_ours,
    read_pid,
    running_pid,
    say,
    service_names,
    services,
    terminate,
)
from iop_cli.preflight import check_files, choosing_ports, only_up
from iop_cli.readyfile import read_ready
from iop_cli.served import ServedWait
from iop_cli.shell import iop_command
from iop_cli.status import admin_ask
from iop_cli.supervisor import read_state, state_file
from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = ["CONTROL_PLANE_PORT", "EDGE_PORT", "down", "run_attached", "start_supervised", "up"]

_SUPERVISED_START = 180.0  # the supervisor's Platform.start: 30 s for each service, then the edge's /ready
_SUPERVISED_STOP = len(SERVICES) * STOP_TIMEOUT + 10  # it stops the services one after the other
_SERVED_WAIT = 300.0  # loading a large GGUF on a CPU; the node gives up on a server by its own start timeout


def up(
    state: Path,
    port: int | None = None,
    *,
    log_level: str | None = None,
    foreground: bool = False,
    backend: str | None = None,
    listen: Sequence[str] = (),
    models: Sequence[str] = (),
    python: str | None = None,
) -> int:
    """Start the platform under ``state``; returns the exit code (CliError: one line, nothing left running).

    ``listen``: addresses of this machine other machines reach it at (``--listen``); ``models``: GGUF
    files to serve (``--model PATH[=NAME]``), run with ``python`` (``--llama-python``)."""
    ggufs = gguf_models(list(models))  # before anything: a missing or non-GGUF file is one line
    if is_joined(state):
        given = {"--port": port is not None, "--backend": backend is not None, "--listen": bool(listen)}
        given["--model"] = bool(models)
        return _up_joined(state, [option for option, on in given.items() if on], log_level, foreground)
    listen = check_listen(listen)
    with contextlib.ExitStack() as lock:
        lock.enter_context(only_up(state, "up"))
        running = {s.name: pid for s in _watched(state) if (pid := running_pid(s)) is not None}
        if running:
            return _already_running(state, running, port, serving=bool(ggufs))
        check_files(state)  # before any port check or process: a broken file is named as what it is
        routes = llama_routes(ggufs, llama_python(state, python)) if ggufs else None  # may install: minutes
        lock.enter_context(choosing_ports())  # until the services listen on the ports chosen
        prepare(state, port, backend, listen, served=routes)
        if foreground:
            return _foreground(Platform(state, log_level, foreground=True), started=lock.close)
        began = time.monotonic()
        started = start_supervised(state, log_level)
    # the services listen: the locks go before the wait (another `iop up` may choose ports, `iop down` stop)
    try:
        waited = _wait_models(state, started, began)
    except KeyboardInterrupt:
        stop = iop_command("down", *_dir_args(state))
        raise CliError(f"stopped waiting for the models; the platform runs on: '{stop}' stops it", 130) from None
    _print_started(state, started, foreground=False)
    if waited:
        raise CliError(waited, 1)
    return 0


def _wait_models(state: Path, started: dict[str, dict[str, Any]], began: float) -> str:
    """Wait until each model the node runs the server of is ready or failed; "" if all are ready, else
    the one line to exit with (the platform runs on). ``began``: when the services were started."""
    models = engine_models(state / "node.yaml")
    if not models:
        return ""
    say(f"waiting for {', '.join(models)} to load (the node runs the server of each)")
    port, certs = int(started["control-plane"]["port"]), state / "certs"
    waiting = ServedWait(
        lambda: admin_ask(port, certs, pb.Envelope(nodes_list=pb.NodesList())).nodes_listed,
        str(started["node"].get("node_id", "local-node")),
        models,
        report=say,
        began=began,
    )
    if waiting.wait(_SERVED_WAIT):
        return ""
    for line in waiting.pending():
        say(f"{line} after {_SERVED_WAIT:.0f} s")
    stop = iop_command("down", *_dir_args(state))
    what = "failed" if waiting.failed else "not ready"
    names = ", ".join([*waiting.failed, *waiting.waiting])
    return f"{names} {what} (see above); the platform runs on: 'iop status' follows it, '{stop}' stops it"


def _foreground(platform: Platform, started: Callable[[], None]) -> int:
    """Start the services attached: their output relayed; Ctrl-C, SIGTERM or one exiting stops all.

    ``started`` is called once they run (the lock goes: ``iop down`` from elsewhere may stop them)."""

    began = time.monotonic()

    def print_started(services: dict[str, dict[str, Any]]) -> None:
        started()  # they listen: the locks go before the models' wait
        waited = _wait_models(platform.state, services, began)
        _print_started(platform.state, services, foreground=True)
        if waited:
            say(f"iop up: {waited}")

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


def _interrupt(signum: int, frame: object) -> None:
    """--foreground: SIGINT and SIGTERM stop the platform."""
    raise KeyboardInterrupt


# --- what up prints ----------------------------------------------------------------------------------


def _print_started(state: Path, started: dict[str, dict[str, Any]], foreground: bool) -> None:
    control_plane, node, worker, edge = (started[name] for name in SERVICES)
    base = f"http://127.0.0.1:{edge['port']}/v1"
    key = _read_key(state)
    models = _served_models(base, key)
    example = (models or engine_models(state / "node.yaml") or ["mock-small"])[0]
    lines = [
        f"control-plane at 127.0.0.1:{control_plane['port']} (mTLS), pid {control_plane['pid']}"
        + _metrics(control_plane),
        f"node {node.get('node_id', 'local-node')} registered with it, pid {node['pid']}" + _metrics(node),
        f"worker at 127.0.0.1:{worker['port']} (mTLS; files and batches), pid {worker['pid']}" + _metrics(worker),
        f"edge at http://127.0.0.1:{edge['port']}, pid {edge['pid']}, metrics http://127.0.0.1:{edge['port']}/metrics",
        f"models: {', '.join(models) or '(none served yet)'}",
        *_reachable(state, control_plane["port"], edge["port"]),
        "",
        f"base URL: {base}",
        f"console: http://127.0.0.1:{edge['port']}/console",
        f"API key: {key}",
        "",
        "from openai import OpenAI",
        f'client = OpenAI(base_url="{base}", api_key="{key}")',
        f'print(client.chat.completions.create(model="{example}", '
        'messages=[{"role": "user", "content": "hi"}]).choices[0].message.content)',
        "",
        f"chat: {iop_command('chat', *_dir_args(state), 'hello')}",
        f"status: {iop_command('status', *_dir_args(state))}",
        f"logs: {', '.join(str(state / f'{name}.log') for name in SERVICES)}",
        *_server_logs(state),
        f"run history: {iop_command('runs', 'ls', *_dir_args(state))}",
        f"batches: {iop_command('batches', 'ls', *_dir_args(state))}",
        "stop: Ctrl-C" if foreground else f"stop: {iop_command('down', *_dir_args(state))}",
    ]
    say("\n".join(lines))


def _server_logs(state: Path) -> list[str]:
    """Where the model servers the node runs write (none: no line)."""
    logs = engine_logs(state / "node.yaml")
    return [f"model server logs: {', '.join(map(str, logs))}"] if logs else []


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


def _already_running(state: Path, running: dict[str, int], port: int | None, *, serving: bool) -> int:
    stop = iop_command("down", *_dir_args(state))
    pids = ", ".join(f"{name} pid {pid}" for name, pid in running.items())
    if not running.keys() >= set(SERVICES):
        raise CliError(f"part of the platform runs in {state} ({pids}); stop it with '{stop}' and start again", 1)
    if serving:
        raise CliError(f"the platform runs in {state} ({pids}); --model applies when it starts: '{stop}' first", 2)
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
        print(f"console: http://127.0.0.1:{edge['port']}/console")
    print(f"API key: {_read_key(state)}")
    return 0


def _watched(state: Path) -> list[Service]:
    """The services and the supervisor that keeps them running."""
    return [*services(state), Service("supervise", state)]


def _dir_args(state: Path) -> list[str]:
    """``--dir DIR`` when the hint's command would not find ``state`` by default."""
    default = Path(os.environ.get("IOP_STATE_DIR", ".iop"))
    return [] if state == default else ["--dir", str(state)]
