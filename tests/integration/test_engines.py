"""Servers the node runs itself (routes with an ``engine``), with real processes: llama-cpp-python
serving the tiny model, and a small OpenAI-compatible server of the tests' own (``engine: command``).

The node starts the server and serves chat through it; kill -9 of the server: restarted, serving
again, a run in progress ends with a retryable error; SIGSTOP: taken as hung and restarted, while
a long stream is not; a missing or non-GGUF model file: FAILED with the server's own words, the
other model still served; kill -9 of the node: its servers die with it (PR_SET_PDEATHSIG), and what
they started is killed by the next start from the pid files.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from backends.fixtures import require
from backends.servers import OLLAMA_MODELFILE, ollama_binary, venv
from backends.tiny_model import OLLAMA_TEMPLATE
from conftest import Pki, assert_eventually, forked_and_frozen, process_alive
from cp_helpers import client as cp_client
from cp_helpers import cp_settings, node_process
from node_helpers import chat, client, collect, kinds, node_settings, running_node, text

from iop_control_plane.bootstrap import build_control_plane
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.bootstrap import NodeApp, build_node
from iop_node.engines import kill_leftovers
from iop_node.engines.process import EngineFiles, RotatingLog, spawn, start_in_session
from iop_node.settings import StartError, load_settings
from iop_wire.tls import Role

HERE = Path(__file__).resolve().parent
FAST = {"probe_interval": 0.2, "probe_timeout": 1.0, "backoff": 0.1, "stop_grace": 5}


def _llama_route(model: str, model_path: Path, **serve: Any) -> dict[str, Any]:
    require("llama")
    python = str(venv("llama") / "bin" / "python")
    settings = {"model_path": str(model_path), "python": python, **FAST, **serve}
    return {"model": model, "engine": "llama.cpp", "serve": settings, "options": {"kinds": ["chat", "completion"]}}


def _command_route(model: str, *extra: str, **serve: Any) -> dict[str, Any]:
    command = [sys.executable, str(HERE / "engine_server.py"), "{port}", model, *extra]
    return {"model": model, "engine": "command", "serve": {"command": command, **FAST, **serve}}


def _served(app: NodeApp, model: str) -> pb.ServedModel:
    return next(load.served for load in app.node.status().models if load.model == model)


def _ready(app: NodeApp, model: str) -> bool:
    load = next(load for load in app.node.status().models if load.model == model)
    return load.available and load.served.state == pb.SERVED_STATE_READY


async def _chat_text(app: NodeApp, pki: Pki, model: str, tokens: int = 8) -> str:
    connection = await client(app, pki)
    try:
        events = await collect(await connection.open_run(chat(model=model, sampling=pb.Sampling(max_tokens=tokens))))
    finally:
        await connection.close()
    assert kinds(events)[-1] == "complete", events[-1]
    return text(events)


async def test_llama_engine_serves_a_long_stream_and_restarts_after_kill_9(
    pki: Pki, tmp_path: Path, tiny_gguf: Path
) -> None:
    # hang_timeout well under the long stream's length: a stream in progress is no hang (the
    # liveness probe is /docs, which the server answers without waiting for the model)
    route = _llama_route("tiny", tiny_gguf, hang_timeout=0.8, stable_after=1)
    settings = node_settings(pki, tmp_path, [route], engines_dir=tmp_path / "engines")
    async with running_node(settings) as app:
        await assert_eventually(lambda: _ready(app, "tiny"), timeout=30)
        first = _served(app, "tiny")
        assert first.pid and first.port and first.restarts == 0
        assert json.loads((tmp_path / "engines" / f"tiny.{first.pid}.pid").read_text())["pid"] == first.pid
        started = time.monotonic()
        assert await _chat_text(app, pki, "tiny", tokens=2000)
        assert time.monotonic() - started > 1.6  # twice hang_timeout: the probe ran during it
        assert _served(app, "tiny").restarts == 0 and _served(app, "tiny").pid == first.pid

        connection = await client(app, pki)
        stream = await connection.open_run(chat(model="tiny", sampling=pb.Sampling(max_tokens=20000)))
        assert kinds([await anext(stream), await anext(stream)]) == ["start", "delta"]
        os.kill(first.pid, signal.SIGKILL)
        final = (await collect(stream))[-1]  # ends, with a retryable error (not a hang)
        assert final.error.code == pb.ERROR_CODE_UNAVAILABLE and final.error.retryable
        await assert_eventually(lambda: _served(app, "tiny").restarts == 1, timeout=10)
        await assert_eventually(lambda: _ready(app, "tiny"), timeout=30)
        again = _served(app, "tiny")
        assert again.pid != first.pid and again.failed_starts == 0
        assert await _chat_text(app, pki, "tiny")
        await connection.close()
        metrics = app.metrics.registry
        assert metrics.get_sample_value("iop_node_engine_restarts_total", {"model": "tiny", "reason": "exited"}) == 1
        assert metrics.get_sample_value("iop_node_engine_state", {"model": "tiny", "state": "ready"}) == 1
        assert metrics.get_sample_value("iop_node_engine_ready_seconds_count", {"model": "tiny"}) == 2
    assert not process_alive(again.pid) and not list((tmp_path / "engines").glob("tiny.*.pid"))  # stopped with the node
    assert metrics.get_sample_value("iop_node_engine_state", {"model": "tiny", "state": "stopping"}) is None


async def test_llama_engine_stopped_by_sigstop_is_killed_and_restarted(
    pki: Pki, tmp_path: Path, tiny_gguf: Path
) -> None:
    route = _llama_route("tiny", tiny_gguf, hang_timeout=1.5, probe_timeout=0.5)
    async with running_node(node_settings(pki, tmp_path, [route], engines_dir=tmp_path / "engines")) as app:
        await assert_eventually(lambda: _ready(app, "tiny"), timeout=30)
        frozen = _served(app, "tiny").pid
        os.kill(frozen, signal.SIGSTOP)
        await assert_eventually(lambda: _served(app, "tiny").restarts == 1, timeout=10)
        assert not process_alive(frozen)  # SIGKILLed, not left stopped
        await assert_eventually(lambda: _ready(app, "tiny"), timeout=30)
        assert await _chat_text(app, pki, "tiny")
        hung = {"model": "tiny", "reason": "hung"}
        assert app.metrics.registry.get_sample_value("iop_node_engine_restarts_total", hung) == 1


async def test_a_missing_or_broken_model_file_ends_failed_with_the_servers_words(
    pki: Pki, tmp_path: Path, tiny_gguf: Path
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_text("this is not a GGUF file\n")
    routes = [
        _llama_route("missing", tmp_path / "no-such.gguf", max_failed_starts=2),
        _llama_route("broken", broken, max_failed_starts=2),
        {"model": "mock-small", "adapter": "mock"},
    ]
    async with running_node(node_settings(pki, tmp_path, routes, engines_dir=tmp_path / "engines")) as app:
        failed = pb.SERVED_STATE_FAILED
        await assert_eventually(lambda: _served(app, "missing").state == failed, timeout=40)
        await assert_eventually(lambda: _served(app, "broken").state == failed, timeout=40)
        missing, broken_served = _served(app, "missing"), _served(app, "broken")
        assert missing.failed_starts == 2 and missing.pid == 0
        assert "exited with status 1" in missing.reason
        assert f"Model path does not exist: {tmp_path / 'no-such.gguf'}" in missing.reason
        assert f"Failed to load model from file: {broken}" in broken_served.reason
        assert not any(load.available for load in app.node.status().models if load.model != "mock-small")
        connection = await client(app, pki)
        refused = (await collect(await connection.open_run(chat(model="missing"))))[-1]
        assert refused.error.code == pb.ERROR_CODE_UNAVAILABLE and refused.error.retryable
        assert "failed: exited with status 1" in refused.error.message
        assert kinds(await collect(await connection.open_run(chat(model="mock-small"))))[-1] == "complete"
        await connection.close()
        capabilities = {info.name: info for info in await app.node.adapters["llama.cpp:missing"].capabilities()}
        assert capabilities["missing"].served.state == failed and not capabilities["missing"].available
        start_failed = {"model": "missing", "reason": "start_failed"}
        assert app.metrics.registry.get_sample_value("iop_node_engine_restarts_total", start_failed) == 2


async def test_command_engine_is_started_served_killed_and_restarted(pki: Pki, tmp_path: Path) -> None:
    settings = node_settings(pki, tmp_path, [_command_route("echo")], engines_dir=tmp_path / "engines")
    async with running_node(settings) as app:
        await assert_eventually(lambda: _ready(app, "echo"), timeout=20)
        assert await _chat_text(app, pki, "echo") == "hello from engine"
        first = _served(app, "echo")
        os.kill(first.pid, signal.SIGKILL)
        await assert_eventually(lambda: not app.node.status().models[0].available, timeout=2)  # at once
        await assert_eventually(lambda: _ready(app, "echo") and _served(app, "echo").restarts == 1, timeout=20)
        assert _served(app, "echo").pid != first.pid
        assert await _chat_text(app, pki, "echo") == "hello from engine"
        log = (tmp_path / "engines" / "echo.log").read_text()
        assert log.count("serving echo on") == 2  # both starts' output, in the model's log


async def test_a_server_ignoring_sigterm_is_killed_after_stop_grace(pki: Pki, tmp_path: Path) -> None:
    server = f"trap '' TERM; exec {sys.executable} {HERE / 'engine_server.py'} $0 deaf"  # SIG_IGN survives exec
    route = {"model": "deaf", "engine": "command", "serve": {**FAST, "command": ["sh", "-c", server, "{port}"]}}
    route["serve"]["stop_grace"] = 0.5
    app = await build_node(node_settings(pki, tmp_path, [route], engines_dir=tmp_path / "engines")).start()
    try:
        await assert_eventually(lambda: _ready(app, "deaf"), timeout=20)
        pid = _served(app, "deaf").pid
    finally:
        started = time.monotonic()
        await app.stop(grace=0)
    assert time.monotonic() - started >= 0.5 and not process_alive(pid)
    assert not list((tmp_path / "engines").glob("deaf.*.pid"))


async def test_failed_starts_say_why_each_way(pki: Pki, tmp_path: Path) -> None:
    once = {**FAST, "max_failed_starts": 1}
    routes = [
        {
            "model": "silent",
            "engine": "command",
            "serve": {**once, "command": ["sleep", "30", "{port}"], "start_timeout": 0.5},
        },
        {
            "model": "exits",
            "engine": "command",
            "serve": {**once, "command": ["sh", "-c", "echo boom; exit 3", "{port}"]},
        },
        {"model": "absent", "engine": "command", "serve": {**once, "command": ["no-such-program-iop", "{port}"]}},
    ]
    async with running_node(node_settings(pki, tmp_path, routes, engines_dir=tmp_path / "engines")) as app:
        failed = pb.SERVED_STATE_FAILED
        await assert_eventually(lambda: all(load.served.state == failed for load in app.node.status().models), 10)
        assert _served(app, "silent").reason == "not ready after 0.5 s"
        assert _served(app, "exits").reason == "exited with status 3; last log lines: boom"
        absent = _served(app, "absent").reason
        assert absent.startswith(
            "exited with status 1; last log lines: iop engine shim: cannot run no-such-program-iop"
        )
        assert not list((tmp_path / "engines").glob("*.pid"))  # each one stopped, its pid file gone


async def test_ollama_engine_creates_its_model_serves_and_restarts(pki: Pki, tmp_path: Path, tiny_gguf: Path) -> None:
    require("ollama")
    modelfile = tmp_path / "tiny.Modelfile"
    modelfile.write_text(OLLAMA_MODELFILE.format(model=tiny_gguf, template=OLLAMA_TEMPLATE))
    (tmp_path / "home").mkdir()
    env = {  # what the Ollama build CI has needs (tests/backends/servers.py)
        "HOME": str(tmp_path / "home"),
        "LD_LIBRARY_PATH": str(venv("ollama") / "lib"),
        "OMP_NUM_THREADS": "1",
        "KMP_BLOCKTIME": "0",
    }
    serve = {"executable": str(ollama_binary()), "env": env, "create": [{"name": "tiny", "modelfile": str(modelfile)}]}
    route = {"model": "tiny", "engine": "ollama", "serve": {**FAST, **serve}}
    async with running_node(node_settings(pki, tmp_path, [route], engines_dir=tmp_path / "engines")) as app:
        await assert_eventually(lambda: _ready(app, "tiny"), timeout=40)
        assert (tmp_path / "engines" / "tiny.d" / "models").is_dir()  # OLLAMA_MODELS: the model's own folder
        assert await _chat_text(app, pki, "tiny")
        first = _served(app, "tiny")
        os.kill(first.pid, signal.SIGKILL)
        await assert_eventually(lambda: _ready(app, "tiny") and _served(app, "tiny").restarts == 1, timeout=40)
        assert await _chat_text(app, pki, "tiny")
        assert "iop: " in (tmp_path / "engines" / "tiny.log").read_text()  # its create, logged with the server


async def test_the_control_plane_sends_runs_past_a_node_whose_server_is_down(pki: Pki, tmp_path: Path) -> None:
    route = _command_route("echo", backoff=30)  # once killed, node-a's server stays down for the test
    async with build_control_plane(cp_settings(pki, tmp_path)) as control_plane:
        assert control_plane.listener is not None
        port = control_plane.listener.port

        def available(node_id: str) -> bool:
            node = control_plane.registry.nodes.get(node_id)
            return node is not None and "echo" in node.models and node.models["echo"].available

        with (
            node_process(pki, tmp_path, port, "node-a", [route], engines_dir=str(tmp_path / "a")),
            node_process(pki, tmp_path, port, "node-b", [route], engines_dir=str(tmp_path / "b")),
        ):
            await assert_eventually(lambda: available("node-a") and available("node-b"), timeout=20)
            connection = await cp_client(control_plane, pki)
            os.kill(json.loads(_one(tmp_path / "a", "echo").read_text())["pid"], signal.SIGKILL)
            for _ in range(3):  # at once: one sent to node-a before it says so fails over before its output
                assert text(await collect(await connection.open_run(chat(model="echo")))) == "hello from engine"
            await assert_eventually(lambda: not available("node-a"), timeout=5)  # its next status says so
            for _ in range(3):
                events = await collect(await connection.open_run(chat(model="echo")))
                assert events[0].start.node_id == "node-b" and text(events) == "hello from engine"
            await connection.close()


def _node_config(pki: Pki, folder: Path, routes: list[dict[str, Any]]) -> Path:
    tls = pki.config("node-e", Role.NODE)
    data = {
        "node_id": "node-e",
        "listen": {"port": 0},
        "tls": {"enabled": True, "cert": str(tls.cert), "key": str(tls.key), "ca": str(tls.ca)},
        "store_path": "runs.db",
        "engines_dir": "engines",
        "routes": routes,
    }
    path = folder / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _start_node(config: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "iop_cli.main", "node", "--config", str(config)]
    with (config.parent / "node.log").open("ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)


def _server_and_child(engines: Path) -> tuple[int, int] | None:
    """The command server's pid (its pid file) and its child's (its log), once both are written."""
    try:
        pid = json.loads(_one(engines, "echo").read_text())["pid"]
        child = int((engines / "echo.log").read_text().split("child ", 1)[1].split()[0])
    except (OSError, ValueError, IndexError, KeyError):
        return None
    return pid, child


async def test_kill_9_of_the_node_leaves_no_server_running(pki: Pki, tmp_path: Path) -> None:
    config = _node_config(pki, tmp_path, [_command_route("echo", "--child")])
    engines = tmp_path / "engines"
    node = _start_node(config)
    server = child = 0
    try:
        await assert_eventually(lambda: _server_and_child(engines) is not None, timeout=20)
        found = _server_and_child(engines)
        assert found is not None
        server, child = found
        assert process_alive(server) and process_alive(child)
        node.kill()
        node.wait(timeout=10)
        # the server dies with the node (PR_SET_PDEATHSIG); what it started does not ...
        await assert_eventually(lambda: not process_alive(server), timeout=5)
        assert process_alive(child)
        # ... until the node starts again and kills the rest of the group named in the pid file
        node = _start_node(config)
        await assert_eventually(lambda: not process_alive(child), timeout=20)
        # The node logs the kill after its killpg: on a slow host the test can see the child gone first.
        killed = "engine left running by an earlier node killed"
        await assert_eventually(lambda: killed in (tmp_path / "node.log").read_text(), timeout=10)
        await assert_eventually(lambda: (found := _server_and_child(engines)) is not None and found[0] != server, 20)
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(timeout=15)
        for pid in (server, child):  # when the test failed: nothing of it left running
            if pid and process_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not list(engines.glob("echo.*.pid"))


def test_a_pid_file_whose_process_started_at_another_time_kills_nothing(tmp_path: Path) -> None:
    with subprocess.Popen(["sleep", "20"], start_new_session=True) as stranger:
        started = int(Path(f"/proc/{stranger.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        record = {"pid": stranger.pid, "pgid": stranger.pid, "argv": ["sleep", "20"], "node_pid": 1 << 30}
        (tmp_path / "recycled.pid").write_text(json.dumps({**record, "start_time": started - 1}))
        (tmp_path / "model.pid").mkdir()  # the folder of a model named "model.pid": not a pid file
        assert kill_leftovers(tmp_path) == 0
        assert (tmp_path / "model.pid").is_dir()
        assert stranger.poll() is None and not (tmp_path / "recycled.pid").exists()
        (tmp_path / "ours.pid").write_text(json.dumps({**record, "start_time": started}))
        assert kill_leftovers(tmp_path) == 1
        assert stranger.wait(timeout=5) == -signal.SIGKILL
        # a node that runs still (this test's process) keeps its servers, even in a shared folder
        with subprocess.Popen(["sleep", "20"], start_new_session=True) as kept:
            started = int(Path(f"/proc/{kept.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
            node = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
            shared = {"pid": kept.pid, "pgid": kept.pid, "start_time": started, "node_pid": os.getppid()}
            (tmp_path / "kept.pid").write_text(json.dumps({**shared, "node_start_time": node}))
            assert kill_leftovers(tmp_path) == 0
            assert kept.poll() is None and (tmp_path / "kept.pid").exists()
            kept.kill()


def _one(engines: Path, model: str) -> Path:
    """The pid file of the one server of ``model`` running from ``engines``."""
    (found,) = engines.glob(f"{model}.*.pid")
    return found


def _pids(engines: Path, model: str) -> list[int]:
    return [json.loads(path.read_text())["pid"] for path in engines.glob(f"{model}.*.pid")]


async def test_a_replaced_route_leaves_the_new_servers_state_series_and_engines_dir(pki: Pki, tmp_path: Path) -> None:
    config = _node_config(pki, tmp_path, [_command_route("echo", "--slow")])
    engines, state = tmp_path / "engines", {"model": "echo", "state": "ready"}
    app = await build_node(load_settings(config), config_path=config).start()
    try:
        await assert_eventually(lambda: _ready(app, "echo"), timeout=20)
        (old,) = _pids(engines, "echo")
        connection = await client(app, pki)
        slow = await connection.open_run(chat(model="echo"))  # about 2.5 s on the old server
        assert kinds([await anext(slow), await anext(slow)]) == ["start", "delta"]
        data = yaml.safe_load(config.read_text())  # engines_dir waits for a restart, also for the new server
        config.write_text(yaml.safe_dump({**data, "engines_dir": "elsewhere", "routes": [_command_route("echo")]}))
        assert (await app.reload()).restart == ("engines_dir",)
        await assert_eventually(lambda: _ready(app, "echo"), timeout=20)
        assert process_alive(old)  # the new one is ready first: the old one's stop comes after
        assert kinds(await collect(slow))[-1] == "complete"
        await connection.close()
        await assert_eventually(lambda: not process_alive(old) and len(_pids(engines, "echo")) == 1, timeout=20)
        assert app.metrics.registry.get_sample_value("iop_node_engine_state", state) == 1
        assert _ready(app, "echo") and not (tmp_path / "elsewhere").exists()
    finally:
        await app.stop(grace=0)
    assert app.metrics.registry.get_sample_value("iop_node_engine_state", state) is None


async def test_a_reload_asked_before_the_start_waits_for_it(pki: Pki, tmp_path: Path) -> None:
    config = _node_config(pki, tmp_path, [_command_route("echo")])
    app = build_node(load_settings(config), config_path=config)
    config.write_text(config.read_text().replace("echo", "other"))
    reload = asyncio.create_task(app.reload())  # a SIGHUP while the node starts
    await asyncio.sleep(0.5)
    assert not reload.done()
    await app.start()
    try:
        await reload
        await assert_eventually(lambda: _ready(app, "other"), timeout=20)  # not killed by the start's clean-up
        assert len(_pids(tmp_path / "engines", "other")) == 1
    finally:
        await app.stop(grace=0)


async def test_a_server_exiting_soon_after_each_ready_ends_failed(pki: Pki, tmp_path: Path) -> None:
    route = _command_route("flaky", "--exit-after", "0.5", max_failed_starts=3)
    async with running_node(node_settings(pki, tmp_path, [route], engines_dir=tmp_path / "engines")) as app:
        await assert_eventually(lambda: _served(app, "flaky").state == pb.SERVED_STATE_FAILED, timeout=30)
        served = _served(app, "flaky")
        assert served.restarts == 3 and served.failed_starts == 3
        assert served.reason.startswith("exited with status 0")
        assert not list((tmp_path / "engines").glob("*.pid"))


async def test_a_server_hanging_soon_after_each_ready_ends_failed_however_long_hang_timeout(
    pki: Pki, tmp_path: Path
) -> None:
    # detected 1.5 s after its last answer, past stable_after (1 s): still a crash loop, as it served 0.2 s
    route = _command_route("frozen", "--stop-after", "0.2", max_failed_starts=2, stable_after=1, hang_timeout=1.5)
    async with running_node(node_settings(pki, tmp_path, [route], engines_dir=tmp_path / "engines")) as app:
        await assert_eventually(lambda: _served(app, "frozen").state == pb.SERVED_STATE_FAILED, timeout=30)
        served = _served(app, "frozen")
        assert served.restarts == 2 and served.failed_starts == 2
        assert served.reason.startswith("stopped answering for"), served.reason
        assert not list((tmp_path / "engines").glob("*.pid"))


def _fake_ollama(folder: Path, *serve: str) -> Path:
    """An ``ollama`` of the tests': ``serve`` runs engine_server.py SERVE... on OLLAMA_HOST's port; any
    other command (pull) says so, then sleeps (a pull that takes long)."""
    script = folder / "ollama"
    server = f"{sys.executable} {HERE / 'engine_server.py'}"
    script.write_text(
        f'#!/bin/sh\nif [ "$1" = serve ]; then exec {server} "${{OLLAMA_HOST##*:}}" {" ".join(serve)}; fi\n'
        'echo "$1 $2 started"; exec sleep 301.5\n'
    )
    script.chmod(0o755)
    return script


async def test_a_malformed_model_list_is_not_ready_and_the_server_is_stopped(pki: Pki, tmp_path: Path) -> None:
    serve = {**FAST, "executable": str(_fake_ollama(tmp_path, "bad", "--bad-list")), "start_timeout": 1}
    route = {"model": "bad", "engine": "ollama", "serve": {**serve, "max_failed_starts": 1}}
    async with running_node(node_settings(pki, tmp_path, [route], engines_dir=tmp_path / "engines")) as app:
        await assert_eventually(lambda: _served(app, "bad").state == pb.SERVED_STATE_FAILED, timeout=20)
        reason = _served(app, "bad").reason
        assert reason.startswith("not ready after 1 s: GET /api/tags: its model list is not an object"), reason
        assert not list((tmp_path / "engines").glob("*.pid"))  # stopped, not left running


async def test_a_setup_command_running_when_the_node_stops_is_stopped(pki: Pki, tmp_path: Path) -> None:
    serve = {**FAST, "executable": str(_fake_ollama(tmp_path, "tiny")), "pull": ["tiny"]}
    route = {"model": "tiny", "engine": "ollama", "serve": serve}
    engines = tmp_path / "engines"
    try:
        async with running_node(node_settings(pki, tmp_path, [route], engines_dir=engines)):
            await assert_eventually(lambda: "pull tiny started" in (engines / "tiny.log").read_text(), timeout=20)
            # the script says so just before it execs the sleep that stands for the pull
            await assert_eventually(lambda: len(_children_running("301.5")) == 1, timeout=10)
            (pull,) = _children_running("301.5")
        assert not process_alive(pull)
    finally:
        for pid in _children_running("301.5"):  # when the test failed
            os.kill(pid, signal.SIGKILL)


async def test_a_process_of_the_servers_session_in_another_group_is_stopped_with_it(pki: Pki, tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    route = _command_route("echo", "--child-group")
    async with running_node(node_settings(pki, tmp_path, [route], engines_dir=engines)) as app:
        await assert_eventually(lambda: _ready(app, "echo") and _server_and_child(engines) is not None, timeout=20)
        found = _server_and_child(engines)
        assert found is not None and process_alive(found[1])
        assert os.getpgid(found[1]) != found[0] and os.getsid(found[1]) == found[0]
    try:
        assert not process_alive(found[0]) and not process_alive(found[1])
    finally:
        if process_alive(found[1]):
            os.kill(found[1], signal.SIGKILL)


class _NoPidFolder(EngineFiles):
    """Pid files in a folder that is not there: the write fails after the process started."""

    def pid_file(self, pid: int) -> Path:
        return self.directory / "missing" / f"{pid}.pid"


def _children_running(argument: str) -> list[int]:
    """This process's children whose command line has ``argument``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            running = stat[0] != "Z" and int(stat[1]) == os.getpid()
            if running and argument in (entry / "cmdline").read_bytes().decode().split("\0"):
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


