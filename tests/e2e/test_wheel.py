"""The wheel ``uv build`` makes, installed into a fresh virtual environment, joins a machine.

The new machine has no checkout: its ``iop`` is the wheel's, installed with its dependencies
(``uv pip install``: uv's cache, else PyPI) into a virtual environment of its own, run from a
folder outside the repository. The platform it joins is this checkout's (``iop up``, on
127.0.0.1). uv is ``$UV`` (``uv run`` sets it), else ``uv`` on PATH, else ``python3 -m uv``;
without one the test is skipped, saying so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .join_helpers import (
    ENV,
    IOP,
    chat,
    client,
    done,
    join_line,
    ledger,
    local,
    nodes,
    option,
    ready_port,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPOSITORY = Path(__file__).resolve().parents[2]


def _uv() -> list[str]:
    """How to run uv here."""
    found = os.environ.get("UV") or shutil.which("uv")
    for command in ([found] if found else [], [sys._base_executable, "-m", "uv"]):  # type: ignore[attr-defined]
        if command and local(*command, "--version", timeout=30).returncode == 0:
            return command
    pytest.skip("no uv: neither $UV, nor uv on PATH, nor python3 -m uv (python3 -m pip install uv)")


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel of this checkout and its dependencies; its bin folder."""
    uv = _uv()
    built = tmp_path_factory.mktemp("wheel")
    done(local(*uv, "build", "--wheel", "--out-dir", str(built), str(REPOSITORY), timeout=300))
    [wheel] = built.glob("iop-*.whl")
    environment = tmp_path_factory.mktemp("machine") / "venv"
    done(local(*uv, "venv", "--python", sys.executable, str(environment), timeout=120))
    done(local(*uv, "pip", "install", "--python", str(environment / "bin" / "python"), str(wheel), timeout=300))
    return environment / "bin"


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[Path]:
    """This checkout's platform (``iop up`` on 127.0.0.1); its state folder."""
    state = tmp_path / "a"
    try:
        done(local(*IOP, "up", "--dir", str(state), "--port", "0"))
        yield state
    finally:
        local(*IOP, "down", "--dir", str(state))


def test_the_wheels_iop_join_registers_a_node_that_serves(venv: Path, platform: Path, tmp_path: Path) -> None:
    words = join_line(local(*IOP, "join-token", "create", "--dir", str(platform)))
    address = f"127.0.0.1:{ready_port(platform, 'control-plane')}"  # this machine is both: no --listen needed
    joined = tmp_path / "b"
    command = [str(venv / "iop"), "join", address, "--token", option(words, "--token"), "--ca", option(words, "--ca")]
    try:
        outside = subprocess.run(  # from a folder without the checkout: nothing of it on sys.path
            [*command, "--name", "wheel-node", "--mock", "--dir", str(joined)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=tmp_path,
            env=ENV,
        )
        done(outside)
        node_pid = int((joined / "node.pid").read_text())
        started = Path(f"/proc/{node_pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        assert Path(started).parent == venv, f"the node runs {started}, not the wheel's interpreter"
        listed = nodes(local, platform)
        assert listed["wheel-node"]["state"] == "ready", listed
        done(local(*IOP, "nodes", "drain", "local-node", "--dir", str(platform)))
        model = min(str(served["model"]) for served in listed["wheel-node"]["models"])
        with client(f"http://127.0.0.1:{ready_port(platform, 'edge')}/v1", platform) as sdk:
            run_id = chat(sdk, model)
        assert ledger(local, platform, [run_id]) == {run_id: "wheel-node"}
    finally:
        local(str(venv / "iop"), "down", "--dir", str(joined))
