"""A bad config of `iop edge`, `iop worker`, `iop control-plane`: one line naming the key, exit 2; a port taken too."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
from cp_helpers import IOP


def _run(service: str, config: Path) -> subprocess.CompletedProcess[str]:
    command = [*IOP, service, "--config", str(config)]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("service", "text", "key"),
    [
        ("edge", "http: {port: 70000}\n", "http.port"),
        ("edge", "auth: maybe\n", "auth"),
        ("edge", "control_plane: {address: cp.internal}\n", "control_plane.address"),
        ("edge", "console: {max_watchers: 0}\n", "console.max_watchers"),
        ("edge", "console: {max_watchers_per_key: 0}\n", "console.max_watchers_per_key"),
        ("edge", "console: {push_interval: 0}\n", "console.push_interval"),
        ("edge", "console: {admin_cert: admin.crt}\n", "console"),  # without its admin_key
        ("worker", "batches: {concurrency: 0}\n", "batches.concurrency"),
        ("worker", "store: {url: mysql://db}\n", "store.url"),
        ("worker", "nice: lowest\n", "nice"),
        ("worker", "nice: 25\n", "nice"),
        ("control-plane", "background_yield: -1\n", "background_yield"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_key(tmp_path: Path, service: str, text: str, key: str) -> None:
    config = tmp_path / f"{service}.yaml"
    config.write_text(text)
    result = _run(service, config)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"iop {service}: bad config: {key}"), result.stderr


def test_the_edge_with_its_port_taken_names_it(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = tmp_path / "edge.yaml"
        config.write_text(f"http: {{port: {port}}}\nauth: none\ntls: {{enabled: false}}\n")
        result = _run("edge", config)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "http" in result.stderr and f"127.0.0.1:{port} is in use" in result.stderr
