"""``iop node`` as a real process: start-up, bad config, SIGTERM, kill -9, and ``iop runs``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Pki, assert_eventually
from node_helpers import chat, collect, kinds

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection
from iop_wire.endpoint import dial
from iop_wire.tls import Role

IOP = [sys.executable, "-m", "iop_cli.main"]


def _config(pki: Pki, tmp_path: Path, **extra: Any) -> Path:
    tls = pki.config("node-p", Role.NODE)
    data = {
        "node_id": "node-p",
        "listen": {"port": 0},
        "tls": {"enabled": True, "cert": str(tls.cert), "key": str(tls.key), "ca": str(tls.ca)},
        "store_path": str(tmp_path / "history.db"),
        "heartbeat_interval": 0.5,
        "routes": [
            {"model": "mock-small", "adapter": "mock"},
            {"model": "mock-slow", "adapter": "mock", "options": {"tokens": 20, "tokens_per_second": 20}},
        ],
        **extra,
    }
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@contextmanager
def _node_process(config: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Start ``iop node``; yield it with its port once it logged "node started"."""
    with subprocess.Popen(
        [*IOP, "node", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stderr is not None
        try:
            for line in process.stderr:
                event = json.loads(line)
                if event.get("event") == "node started":
                    # keep draining its log so the process never blocks on a full pipe
                    threading.Thread(target=process.stderr.read, daemon=True).start()
                    yield process, int(event["port"])
                    break
            else:
                raise AssertionError(f"node exited before starting: {process.wait()}")
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # a graceful stop commits the history
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


async def _client(pki: Pki, port: int) -> Connection:
    return await dial("127.0.0.1", port, tls=pki.config("edge-p", Role.EDGE), server_hostname="localhost")


def _runs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*IOP, "runs", *args], capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"listen": {"port": "eighty"}}, r"listen\.port \(line \d+\): Input should be a valid integer"),
        ({"routes": [{"model": "m", "adapter": "warp"}]}, r"routes\.0\.adapter \(line \d+\): unknown adapter 'warp'"),
        (
            {"routes": [{"model": "m", "adapter": "cli", "options": {}}]},
            r"routes\.0\.options\.argv \(line \d+\): Field required",
        ),
        ({"heartbeat_interval": -1}, r"heartbeat_interval \(line \d+\): Input should be greater than 0"),
        ({"tls": {"enabled": True}}, r"tls\.cert \(line \d+\): required when tls\.enabled is true"),
        ({"colour": "blue"}, r"colour \(line \d+\): Extra inputs are not permitted"),
        (
            {"routes": [{"model": "m", "adapter": "vllm", "options": {"base_url": "https://h", "ca": "/no/ca.pem"}}]},
            r"routes\.0\.options\.ca \(line \d+\): Path does not point to a file",
        ),
    ],
    ids=["type", "adapter", "adapter-options", "range", "tls", "unknown-key", "backend-ca"],
)
def test_bad_config_stops_start_up_with_one_line_naming_the_key(
    pki: Pki, tmp_path: Path, change: dict[str, Any], expected: str
) -> None:
    config = _config(pki, tmp_path)
    data = yaml.safe_load(config.read_text())
    data.update(change)
    config.write_text(yaml.safe_dump(data))
    result = subprocess.run(
        [*IOP, "node", "--config", str(config)], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("iop node: bad config: ")
    assert re.search(expected, lines[0]), lines[0]


def test_environment_overrides_the_file(pki: Pki, tmp_path: Path) -> None:
    config = _config(pki, tmp_path)
    result = subprocess.run(
        [*IOP, "node", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, "IOP_ROUTES": "[]", "IOP_LISTEN__PORT": "-5"},
    )
    assert result.returncode == 2
    assert "listen.port" in result.stderr


async def test_sigterm_lets_in_flight_runs_finish_then_exits_zero(pki: Pki, tmp_path: Path) -> None:
    with _node_process(_config(pki, tmp_path, shutdown_grace=10)) as (process, port):
        connection = await _client(pki, port)
        stream = await connection.open_run(chat(model="mock-slow", run_id="finishing"))
        await anext(stream)
        process.send_signal(signal.SIGTERM)
        events = await collect(stream)
        assert kinds(events)[-1] == "complete"  # one second of tokens, well inside the grace
        assert await asyncio.to_thread(process.wait, 10) == 0
    shown = _runs("show", "finishing", "--db", str(tmp_path / "history.db"))
    assert "status: completed" in shown.stdout


async def test_sigterm_past_the_grace_cancels_with_a_retryable_error(pki: Pki, tmp_path: Path) -> None:
    with _node_process(_config(pki, tmp_path, shutdown_grace=0.2)) as (process, port):
        connection = await _client(pki, port)
        stream = await connection.open_run(chat(model="mock-slow", run_id="cut"))
        await anext(stream)
        process.send_signal(signal.SIGTERM)
        events = await collect(stream)
        assert events[-1].error.retryable and events[-1].error.code == pb.ERROR_CODE_SHUTTING_DOWN
        assert await asyncio.to_thread(process.wait, 10) == 0
    shown = _runs("show", "cut", "--db", str(tmp_path / "history.db"))
    assert "status: cancelled" in shown.stdout


def _row_status(db: Path, run_id: str) -> str | None:
    with sqlite3.connect(db) as connection:
        row = connection.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return row[0] if row else None


async def test_kill_9_leaves_interrupted_rows_after_restart(pki: Pki, tmp_path: Path) -> None:
    config = _config(pki, tmp_path)
    db = tmp_path / "history.db"
    with _node_process(config) as (process, port):
        connection = await _client(pki, port)
        stream = await connection.open_run(chat(model="mock-slow", run_id="doomed"))
        await anext(stream)
        await assert_eventually(lambda: _row_status(db, "doomed") == "running")
        process.kill()
        await asyncio.to_thread(process.wait, 10)
        assert (await collect(stream))[-1].error.retryable  # the client sees the connection go
    with _node_process(config):
        await assert_eventually(lambda: _row_status(db, "doomed") == "interrupted")
    listed = _runs("ls", "--db", str(db), "--status", "interrupted")
    assert listed.returncode == 0 and "doomed" in listed.stdout


async def test_runs_ls_and_show(pki: Pki, tmp_path: Path) -> None:
    config = _config(pki, tmp_path)
    with _node_process(config) as (_, port):
        connection = await _client(pki, port)
        await collect(await connection.open_run(chat(run_id="good")))
        await collect(await connection.open_run(chat(model="nope", run_id="bad")))
        await connection.close()
    everything = _runs("ls", "--config", str(config))
    assert everything.returncode == 0
    assert "good" in everything.stdout and "bad" in everything.stdout
    failed = _runs("ls", "--config", str(config), "--status", "failed", "--since", "1h")
    assert "bad" in failed.stdout and "good" not in failed.stdout
    shown = _runs("show", "bad", "--config", str(config))
    assert "MODEL_NOT_FOUND" in shown.stdout
    assert _runs("show", "never", "--config", str(config)).returncode == 1
    wrong = _runs("ls", "--config", str(config), "--status", "exploded")
    assert wrong.returncode == 2 and "exploded" in wrong.stderr
