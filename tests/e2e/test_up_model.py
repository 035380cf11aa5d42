"""``iop up --model tiny.gguf``: the platform serves a GGUF file through the llama-cpp-python server
its node runs, to the official OpenAI SDK; ``iop models``, ``iop nodes ls`` and ``iop status`` show
the model ready with its server's pid and port; ``iop down`` leaves no server running. A file that
is GGUF only in its first bytes: ``iop up`` says the node's reason and exits 1. ``iop join
--model`` does the same on a joining machine.

Real processes throughout: ``iop up`` (control-plane, node, worker, edge), the llama backend's
Python (tests/backends/install.sh) running the tiny model tests/backends makes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from backends.fixtures import require
from backends.servers import venv
from conftest import process_alive

IOP = [sys.executable, "-m", "iop_cli.main"]
ENV = {k: v for k, v in os.environ.items() if k not in ("IOP_STATE_DIR", "IOP_API_KEY", "IOP_CONTROL_PLANE")}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _iop(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*IOP, *args], capture_output=True, text=True, timeout=timeout, check=False, env=ENV)


def _printed(output: str, label: str) -> str:
    return next(line.removeprefix(f"{label}: ") for line in output.splitlines() if line.startswith(f"{label}: "))


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "state"
    yield folder
    _iop("down", "--dir", str(folder), timeout=300)


@pytest.fixture
def llama() -> str:
    require("llama")
    return str(venv("llama") / "bin" / "python")


def test_up_serves_a_gguf_file_to_the_openai_sdk_and_shows_it_ready(state: Path, tiny_gguf: Path, llama: str) -> None:
    from openai import OpenAI

    started = _iop(
        "up", "--dir", str(state), "--port", "0", "--model", str(tiny_gguf), "--llama-python", llama, timeout=240
    )
    assert started.returncode == 0, started.stdout + started.stderr
    ready = re.search(r"^model tiny: ready \(llama\.cpp, pid (\d+), port (\d+)\) in [\d.]+ s$", started.stdout, re.M)
    assert ready, started.stdout
    pid, port = ready.groups()
    assert b"llama_cpp.server" in Path(f"/proc/{pid}/cmdline").read_bytes()

    client = OpenAI(base_url=_printed(started.stdout, "base URL"), api_key=_printed(started.stdout, "API key"))
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    assert answer.choices[0].message.content
    client.close()

    models = _iop("models", "--dir", str(state))
    assert re.search(r"^tiny\s+1\s+ready$", models.stdout, re.M), models.stdout
    nodes = _iop("nodes", "ls", "--dir", str(state))
    assert re.search(rf"tiny \(llama\.cpp: ready, up \d+\w*, pid {pid}, port {port}\)", nodes.stdout), nodes.stdout
    status = _iop("status", "--dir", str(state))
    assert status.returncode == 0, status.stdout
    assert re.search(rf"^model tiny: llama\.cpp: ready, up \d+\w*, pid {pid}, port {port}$", status.stdout, re.M)
    node = next(
        row for row in json.loads(_iop("status", "--dir", str(state), "--json").stdout) if row["service"] == "node"
    )
    assert [(m["model"], m["state"], m["pid"], m["port"]) for m in node["served"]] == [
        ("tiny", "ready", int(pid), int(port))
    ]

    stopped = _iop("down", "--dir", str(state), timeout=300)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    deadline = time.monotonic() + 30
    while process_alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(int(pid)), "the node left its llama.cpp server running"


def test_a_file_the_server_cannot_load_is_failed_with_the_nodes_reason(state: Path, tmp_path: Path, llama: str) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(4096))  # the magic passes the CLI's check; llama.cpp refuses the rest
    started = _iop(
        "up", "--dir", str(state), "--port", "0", "--model", str(broken), "--llama-python", llama, timeout=280
    )
    assert started.returncode == 1, started.stdout + started.stderr
    assert re.search(r"^model broken: llama\.cpp: failed, .*\d+ failed starts: .+", started.stdout, re.M), (
        started.stdout
    )
    assert started.stderr.startswith("iop up: broken failed (see above); the platform runs on")
    assert re.search(r"^model broken: llama\.cpp: failed", _iop("status", "--dir", str(state)).stdout, re.M)


def test_a_joining_machine_serves_a_gguf_file(state: Path, tmp_path: Path, tiny_gguf: Path, llama: str) -> None:
    """``iop join ... --model tiny.gguf``: the joined node runs the server; the platform's edge serves it."""
    from openai import OpenAI

    started = _iop("up", "--dir", str(state), "--port", "0", timeout=120)  # the mock models
    assert started.returncode == 0, started.stdout + started.stderr
    join_line = _iop("join-token", "create", "--dir", str(state)).stdout.split()
    machine = tmp_path / "machine"
    try:
        joined = _iop(
            *join_line[1:], "--name", "gguf-b", "--dir", str(machine), "--model", f"{tiny_gguf}=tiny",
            "--llama-python", llama, timeout=120,
        )  # fmt: skip
        assert joined.returncode == 0, joined.stdout + joined.stderr
        assert "serves: tiny" in joined.stdout and "the node starts the server of tiny" in joined.stdout
        assert yaml.safe_load((machine / "node.yaml").read_text())["engines_dir"] == str((machine / "models").resolve())

        deadline, served = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            nodes = json.loads(_iop("nodes", "ls", "--dir", str(state), "--json").stdout)
            models = {m["model"]: m for node in nodes if node["node_id"] == "gguf-b" for m in node["models"]}
            if (served := (models.get("tiny") or {}).get("served")) and served["state"] == "ready":
                break
            time.sleep(0.5)
        assert served and served["state"] == "ready", served
        client = OpenAI(base_url=_printed(started.stdout, "base URL"), api_key=_printed(started.stdout, "API key"))
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
        assert answer.choices[0].message.content
        client.close()
    finally:
        _iop("down", "--dir", str(machine), timeout=300)
    deadline = time.monotonic() + 30
    while process_alive(served["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(served["pid"]), "the joined node left its llama.cpp server running"
