"""``iop node --config node.yaml``: run a node until SIGTERM or SIGINT, then stop gracefully."""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
from pathlib import Path

from iop_node.bootstrap import NodeApp, build_node
from iop_node.settings import ConfigError, load_settings
from iop_wire.logs import configure

__all__ = ["run"]


def run(config: Path | None) -> int:
    """Start the node described by ``config``; returns the exit code (2 for a bad config)."""
    try:
        settings = load_settings(config)
        app = build_node(settings)
    except ConfigError as exc:
        print(f"iop node: bad config: {exc}", file=sys.stderr)
        return 2
    configure(settings.log_level)
    return asyncio.run(_serve(app))


async def _serve(app: NodeApp) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await app.start()
    # Everything made so far (modules, settings, the app) lives as long as the process: frozen,
    # the collector no longer walks it. Node CPU per one-token run fell by ~10 us (README).
    gc.collect()
    gc.freeze()
    await stop.wait()
    await app.stop()
    return 0