async def test_a_server_whose_pid_file_cannot_be_written_is_killed(tmp_path: Path) -> None:
    files = _NoPidFolder(tmp_path, "m")
    log = RotatingLog.shared(files.log, max_bytes=1024, backups=0)
    try:
        with pytest.raises(FileNotFoundError):
            await spawn(["sleep", "301.25"], env={}, files=files, log=log)
        assert _children_running("301.25") == []
    finally:
        log.close()
        for pid in _children_running("301.25"):  # when the test failed
            os.kill(pid, signal.SIGKILL)


def test_an_engine_log_that_cannot_be_written_drops_output_then_writes_again(tmp_path: Path) -> None:
    folder = tmp_path / "engines"
    log = RotatingLog.shared(folder / "m.log", max_bytes=1024, backups=1)
    assert RotatingLog.shared(folder / "m.log", max_bytes=1024, backups=1) is log  # one per file
    log.write(b"a" * 1000)
    shutil.rmtree(folder)
    log.write(b"b" * 100)  # the rotation fails: dropped, not raised
    log.write(b"c" * 100)  # the file is closed: dropped, not raised
    folder.mkdir()
    log.write(b"d" * 10)  # opened again
    assert (folder / "m.log").read_bytes() == b"d" * 10
    log.close()
    log.close()
    again = RotatingLog.shared(folder / "m.log", max_bytes=1024, backups=1)
    assert again is not log
    again.close()


