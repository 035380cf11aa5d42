"""``iop supervise --dir DIR`` (started by ``iop up``): keep the platform's services running.

``iop up`` returns once the platform serves, so the process that started the services cannot be
the one that watches them: ``up`` starts this supervisor in its own session, and the supervisor
starts the four services (``Platform.start``; in a folder ``iop join`` made, the node alone),
then polls them. A service that exits by itself is started again after a backoff that doubles
from 0.5 s up to 30 s; after ``CRASH_LOOP`` exits
within ``CRASH_WINDOW`` s it is left stopped (a crash loop: its log says why; ``iop down`` and
``iop up`` start again). Each exit is a warning line in ``DIR/supervise.log``. A restarted
service keeps the port it had (``IOP_`` variables pin it, for configs that say 0), so the base
URL ``up`` printed and the addresses in the other configs stay right.

The state is ``DIR/supervisor.json`` (written whole, then renamed): the supervisor's pid, its
phase (``starting``, ``running``, ``failed`` with the one-line reason), and per service its pid,
restarts, last exit and whether it was given up. ``iop status`` shows it; ``iop up`` waits on it.
SIGTERM (``iop down``) or SIGINT stop the services in order (edge first), then the supervisor.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from iop_cli.output import CliError
from iop_cli.platform import Platform, service_names, services

__all__ = ["CRASH_LOOP", "CRASH_WINDOW", "read_state", "state_file", "supervise"]

_log = structlog.get_logger("iop.supervise")

BACKOFF_FIRST, BACKOFF_CAP = 0.5, 30.0
CRASH_LOOP, CRASH_WINDOW = 8, 300.0
_POLL = 0.2
# The setting that holds each listening service's port, as an IOP_ variable.
_PORT_VARIABLES = {"control-plane": "IOP_LISTEN__PORT", "worker": "IOP_LISTEN__PORT", "edge": "IOP_HTTP__PORT"}


@dataclass
class Watched:
    """One service as the supervisor sees it."""

    pid: int | None = None
    state: str = "running"
    """running, restarting (waiting out its backoff) or given up (a crash loop)."""
    restarts: int = 0
    last_exit: str | None = None
    """How it last ended by itself: ``code 1``, ``signal 9 (SIGKILL)``; None if it never did."""
    last_exit_at: float | None = None
    restart_at: float | None = field(default=None, repr=False)
    exits: deque[float] = field(default_factory=deque, repr=False)


def state_file(state: Path) -> Path:
    """Where the supervisor of ``state`` writes what it sees."""
    return state / "supervisor.json"


def read_state(state: Path) -> dict[str, Any] | None:
    """What the supervisor of ``state`` last wrote; None when there is nothing (or half of it)."""
    try:
        found = json.loads(state_file(state).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def supervise(state: Path, log_level: str | None) -> int:
    """Start the platform under ``state`` and keep it running until SIGTERM; returns the exit code."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _interrupt)
    platform = Platform(state, log_level, foreground=False)
    _write(state, "starting")
    try:
        started = platform.start()
    except CliError as exc:
        platform.stop()
        _write(state, "failed", error=str(exc), code=exc.code)
        return exc.code
    except KeyboardInterrupt:
        platform.stop()
        state_file(state).unlink(missing_ok=True)
        return 0
    pins = {
        name: {variable: str(started[name]["port"])} for name, variable in _PORT_VARIABLES.items() if name in started
    }
    watched = {name: Watched(pid=int(started[name]["pid"])) for name in service_names(state)}
    try:
        _watch(state, platform, watched, pins)
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the stop short
        platform.stop()
    finally:
        state_file(state).unlink(missing_ok=True)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _watch(state: Path, platform: Platform, watched: dict[str, Watched], pins: dict[str, dict[str, str]]) -> None:
    """Poll the services until interrupted: note each exit, start each again when its backoff is over."""
    _write(state, "running", watched)
    by_name = {service.name: service for service in services(state)}
    while True:
        changed = False
        now = time.monotonic()
        for name, seen in watched.items():
            process = platform.processes[name]
            if seen.state == "running" and process.poll() is not None:
                _exited(name, seen, process.returncode, now)
                changed = True
            elif seen.state == "restarting" and seen.restart_at is not None and now >= seen.restart_at:
                platform.spawn(by_name[name], pins.get(name))
                seen.pid, seen.state, seen.restart_at = platform.processes[name].pid, "running", None
                seen.restarts += 1
                _log.warning("service restarted", service=name, pid=seen.pid, restarts=seen.restarts)
                changed = True
        if changed:
            _write(state, "running", watched)
        time.sleep(_POLL)


def _exited(name: str, seen: Watched, code: int, now: float) -> None:
    """Note an exit; schedule the restart, or give the service up when it crash-loops."""
    seen.last_exit, seen.last_exit_at = _exit_text(code), time.time()
    seen.exits.append(now)
    while seen.exits and seen.exits[0] < now - CRASH_WINDOW:
        seen.exits.popleft()
    if len(seen.exits) >= CRASH_LOOP:
        seen.state = "given up"
        _log.error(
            "service crash loop: not restarted again",
            service=name,
            exit=seen.last_exit,
            exits=len(seen.exits),
            window_s=CRASH_WINDOW,
            hint="read its log; 'iop down' then 'iop up' start it again",
        )
        return
    delay = min(BACKOFF_CAP, BACKOFF_FIRST * 2 ** (len(seen.exits) - 1))
    seen.state, seen.restart_at = "restarting", now + delay
    _log.warning("service exited", service=name, exit=seen.last_exit, restart_in_s=delay)


def _exit_text(code: int) -> str:
    if code >= 0:
        return f"code {code}"
    try:
        return f"signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"signal {-code}"


def _write(state: Path, phase: str, watched: dict[str, Watched] | None = None, **extra: object) -> None:
    """The supervisor's state, whole: written aside, then renamed over the last one."""
    services_state = {
        name: {key: value for key, value in asdict(seen).items() if key not in ("restart_at", "exits")}
        for name, seen in (watched or {}).items()
    }
    document = {"pid": os.getpid(), "phase": phase, "services": services_state, **extra}
    target = state_file(state)
    draft = target.with_suffix(".json.new")
    draft.write_text(json.dumps(document, indent=2))
    draft.replace(target)
