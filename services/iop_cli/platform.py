"""The platform's processes: spawn each with its log, wait for its ready file, stop them in order.

``Platform`` is what one ``iop up`` started (through ``iop supervise``, or itself in
``--foreground``): it spawns ``iop control-plane``, ``iop node``, ``iop worker`` and ``iop edge``,
writes their pid files, waits for their ready files and the edge's ``GET /ready``, relays their
output in ``--foreground``, spawns one again for the supervisor, and stops them. In a folder
``iop join`` wrote (``joined.json``) the platform is the node alone, started once it wrote
``registered: true`` in its ready file. The rest reads what a running platform
left in the state folder (pid and ready files) and stops a process by its pid, for ``iop down``
and ``iop status``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, NamedTuple

from iop_cli.configs import HTTP_TIMEOUT, set_value
from iop_cli.ggufs import engine_models
from iop_cli.output import CliError
from iop_cli.readyfile import read_ready

SERVICES = ("control-plane", "node", "worker", "edge")
JOINED = "joined.json"
"""What ``iop join`` writes in its folder: the control-plane's address, the node's name, the CA's hash."""
_START_TIMEOUT = 30.0
STOP_TIMEOUT = 60.0
_LOG_TAIL = 2000
_OUTPUT = threading.Lock()  # one line at a time on stdout in --foreground


@dataclass(frozen=True)
class Service:
    """One of the platform's processes and its files in the state folder."""

    name: str
    state: Path

    def file(self, suffix: str) -> Path:
        return self.state / f"{self.name}{suffix}"

    def command(self, log_level: str | None) -> list[str]:
        level = ["--log-level", log_level] if log_level else []
        config, ready = str(self.file(".yaml")), str(self.file(".ready"))
        return [sys.executable, "-m", "iop_cli.main", *level, self.name, "--config", config, "--ready-file", ready]


def services(state: Path) -> list[Service]:
    """The platform's processes under ``state``, in start order (a joined folder: the node alone)."""
    return [Service(name, state) for name in service_names(state)]


def service_names(state: Path) -> tuple[str, ...]:
    """The names of the platform's processes under ``state``, in start order."""
    return ("node",) if is_joined(state) else SERVICES


def is_joined(state: Path) -> bool:
    """Whether ``iop join`` made ``state`` (a node of a control-plane elsewhere)."""
    return (state / JOINED).exists()


def read_joined(state: Path) -> dict[str, Any]:
    """What ``iop join`` wrote in ``state``; {} when it is unreadable."""
    return read_ready(state / JOINED) or {}


# --- starting, watching and stopping the processes ----------------------------------------------------


class Platform:
    """The processes one ``up`` started, in start order."""

    def __init__(self, state: Path, log_level: str | None, foreground: bool) -> None:
        self.state, self.log_level, self.foreground = state, log_level, foreground
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.readers: list[threading.Thread] = []

    def start(self) -> dict[str, dict[str, Any]]:
        """Start all four and wait until the edge serves a model (unless the node runs model servers,
        which take their time: ``iop up`` waits for those with their states); what each wrote to its ready file.

        In a joined folder: start the node and wait until it registered."""
        if is_joined(self.state):
            return {"node": self._start_registered(Service("node", self.state))}
        control_plane, node, worker, edge = services(self.state)
        started = {"control-plane": self._start(control_plane)}
        address = f"127.0.0.1:{started['control-plane']['port']}"
        for config in (node.file(".yaml"), worker.file(".yaml"), edge.file(".yaml")):
            set_value(config, ("control_plane", "address"), address)
        self.spawn(node)
        started["worker"] = self._start(worker)  # the edge is pointed at the port it took
        set_value(edge.file(".yaml"), ("worker", "address"), f"127.0.0.1:{started['worker']['port']}")
        self.spawn(edge)
        started["node"] = self._wait(node)
        started["edge"] = self._wait(edge)
        if not engine_models(node.file(".yaml")):  # a model the node runs the server of: up waits for it itself
            self._wait_served(edge, int(started["edge"]["port"]))
        return started

    def _start(self, service: Service) -> dict[str, Any]:
        self.spawn(service)
        return self._wait(service)

    def spawn(self, service: Service, env: dict[str, str] | None = None) -> None:
        """Start ``service`` (``env``: settings to override, ``IOP_`` variables), its log kept, its pid written."""
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
                env={**os.environ, **env} if env else None,
            )
        self.processes[service.name] = process
        service.file(".pid").write_text(str(process.pid))
        if self.foreground:
            assert process.stdout is not None
            reader = threading.Thread(target=_relay, args=(service.name, process.stdout, log), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _wait(self, service: Service) -> dict[str, Any]:
        process, ready = self.processes[service.name], service.file(".ready")
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline and process.poll() is None:
            if (started := read_ready(ready)) is not None:
                return started
            time.sleep(0.05)
        raise self._failed(service)

    def _start_registered(self, node: Service) -> dict[str, Any]:
        self.spawn(node)
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline and self.processes[node.name].poll() is None:
            if (started := read_ready(node.file(".ready"))) is not None and started.get("registered"):
                return started
            time.sleep(0.05)
        code = self.processes[node.name].poll()
        what = f"exited (code {code})" if code is not None else "did not register"
        said = _last_refusal(node.file(".log"))
        why = f" (its last dial: {said})" if said else ""
        raise CliError(f"the node {what} within {_START_TIMEOUT:.0f} s{why}; see {node.file('.log')}", 1)

    def _wait_served(self, edge: Service, port: int) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline and all(p.poll() is None for p in self.processes.values()):
            if http_status(f"http://127.0.0.1:{port}/ready") == 200:
                return
            time.sleep(0.1)
        dead = next((s for s in services(self.state) if self.processes[s.name].poll() is not None), None)
        raise self._failed(dead or edge, None if dead else "serves no model (GET /ready)")

    def _failed(self, service: Service, what: str | None = None) -> CliError:
        code = self.processes[service.name].poll()
        if what is None:
            what = f"exited (code {code})" if code is not None else "did not start"
        for reader in self.readers:
            reader.join(timeout=1)
        log = service.file(".log")
        tail = log.read_text(errors="replace")[-_LOG_TAIL:] if log.exists() else ""
        return CliError(f"the {service.name} {what} within {_START_TIMEOUT:.0f} s; the end of {log}:\n{tail}", 1)

    def stop(self) -> None:
        """SIGTERM the edge, the worker, the node, then the control-plane, each waited for (SIGKILL if it hangs)."""
        for name in reversed(service_names(self.state)):
            process = self.processes.get(name)
            if process is None:
                continue
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=STOP_TIMEOUT)
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
        say(f"{gone} exited (code {self.processes[gone].returncode}); stopping the others")
        self.stop()
        return 1