def _process_with_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """A ``sleep`` in a session of its own given ``pid`` (as root, by /proc/sys/kernel/ns_last_pid); None
    when that cannot be done."""
    for _ in range(5):  # another process on the machine may take it first
        try:
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        except OSError:
            return None
        process = subprocess.Popen(["sleep", "30"], start_new_session=True)
        if process.pid == pid:
            return process
        process.kill()
        process.wait()
    return None


async def test_the_pid_of_a_server_that_exited_is_never_signalled_later(pki: Pki, tmp_path: Path) -> None:
    serve = {**FAST, "max_failed_starts": 1, "command": ["sh", "-c", "echo pid $$; exit 3", "{port}"]}
    app = await build_node(node_settings(pki, tmp_path, [{"model": "exits", "engine": "command", "serve": serve}],
                                         engines_dir=tmp_path / "engines")).start()  # fmt: skip
    stranger = None
    try:
        await assert_eventually(lambda: _served(app, "exits").state == pb.SERVED_STATE_FAILED, timeout=20)
        reaped = int(_served(app, "exits").reason.split("pid ")[1].split()[0])
        stranger = _process_with_pid(reaped)  # another program's process, given the server's pid
    finally:
        await app.stop(grace=0)  # stops the route's supervisor
    if stranger is None:
        pytest.skip("this test needs root to choose the next pid (/proc/sys/kernel/ns_last_pid)")
    try:
        assert stranger.poll() is None, "the process that now has the pid was killed"
    finally:
        stranger.kill()
        stranger.wait()


