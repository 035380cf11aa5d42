"""``iop up`` that cannot start: one line on stderr naming the file, exit 2, and no process started.

Each state folder is written by ``iop up``'s own writer (``prepare``: certificates, configs, the
API key), then one file is broken the way a user or a crash could break it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

IOP = [sys.executable, "-m", "iop_cli.main"]
ENV = {k: v for k, v in os.environ.items() if k not in ("IOP_STATE_DIR", "IOP_API_KEY")}
LOGS = ("control-plane.log", "node.log", "worker.log", "edge.log", "supervise.log")


def _iop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*IOP, *args], capture_output=True, text=True, timeout=120, check=False, env=ENV)


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """A state folder as a first ``iop up`` writes it, nothing running; stopped after the test if it started."""
    from iop_cli.configs import prepare

    folder = tmp_path / "state"
    with contextlib.redirect_stdout(None):
        prepare(folder, 0, None)
    yield folder
    if any(folder.glob("*.pid")):
        _iop("down", "--dir", str(folder))


def _refused(state: Path) -> str:
    """``iop up`` in ``state`` must refuse: exit 2, one line on stderr (returned), no service started."""
    result = _iop("up", "--dir", str(state), "--port", "0")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("iop up: "), result.stderr
    assert "Traceback" not in result.stderr
    assert not [log for log in LOGS if (state / log).exists()], "a process was started"
    return result.stderr


def _binary_edge(state: Path) -> None:
    (state / "edge.yaml").write_bytes(bytes(range(256)) * 4)


def _directory_edge(state: Path) -> None:
    (state / "edge.yaml").unlink()
    (state / "edge.yaml").mkdir()


def _bad_edge_value(state: Path) -> None:
    edge = yaml.safe_load((state / "edge.yaml").read_text())
    edge["http"]["header_timeout"] = "soon"
    (state / "edge.yaml").write_text(yaml.safe_dump(edge))


def _corrupt_keys(state: Path) -> None:
    (state / "edge-keys.db").write_bytes(b"not a database" * 512)


def _newer_keys(state: Path) -> None:
    with contextlib.closing(sqlite3.connect(state / "edge-keys.db")) as db, db:  # as a newer edge would leave it
        db.execute("UPDATE schema_version SET version = version + 100")


def _bad_certificate(state: Path) -> None:
    (state / "certs" / "edge.crt").write_text("garbage\n")


def _empty_api_key(state: Path) -> None:
    (state / "api-key").write_text("")


@pytest.mark.parametrize(
    ("breaks", "named"),
    [
        (_binary_edge, "edge.yaml: not UTF-8 text"),
        (_directory_edge, "edge.yaml is not a file"),
        (_bad_edge_value, "http.header_timeout"),
        (_corrupt_keys, "edge-keys.db"),
        (_newer_keys, "newer than this edge's"),
        (_bad_certificate, "tls.cert"),
        (_empty_api_key, "api-key is empty"),
    ],
    ids=[
        "binary-edge-yaml",
        "directory-edge-yaml",
        "bad-edge-value",
        "corrupt-keys",
        "newer-keys",
        "bad-certificate",
        "empty-key",
    ],
)
def test_a_broken_file_is_one_line_before_any_process(state: Path, breaks: Callable[[Path], None], named: str) -> None:
    breaks(state)
    assert named in _refused(state)


def test_a_broken_control_plane_config_is_named_not_taken_for_a_port_in_use(state: Path) -> None:
    config = state / "control-plane.yaml"
    port = yaml.safe_load(config.read_text())["listen"]["port"]
    config.write_text(f"listen: {{port: {port}, host: [broken\n")
    with socket.socket() as held:  # the port it names is taken, as by another platform on 7400
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", port))
        held.listen()
        line = _refused(state)
    assert "not valid YAML" in line and "in use" not in line


def test_a_second_up_while_one_is_at_work_is_one_line(state: Path) -> None:
    with (state / "up.lock").open("a") as lock:  # what a first `iop up` holds while it starts the platform
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        line = _refused(state)
    assert "another 'iop up' or 'iop down' is at work" in line and "up.lock" in line
