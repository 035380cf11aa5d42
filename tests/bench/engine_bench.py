"""How fast a node's own model servers come up, and come back (issue 23): a node (in this process)
running llama-cpp-python's server with the tiny model (when tests/backends/install.sh has run), and
the tests' small OpenAI-compatible server (``engine: command``), with the engine settings at their
defaults but ``stable_after`` (1 s, so that back-to-back trials are restarts, not a crash loop).

Rows per engine: start to ready (the node's first start); kill -9 of the server to its model
unavailable on the node (the exit seen) and to ready again (the backoff, 1 s by default, plus a
start); SIGSTOP of the server to its kill (the liveness probe silent for ``hang_timeout``, 10 s by
default, probed every 2 s). The node's state is looked at every 5 ms. Prints a table; asserts nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the backends and the command server
from backends.servers import skip_reason, tiny_model_path, venv
from table import print_table

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.bootstrap import NodeApp, build_node
from iop_node.settings import Settings
from iop_wire.logs import configure

KILLS = int(os.environ.get("IOP_ENGINE_BENCH_KILLS", "5"))
STOPS = int(os.environ.get("IOP_ENGINE_BENCH_STOPS", "2"))
LOOK = 0.005  # seconds between two looks at the node's state
SERVER = Path(__file__).resolve().parents[1] / "integration" / "engine_server.py"


def _routes(folder: Path) -> dict[str, dict[str, Any]]:
    command = [sys.executable, str(SERVER), "{port}", "echo"]
    routes: dict[str, dict[str, Any]] = {
        "command": {"model": "echo", "engine": "command", "serve": {"command": command, "stable_after": 1}}
    }
    if skip_reason("llama") is None:
        serve = {"model_path": str(tiny_model_path(folder)), "python": str(venv("llama") / "bin" / "python")}
        routes["llama.cpp"] = {"model": "tiny", "engine": "llama.cpp", "serve": {**serve, "stable_after": 1}}
    return routes


def _load(app: NodeApp, model: str) -> pb.ModelLoad:
    return next(load for load in app.node.status().models if load.model == model)


async def _until(check: Callable[[], bool], timeout: float = 120) -> float:
    """Seconds until ``check()`` holds (looked at every LOOK s)."""
    began = time.monotonic()
    while not check():
        if time.monotonic() - began > timeout:
            raise TimeoutError("the node did not get there")
        await asyncio.sleep(LOOK)
    return time.monotonic() - began


def _ready(app: NodeApp, model: str) -> bool:
    load = _load(app, model)
    return load.available and load.served.state == pb.SERVED_STATE_READY


async def _engine(name: str, route: dict[str, Any], folder: Path) -> list[tuple[str, str]]:
    settings = Settings.model_validate(
        {
            "node_id": "bench",
            "listen": {"enabled": False},
            "store_path": str(folder / f"{name}.db"),
            "engines_dir": str(folder / f"{name}-engines"),
            "routes": [route],
        }
    )
    model = route["model"]
    app = build_node(settings, config_dir=folder)
    began = time.monotonic()
    async with app:
        await _until(lambda: _ready(app, model))
        first = time.monotonic() - began
        unavailable, back = [], []
        for _ in range(KILLS):
            os.kill(_load(app, model).served.pid, signal.SIGKILL)
            unavailable.append(await _until(lambda: not _load(app, model).available))
            back.append(unavailable[-1] + await _until(lambda: _ready(app, model)))
            await asyncio.sleep(1.1)  # past stable_after: the next kill is a restart, not a crash loop
        hung = []
        for _ in range(STOPS):
            pid = _load(app, model).served.pid
            os.kill(pid, signal.SIGSTOP)
            hung.append(await _until(lambda stopped=pid: _load(app, model).served.pid != stopped))
            await _until(lambda: _ready(app, model))
            await asyncio.sleep(1.1)
    return [
        (f"{name}: start to ready (first start)", f"{first:.2f} s"),
        (f"{name}: kill -9 to unavailable, p50 / max of {KILLS}", _ms(unavailable)),
        (f"{name}: kill -9 to ready again, p50 / max of {KILLS}", _seconds(back)),
        (f"{name}: SIGSTOP to killed (hang_timeout 10 s), p50 / max of {STOPS}", _seconds(hung)),
    ]


def _ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1000:.0f} / {max(samples) * 1000:.0f} ms"


def _seconds(samples: list[float]) -> str:
    return f"{statistics.median(samples):.2f} / {max(samples):.2f} s"


async def main() -> None:
    configure("error")  # the node's lines (a hang killed is a warning) stay out of the table
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="iop-engine-bench-") as folder:
        for name, route in _routes(Path(folder)).items():
            rows += await _engine(name, route, Path(folder))
    print_table(rows)


if __name__ == "__main__":
    asyncio.run(main())