async def test_setup_output_split_across_reads_stays_one_line(tmp_path: Path) -> None:
    files = EngineFiles(tmp_path, "m")
    log = RotatingLog.shared(files.log, max_bytes=1024, backups=0)
    server = await spawn(["sleep", "30"], env={}, files=files, log=log)
    try:
        server.note(b"pulling 10%")
        server.note(b", 20%\nsuccess\n")
        assert server.last_lines() == "pulling 10%, 20% | success"
    finally:
        await server.kill()
        log.close()


async def test_a_reload_that_fails_to_start_leaves_the_serving_routes_state_series(pki: Pki, tmp_path: Path) -> None:
    config = _node_config(pki, tmp_path, [_command_route("echo"), {"model": "bad", "adapter": "mock"}])
    state = {"model": "echo", "state": "ready"}
    app = await build_node(load_settings(config), config_path=config).start()
    try:
        await assert_eventually(lambda: _ready(app, "echo"), timeout=20)
        (tmp_path / "engines" / "bad.log").mkdir()  # bad, served next, cannot open its log: its start fails
        data = yaml.safe_load(config.read_text())
        config.write_text(yaml.safe_dump({**data, "routes": [_command_route("echo", "--slow"), _command_route("bad")]}))
        with pytest.raises(StartError, match="engines_dir"):
            await app.reload()  # the new echo server was started, then stopped with the reload
        assert _ready(app, "echo")  # the old one serves on, and says so
        assert app.metrics.registry.get_sample_value("iop_node_engine_state", state) == 1
    finally:
        await app.stop(grace=0)


async def test_a_start_cancelled_after_the_fork_leaves_nothing_running(tmp_path: Path) -> None:
    # asyncio alone kills the leader and waits, here ten minutes, for the pipes its child holds open.
    pid_file = tmp_path / "pid"
    argv = ["sh", "-c", 'sleep 600 & echo $! > "$1"; sleep 600', "sh", str(pid_file)]
    pipe = asyncio.subprocess
    task = asyncio.create_task(start_in_session(argv, stdin=pipe.DEVNULL, stdout=pipe.PIPE, stderr=pipe.STDOUT))
    await forked_and_frozen(task, lambda: pid_file.exists() and pid_file.read_text().endswith("\n"))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(20):  # a bound on a hang, not a timing check
            await task
    child = int(pid_file.read_text())
    await assert_eventually(lambda: not process_alive(child))
