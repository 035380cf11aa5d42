"""SIGHUP adding and removing served models on a real `iop node` process under a control-plane: the
added llama.cpp server starts and serves, the removed server's run in flight finishes before its
server is stopped (pid gone, pid file removed), and a mock model streams on throughout."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from backends.fixtures import require
from backends.servers import venv
from conftest import Pki, assert_eventually, process_alive
from cp_helpers import IOP, all_ready, client, cp_settings, listening_port, node_config
from node_helpers import chat, collect, kinds, text

from iop_control_plane.bootstrap import build_control_plane
from iop_gen.pb.iop import runtime_pb2 as pb

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
FAST = {"probe_interval": 0.2, "probe_timeout": 1.0, "backoff": 0.1, "stop_grace": 5}
KEEP = {"model": "keep", "adapter": "mock", "options": {"tokens": 60, "tokens_per_second": 20}}


def _echo_route() -> dict[str, Any]:
    command = [sys.executable, str(HERE / "engine_server.py"), "{port}", "echo", "--slow"]
    return {"model": "echo", "engine": "command", "serve": {"command": command, **FAST}}


def _tiny_route(model_path: Path) -> dict[str, Any]:
    serve = {"model_path": str(model_path), "python": str(venv("llama") / "bin" / "python"), **FAST}
    return {"model": "tiny", "engine": "llama.cpp", "serve": serve, "options": {"kinds": ["chat", "completion"]}}


def _start(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as sink:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([*IOP, "node", "--config", str(config)], stdout=sink, stderr=sink)


def _pids(engines: Path, model: str) -> list[int]:
    return [json.loads(path.read_text())["pid"] for path in engines.glob(f"{model}.*.pid")]


async def test_sighup_starts_an_added_server_and_stops_a_removed_one(pki: Pki, tmp_path: Path, tiny_gguf: Path) -> None:
    require("llama")
    engines = tmp_path / "engines"
    async with build_control_plane(cp_settings(pki, tmp_path)) as app:
        config = node_config(
            pki, tmp_path, "node-s", listening_port(app), [KEEP, _echo_route()], engines_dir=str(engines)
        )
        log = tmp_path / "node.log"
        node = _start(config, log)
        try:
            await all_ready(app, "node-s")

            def available(model: str) -> bool:
                view = app.registry.nodes["node-s"].models.get(model)
                return view is not None and view.available

            await assert_eventually(lambda: available("echo"), timeout=20)
            (echo_pid,) = _pids(engines, "echo")
            edge = await client(app, pki)
            keep = await edge.open_run(chat(model="keep"))
            echo = await edge.open_run(chat(model="echo"))  # the slow server: about 1.5 s of tokens
            assert [(await anext(echo)).WhichOneof("event") for _ in range(2)] == ["start", "delta"]

            data = yaml.safe_load(config.read_text())
            config.write_text(yaml.safe_dump({**data, "routes": [KEEP, _tiny_route(tiny_gguf)]}))
            node.send_signal(signal.SIGHUP)

            # the removed server's run finishes on it; then the server is stopped, its pid file removed
            events = await collect(echo)
            assert kinds(events)[-1] == "complete", events[-1]
            assert "echo" not in app.registry.nodes["node-s"].models
            await assert_eventually(lambda: not process_alive(echo_pid) and not _pids(engines, "echo"), timeout=20)
            # the added server starts and serves
            await assert_eventually(lambda: available("tiny"), timeout=60)
            (tiny_pid,) = _pids(engines, "tiny")
            assert process_alive(tiny_pid)
            answer = await collect(await edge.open_run(chat(model="tiny", sampling=pb.Sampling(max_tokens=8))))
            assert kinds(answer)[-1] == "complete" and text(answer), answer[-1]
            # the mock model streamed on throughout
            streamed = await collect(keep)
            assert kinds(streamed)[-1] == "complete" and len(text(streamed).split()) == 60
            await edge.close()
        finally:
            node.send_signal(signal.SIGTERM)
            node.wait(timeout=20)
    assert not list(engines.glob("*.pid")), "the node stopped its servers"
    assert "routes reloaded" in log.read_text()
