"""``iop control-plane --config cp.yaml``: run the control-plane until SIGTERM or SIGINT.

SIGHUP reads ``policy_path`` again: a valid policy is put in force (logged with its version);
an invalid one is logged with the one-line error naming the key, and the old policy stays.

Start-up problems end the process with exit code 2 and one line on stderr naming the setting
(``iop control-plane: bad config: listen.port (line 3): ...``). ``--ready-file PATH`` is written
once it serves (JSON: pid, port, metrics_port) and removed when it stops.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_control_plane.settings import load_settings
from iop_wire.settings import run_service, write_ready_file

__all__ = ["run"]


def run(config: Path, *, ready_file: Path | None = None, log_level: str | None = None) -> int:
    """Start the control-plane described by ``config``; returns the exit code (2 when it cannot start)."""
    return run_service("control-plane", config, _load, lambda app: _serve(app, ready_file), log_level=log_level)


def _load(config: Path) -> ControlPlaneApp:
    """The control-plane built from its settings (and policy file); ConfigError names the key."""
    return build_control_plane(load_settings(config))


async def _serve(app: ControlPlaneApp, ready_file: Path | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGHUP, app.operations.reload, app.settings.policy_path)
    async with app:
        if ready_file is not None:
            write_ready_file(
                ready_file, port=app.listener.port if app.listener else None, metrics_port=app.metrics_port
            )
        try:
            await stop.wait()
        finally:
            if ready_file is not None:
                ready_file.unlink(missing_ok=True)  # noqa: ASYNC240 - one unlink while stopping
    return 0