def _relay(name: str, stream: IO[bytes], log: Path) -> None:
    """--foreground: a service's output, line by line, to stdout (prefixed) and to its log."""
    with log.open("ab") as sink:
        for line in stream:
            sink.write(line)
            sink.flush()
            say(f"{name} | {line.decode(errors='replace').rstrip()}")


def say(line: str) -> None:
    """Print ``line`` whole, never interleaved with a service's relayed output."""
    with _OUTPUT:
        print(line, flush=True)


# --- what a running platform left: pid and ready files; stopping by pid ------------------------------


def terminate(pid: int, name: str, timeout: float = STOP_TIMEOUT) -> bool:
    """SIGTERM ``iop NAME`` at ``pid`` and wait for it to exit; False if it still runs after ``timeout`` s."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while is_ours(pid, name) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not is_ours(pid, name)


def http_status(url: str) -> int | None:
    """The HTTP status ``GET url`` answers; None if nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as answer:  # noqa: S310 - our own edge on loopback
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def read_pid(pidfile: Path) -> int | None:
    """The pid in ``pidfile``; None if there is none."""
    try:
        return int(pidfile.read_text())
    except (OSError, ValueError):
        return None


def running_pid(service: Service) -> int | None:
    """The pid in the service's pid file if it is a process ``up`` started that still runs."""
    pid = read_pid(service.file(".pid"))
    return pid if pid is not None and is_ours(pid, service.name) else None


def is_ours(pid: int, name: str) -> bool:
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


def _last_refusal(log: Path) -> str:
    """The reason of the last dial the node's log says was refused ("" if none): a joined node whose
    certificate was revoked or expired is told so at once, then only dials again."""
    return next((dial.reason for dial in _dials(log) if dial.event == _REFUSED), "")


def last_dial_refused(log: Path) -> str:
    """Why the node's dials are being refused now, "" if its latest word was that it registered: a
    node removed from the control-plane (its certificate revoked) keeps running and dialing, and
    its ready file still says it registered once. Only a refusal of the last 90 s counts (a refused
    node dials at least every 30 s): at log level warning the node's "registered" is not written."""
    latest = next(_dials(log), None)
    if latest is None or latest.event != _REFUSED:
        return ""
    with contextlib.suppress(ValueError):
        if (datetime.now(UTC) - datetime.fromisoformat(latest.at)).total_seconds() < _REFUSED_FOR:
            return latest.reason or "refused"
    return ""


_REFUSED, _REGISTERED = "peer unreachable", "registered"
_REFUSED_FOR = 90.0


class _Dial(NamedTuple):
    event: str
    reason: str
    at: str
    """When, as the log line says (ISO 8601, UTC)."""


def _dials(log: Path) -> Iterator[_Dial]:
    """The node's dial outcomes in its log's last part, newest first."""
    try:
        with log.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - _LOG_TAIL * 4))
            tail = file.read().decode(errors="replace")
    except OSError:
        return
    for line in reversed(tail.splitlines()):
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("event") in (_REFUSED, _REGISTERED):
                yield _Dial(str(entry["event"]), str(entry.get("reason", "")), str(entry.get("timestamp", "")))
