"""``iop node`` that cannot start: exit code 2 and one line on stderr naming the setting, its line and the cause."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Pki
from cryptography.hazmat.primitives import serialization
from node_helpers import node_settings

from iop_node.adapters.mock import MockAdapter, MockOptions
from iop_node.bootstrap import build_node
from iop_node.settings import StartError
from iop_node.store import SqliteRunStore
from iop_wire.tls import Role

IOP = [sys.executable, "-m", "iop_cli.main"]

# Written by hand so that every key's line is known: listen.host is on line 3, listen.port on 4, ...
_TEMPLATE = """\
node_id: node-s
listen:
  host: {host}
  port: {port}
tls:
  enabled: true
  cert: {cert}
  key: {key}
  ca: {ca}
store_path: {store_path}
metrics:
  host: 127.0.0.1
  port: {metrics_port}
routes:
  - model: mock-small
    adapter: {adapter}
    max_concurrency: {max_concurrency}
"""


def _write_config(pki: Pki, tmp_path: Path, extra: str = "", **values: Any) -> Path:
    tls = pki.config("node-s", Role.NODE)
    defaults = {
        "host": "127.0.0.1",
        "port": 0,
        "cert": tls.cert,
        "key": tls.key,
        "ca": tls.ca,
        "store_path": tmp_path / "runs.db",
        "metrics_port": 0,
        "adapter": "mock",
        "max_concurrency": 4,
    }
    path = tmp_path / "node.yaml"
    path.write_text(_TEMPLATE.format(**{**defaults, **values}) + extra)
    return path


def _start(config: Path, *, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run ``iop node --config``; it must refuse to start: exit code 2, one line on stderr (returned)."""
    result = subprocess.run(
        [*IOP, "node", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert result.stdout == ""
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_listen_port_in_use(pki: Pki, tmp_path: Path, busy_port: int) -> None:
    line = _start(_write_config(pki, tmp_path, port=busy_port))
    assert line == f"iop node: listen.port (line 4): 127.0.0.1:{busy_port} is in use"


def test_metrics_port_in_use(pki: Pki, tmp_path: Path, busy_port: int) -> None:
    line = _start(_write_config(pki, tmp_path, metrics_port=busy_port))
    assert line == f"iop node: metrics.port (line 13): 127.0.0.1:{busy_port} is in use"


def test_unresolvable_listen_host(pki: Pki, tmp_path: Path) -> None:
    line = _start(_write_config(pki, tmp_path, host="no-such-host.invalid"))
    assert line.startswith("iop node: listen.host (line 3): cannot resolve 'no-such-host.invalid'")


def test_listen_host_not_on_this_machine(pki: Pki, tmp_path: Path) -> None:
    line = _start(_write_config(pki, tmp_path, host="192.0.2.1"))  # TEST-NET-1: nobody's address
    assert line == "iop node: listen.host (line 3): 192.0.2.1 is not an address of this machine"


def test_key_that_is_not_pem(pki: Pki, tmp_path: Path) -> None:
    (tmp_path / "junk.key").write_text("not a key\n")
    line = _start(_write_config(pki, tmp_path, key=tmp_path / "junk.key"))
    assert line == f"iop node: bad config: tls.key (line 8): {tmp_path / 'junk.key'} is not a PEM private key"


def test_encrypted_key(pki: Pki, tmp_path: Path) -> None:
    tls = pki.config("node-s", Role.NODE)
    assert tls.key is not None
    key = serialization.load_pem_private_key(tls.key.read_bytes(), password=None)
    locked = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    (tmp_path / "locked.key").write_bytes(locked)
    line = _start(_write_config(pki, tmp_path, key=tmp_path / "locked.key"))
    assert re.fullmatch(r"iop node: bad config: tls\.key \(line 8\): .*locked\.key is encrypted; .*", line), line


def test_certificate_that_is_not_pem(pki: Pki, tmp_path: Path) -> None:
    (tmp_path / "junk.crt").write_text("-----BEGIN CERTIFICATE-----\nbroken\n-----END CERTIFICATE-----\n")
    line = _start(_write_config(pki, tmp_path, cert=tmp_path / "junk.crt"))
    assert line == f"iop node: bad config: tls.cert (line 7): {tmp_path / 'junk.crt'} holds no PEM certificate"


def test_certificate_and_key_that_do_not_match(pki: Pki, tmp_path: Path) -> None:
    other = pki.config("someone-else", Role.EDGE)
    line = _start(_write_config(pki, tmp_path, key=other.key))
    assert line.startswith(f"iop node: bad config: tls.key (line 8): {other.key} does not belong to the certificate")


def test_bad_ca_file(pki: Pki, tmp_path: Path) -> None:
    (tmp_path / "bad-ca.crt").write_text("garbage\n")
    line = _start(_write_config(pki, tmp_path, ca=tmp_path / "bad-ca.crt"))
    assert line == f"iop node: bad config: tls.ca (line 9): {tmp_path / 'bad-ca.crt'} holds no PEM certificate"


def test_missing_tls_files_are_all_named(pki: Pki, tmp_path: Path) -> None:
    line = _start(_write_config(pki, tmp_path, cert=tmp_path / "no.crt", ca=tmp_path / "no-ca.crt"))
    assert line == (
        f"iop node: bad config: tls.cert (line 7): no such file {tmp_path / 'no.crt'}; "
        f"tls.ca (line 9): no such file {tmp_path / 'no-ca.crt'}"
    )


def test_corrupt_history(pki: Pki, tmp_path: Path) -> None:
    (tmp_path / "runs.db").write_bytes(b"this is not SQLite" * 512)
    line = _start(_write_config(pki, tmp_path))
    assert line == f"iop node: store_path (line 10): cannot open the run history {tmp_path / 'runs.db'}: " + (
        "file is not a database"
    )


@pytest.mark.slow
def test_locked_history(pki: Pki, tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("CREATE TABLE held (x)")
        holder.execute("BEGIN EXCLUSIVE")  # what another process writing a long transaction does
        line = _start(_write_config(pki, tmp_path))  # after SQLite's busy timeout (5 s)
    finally:
        holder.close()
    assert line == f"iop node: store_path (line 10): cannot open the run history {db}: database is locked"


def test_history_under_a_file(pki: Pki, tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("a file, not a folder\n")
    line = _start(_write_config(pki, tmp_path, store_path=tmp_path / "plain" / "runs.db"))
    assert line == (
        f"iop node: store_path (line 10): cannot open the run history {tmp_path}/plain/runs.db: "
        f"{tmp_path}/plain is a file, not a folder"
    )


def test_history_path_is_a_folder(pki: Pki, tmp_path: Path) -> None:
    line = _start(_write_config(pki, tmp_path, store_path=tmp_path))
    assert line == (
        f"iop node: store_path (line 10): cannot open the run history {tmp_path}: it is a folder; name a file in it"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_history_in_a_read_only_folder(pki: Pki, tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    try:
        line = _start(_write_config(pki, tmp_path, store_path=folder / "runs.db"))
    finally:
        folder.chmod(0o700)
    assert line == (
        f"iop node: store_path (line 10): cannot open the run history {folder / 'runs.db'}: "
        f"cannot create files in {folder} (permission denied)"
    )


def test_control_plane_address_without_port(pki: Pki, tmp_path: Path) -> None:
    config = _write_config(pki, tmp_path, extra="control_plane:\n  address: cp.internal\n")
    line = _start(config)
    assert line == (
        "iop node: bad config: control_plane.address (line 19): 'cp.internal' has no port: "
        "write host:port, for example cp.internal:7400"
    )


def test_every_config_problem_is_listed_with_its_line(pki: Pki, tmp_path: Path) -> None:
    config = _write_config(pki, tmp_path, port="eighty", metrics_port=-1, max_concurrency=0)
    line = _start(config)
    assert line.startswith("iop node: bad config: ")
    problems = line.removeprefix("iop node: bad config: ").split("; ")
    assert [problem.split(":")[0] for problem in problems] == [
        "listen.port (line 4)",
        "metrics.port (line 13)",
        "routes.0.max_concurrency (line 17)",
    ]
    assert "more" not in line


def test_every_bad_route_is_listed(pki: Pki, tmp_path: Path) -> None:
    config = _write_config(
        pki, tmp_path, adapter="warp", extra="  - model: summarize\n    adapter: cli\n    options: {}\n"
    )
    line = _start(config)
    assert line == (
        "iop node: bad config: routes.0.adapter (line 16): unknown adapter 'warp' (known: cli, mock, ollama, vllm); "
        "routes.1.options.argv (line 20): Field required"
    )


def test_a_key_set_by_the_environment_gets_no_line(pki: Pki, tmp_path: Path) -> None:
    line = _start(_write_config(pki, tmp_path), env={"IOP_LISTEN__PORT": "-5"})
    assert line.startswith("iop node: bad config: listen.port: Input should be greater than or equal to 0")


def test_yaml_syntax_error_names_the_line(pki: Pki, tmp_path: Path) -> None:
    config = _write_config(pki, tmp_path)
    config.write_text(config.read_text() + "heartbeat_interval: [1\n")
    line = _start(config)
    assert re.match(rf"iop node: bad config: config file {re.escape(str(config))}: not valid YAML at line \d+ ", line)


def test_node_without_config_refuses_and_names_dev(tmp_path: Path) -> None:
    result = subprocess.run([*IOP, "node"], capture_output=True, text=True, timeout=30, check=False, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "no --config given" in result.stderr and "--dev" in result.stderr
    assert not (tmp_path / ".iop").exists()  # refused before creating anything


def test_relative_paths_are_taken_from_the_config_files_folder(pki: Pki, tmp_path: Path) -> None:
    tls = pki.config("node-s", Role.NODE)
    assert tls.cert and tls.key and tls.ca
    folder = tmp_path / "etc"
    folder.mkdir()
    for path in (tls.cert, tls.key, tls.ca):
        path.rename(folder / path.name)
    backend = (
        f"  - model: remote\n    adapter: vllm\n    options: {{base_url: 'https://127.0.0.1:9', ca: {tls.ca.name}}}\n"
    )
    config = _write_config(
        pki, folder, backend, cert=tls.cert.name, key=tls.key.name, ca=tls.ca.name, store_path="history/runs.db"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ready = tmp_path / "node.ready"
    with subprocess.Popen(
        [*IOP, "node", "--config", str(config), "--ready-file", str(ready)],
        cwd=elsewhere,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as node:
        try:
            deadline = time.monotonic() + 30
            while not ready.exists() and node.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ready.exists(), node.stderr.read() if node.stderr else ""
            assert json.loads(ready.read_text())["pid"] == node.pid
        finally:
            node.send_signal(signal.SIGTERM)
            assert node.wait(timeout=30) == 0
    assert (folder / "history" / "runs.db").is_file()
    assert not (elsewhere / "history").exists()
    assert not ready.exists()  # removed when the node stopped


# --- the composition root closes what it opened ----------------------------------------------------


class _RecordingMock(MockAdapter):
    """The mock adapter, noting when it is closed."""

    closed = 0

    async def aclose(self) -> None:
        type(self).closed += 1
        await super().aclose()


async def test_a_part_that_cannot_start_closes_the_parts_before_it(pki: Pki, tmp_path: Path, busy_port: int) -> None:
    _RecordingMock.closed = 0
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    routes = [{"model": "m", "adapter": "mock"}]
    settings = node_settings(pki, tmp_path, routes, listen={"port": port}, metrics={"port": busy_port})
    app = build_node(settings, adapters={"mock": _RecordingMock({"m": MockOptions()})})
    with pytest.raises(StartError, match=rf"^metrics\.port: 127\.0\.0\.1:{busy_port} is in use$"):
        await app.start()  # the metrics server starts after the listener
    assert app.listener is not None
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    assert _RecordingMock.closed == 1
    reopened = SqliteRunStore(settings.store_path, "node-t")  # the history was closed: it opens again
    await reopened.open()
    await reopened.aclose()


async def test_stop_closes_every_part_once(pki: Pki, tmp_path: Path) -> None:
    _RecordingMock.closed = 0
    settings = node_settings(pki, tmp_path, [{"model": "m", "adapter": "mock"}], metrics={"port": 0})
    async with build_node(settings, adapters={"mock": _RecordingMock({"m": MockOptions()})}) as app:
        assert app.listener is not None and app.metrics_port is not None
        port, metrics_port = app.listener.port, app.metrics_port
    for closed_port in (port, metrics_port):
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", closed_port)
    await app.stop()  # a second stop finds nothing left to close
    assert _RecordingMock.closed == 1
