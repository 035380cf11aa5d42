"""What a new user met with ``iop``: hints that work as typed, --version and --log-level, ``up`` on a
second start, ``runs`` from anywhere, ``down`` after a crash, ``node`` without a config, quiet
libraries. Each runs the real console script as a subprocess."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import Pki, assert_eventually

from iop_cli.shell import iop_command
from iop_node.domain import RunRecord, RunStatus
from iop_node.store import SqliteRunStore
from iop_wire.endpoint import Listener, dial
from iop_wire.tls import Role

IOP = [sys.executable, "-m", "iop_cli.main"]
SCRIPTS = Path(sysconfig.get_path("scripts"))
# A shell with nothing of this project on PATH, as after the Quickstart in a new terminal.
BARE = {
    **{k: v for k, v in os.environ.items() if k not in ("UV", "VIRTUAL_ENV", "IOP_STATE_DIR")},
    "PATH": "/usr/bin:/bin",
}


def _iop(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*IOP, *args], capture_output=True, text=True, timeout=90, check=False, cwd=cwd, env=env or BARE
    )


def _shell(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``command`` as a user types it."""
    return subprocess.run(
        ["/bin/sh", "-c", command], capture_output=True, text=True, timeout=90, check=False, cwd=cwd, env=env
    )


def _hint(output: str, label: str) -> str:
    return next(line.removeprefix(f"{label}: ") for line in output.splitlines() if line.startswith(f"{label}: "))


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """A state folder for ``iop up``; whatever runs there is stopped at the end."""
    folder = tmp_path / "state"
    yield folder
    _iop("down", "--dir", str(folder))


def _up(state: Path, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    result = _iop("up", "--dir", str(state), *args, cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


# --- hints that work as typed -------------------------------------------------------------------


def test_up_hints_run_as_typed_in_a_shell_without_iop_on_path(state: Path, tmp_path: Path) -> None:
    printed = _up(state, "--port", "0", cwd=tmp_path)
    stop, history = _hint(printed, "stop"), _hint(printed, "run history")
    assert not stop.startswith("iop ")  # not on this PATH
    assert str(SCRIPTS / "iop") in stop and f"--dir {state}" in stop
    listed = _shell(history, tmp_path, BARE)
    assert listed.returncode == 0, listed.stderr
    stopped = _shell(stop, tmp_path, BARE)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped" in stopped.stdout


def test_up_hints_say_iop_in_an_activated_environment(state: Path, tmp_path: Path) -> None:
    activated = {**BARE, "VIRTUAL_ENV": sys.prefix, "PATH": f"{SCRIPTS}:/usr/bin:/bin"}
    printed = _up(state, "--port", "0", cwd=tmp_path, env=activated)
    stop = _hint(printed, "stop")
    assert stop == f"iop down --dir {state}"
    stopped = _shell(stop, tmp_path, activated)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr


def test_hints_under_uv_run_go_back_through_uv(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # `uv run` puts .venv/bin first on PATH for its child only: `iop` there proves nothing.
    monkeypatch.setenv("PATH", f"{SCRIPTS}:/usr/bin:/bin")
    monkeypatch.setenv("VIRTUAL_ENV", sys.prefix)
    monkeypatch.setenv("UV", str(tmp_path / "pip-installed" / "uv"))  # uv itself is not on the user's PATH
    assert iop_command("down") == "python3 -m uv run iop down"
    own = tmp_path / "bin" / "uv"
    own.parent.mkdir()
    own.write_text("#!/bin/sh\n")
    own.chmod(0o755)
    monkeypatch.setenv("UV", str(own))
    monkeypatch.setenv("PATH", f"{SCRIPTS}:{own.parent}:/usr/bin:/bin")
    assert iop_command("runs", "ls", "--dir", "my state") == "uv run iop runs ls --dir 'my state'"


def test_hints_from_the_project_folder_name_the_script_relatively(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # just puts .venv/bin on PATH for its recipes only, without activating anything
    for name in ("UV", "VIRTUAL_ENV"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", f"{SCRIPTS}:/usr/bin:/bin")
    project = SCRIPTS.parent.parent
    monkeypatch.chdir(project)
    assert iop_command("down") == f"{(SCRIPTS / 'iop').relative_to(project)} down"


# --- --version, --log-level ----------------------------------------------------------------------


def test_version_both_ways() -> None:
    long, short = _iop("--version"), _iop("version")
    assert long.returncode == short.returncode == 0
    assert long.stdout == short.stdout
    assert long.stdout.startswith("iop ") and long.stdout.strip().split()[1][0].isdigit()


def _node_stderr(config: Path, before: list[str], after: list[str], tmp_path: Path) -> list[dict[str, object]]:
    """Start ``iop [before] node --config [after]``, wait until ready, stop it; its log events."""
    ready = tmp_path / "node.ready"
    with subprocess.Popen(
        [*IOP, *before, "node", "--config", str(config), "--ready-file", str(ready), *after],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as node:
        deadline = time.monotonic() + 30
        while not ready.exists() and node.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        node.send_signal(signal.SIGTERM)
        _, stderr = node.communicate(timeout=30)
    assert node.returncode == 0, stderr
    return [json.loads(line) for line in stderr.splitlines()]


def _plain_config(tmp_path: Path, **extra: object) -> Path:
    config = tmp_path / "node.yaml"
    data = {
        "listen": {"port": 0},
        "store_path": str(tmp_path / "runs.db"),
        "routes": [{"model": "m", "adapter": "mock"}],
    }
    config.write_text(yaml.safe_dump({**data, **extra}))
    return config


def test_log_level_before_or_after_the_command_overrides_the_config(tmp_path: Path) -> None:
    config = _plain_config(tmp_path, log_level="info")
    quiet = _node_stderr(config, ["--log-level", "warning"], [], tmp_path)
    assert quiet == []  # "node started" and "node stopped" are info
    chatty = _node_stderr(_plain_config(tmp_path, log_level="error"), [], ["--log-level", "info"], tmp_path)
    assert {event["event"] for event in chatty} >= {"node started", "node stopped"}


def test_up_passes_log_level_to_the_node(state: Path) -> None:
    _up(state, "--port", "0", "--log-level", "warning")
    assert _iop("down", "--dir", str(state)).returncode == 0
    assert "node started" not in (state / "node.log").read_text()
    _up(state, "--port", "0")
    assert "node started" in (state / "node.log").read_text()


# --- iop up a second time: --port, node.log, metrics ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_up_port_changes_an_existing_config_or_refuses_while_running(state: Path) -> None:
    _up(state, "--port", "0")
    (state / "edge.yaml").write_text((state / "edge.yaml").read_text() + "# my notes\n")
    port = _free_port()
    running = _iop("up", "--dir", str(state), "--port", str(port))
    assert running.returncode == 2
    assert running.stderr.count("\n") == 1 and "running" in running.stderr and str(port) in running.stderr
    assert _iop("down", "--dir", str(state)).returncode == 0
    printed = _up(state, "--port", str(port))
    assert f"http.port 0 -> {port}" in printed
    assert f"base URL: http://127.0.0.1:{port}/v1" in printed
    config = (state / "edge.yaml").read_text()
    assert yaml.safe_load(config)["http"]["port"] == port
    assert config.endswith("# my notes\n")  # the rest of the file as the user left it


def test_node_log_of_the_previous_start_is_kept(state: Path) -> None:
    _up(state, "--port", "0")
    assert _iop("down", "--dir", str(state)).returncode == 0
    _up(state, "--port", "0")
    previous, current = (state / "node.log.1").read_text(), (state / "node.log").read_text()
    assert '"node stopped"' in previous
    assert current.count('"node started"') == 1 and '"node stopped"' not in current


def test_generated_config_serves_metrics_and_up_says_where(state: Path) -> None:
    printed = _up(state, "--port", "0")
    urls = dict(re.findall(r"^(control-plane|node|edge) .*metrics (http://127\.0\.0\.1:\d+/metrics)$", printed, re.M))
    assert set(urls) == {"control-plane", "node", "edge"}, printed
    for service, metric in (
        ("control-plane", "iop_control_plane_nodes"),
        ("node", "iop_node_runs_in_flight"),
        ("edge", "iop_edge_requests_in_flight"),
    ):
        with urllib.request.urlopen(urls[service], timeout=10) as answer:  # noqa: S310 - our own service on loopback
            assert metric in answer.read().decode(), service
    assert yaml.safe_load((state / "node.yaml").read_text())["metrics"]["host"] == "127.0.0.1"


# --- iop runs --------------------------------------------------------------------------------------


def test_runs_from_another_folder_says_which_file_and_how_to_point_at_it(tmp_path: Path) -> None:
    result = _iop("runs", "ls", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "no run history at .iop/node-runs.db" in result.stderr
    for way in ("--db", "--config", "--dir", "IOP_STATE_DIR"):
        assert way in result.stderr
    assert "Errno" not in result.stderr


def test_runs_finds_the_state_folder_by_dir_or_environment(state: Path, tmp_path: Path) -> None:
    _up(state, "--port", "0")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert _iop("runs", "ls", "--dir", str(state), cwd=elsewhere).returncode == 0
    by_environment = _iop("runs", "ls", cwd=elsewhere, env={**BARE, "IOP_STATE_DIR": str(state)})
    assert by_environment.returncode == 0, by_environment.stderr


def _history(path: Path, count: int) -> None:
    async def write() -> None:
        store = SqliteRunStore(path, node_id="node-h")
        await store.open()
        start = datetime.datetime(2026, 5, 1, 12, 0, tzinfo=datetime.UTC)
        for index in range(count):
            received = start + datetime.timedelta(seconds=index)
            await store.record_end(
                RunRecord(
                    run_id=f"run-{index}",
                    node_id="node-h",
                    model="m",
                    status=RunStatus.COMPLETED,
                    received_at=received,
                    started_at=received,
                    first_token_at=received + datetime.timedelta(milliseconds=12),
                    finished_at=received + datetime.timedelta(milliseconds=250),
                )
            )
        await store.aclose()

    asyncio.run(write())


def test_runs_ls_says_when_the_limit_cut_the_list(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    _history(db, 3)
    cut = _iop("runs", "ls", "--db", str(db), "--limit", "2")
    assert cut.returncode == 0
    assert [line.split()[0] for line in cut.stdout.splitlines()[1:]] == ["run-2", "run-1"]
    assert cut.stderr == "iop runs: showing the newest 2 runs; more match (--limit N shows more)\n"
    whole = _iop("runs", "ls", "--db", str(db), "--limit", "3")
    assert whole.returncode == 0 and whole.stderr == ""


def test_runs_json(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    _history(db, 2)
    listed = _iop("runs", "ls", "--db", str(db), "--json")
    assert listed.returncode == 0
    runs = json.loads(listed.stdout)
    assert [run["run_id"] for run in runs] == ["run-1", "run-0"]
    assert runs[0]["status"] == "completed"
    assert runs[0]["received_at"] == "2026-05-01T12:00:01+00:00"
    assert (runs[0]["ttft_ms"], runs[0]["duration_ms"]) == (12.0, 250.0)
    shown = _iop("runs", "show", "run-0", "--db", str(db), "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["run_id"] == "run-0"


def test_runs_ls_columns_carry_their_units(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    _history(db, 1)
    header = _iop("runs", "ls", "--db", str(db)).stdout.splitlines()[0]
    assert "TTFT (ms)" in header and "DURATION (ms)" in header


# --- iop down after a crash ------------------------------------------------------------------------


def test_down_after_a_crash_says_the_node_was_not_running(state: Path) -> None:
    _up(state, "--port", "0")
    os.kill(int((state / "supervise.pid").read_text()), signal.SIGKILL)  # no supervisor left to restart it
    pid = int((state / "node.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # gone, or a zombie nobody reaped (containers without an init)
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().rpartition(")")[2].split()[0] in ("Z", "X"):
            break
        time.sleep(0.05)
    result = _iop("down", "--dir", str(state))
    assert result.returncode == 0
    assert f"node (pid {pid}) was not running" in result.stdout
    assert "stale" in result.stdout and f"node (pid {pid}) stopped" not in result.stdout
    assert not (state / "node.pid").exists()


# --- iop node --dev ------------------------------------------------------------------------------


async def test_node_dev_runs_a_mock_model_without_tls_and_says_so(tmp_path: Path) -> None:
    ready = tmp_path / "node.ready"
    env = {**BARE, "IOP_LISTEN__PORT": "0", "IOP_STORE_PATH": str(tmp_path / "runs.db")}
    node = await asyncio.create_subprocess_exec(
        *IOP, "node", "--dev", "--ready-file", str(ready), cwd=tmp_path, env=env, stderr=subprocess.PIPE
    )
    try:
        await assert_eventually(lambda: ready.exists() or node.returncode is not None, timeout=30)
        connection = await dial("127.0.0.1", json.loads(ready.read_text())["port"])  # no certificate at all
        capabilities = await connection.capabilities()
        await connection.close()
        assert [model.name for adapter in capabilities.adapters for model in adapter.models] == ["mock-small"]
    finally:
        node.send_signal(signal.SIGTERM)
        _, stderr = await node.communicate()
    warning = json.loads(stderr.decode().splitlines()[0])
    assert warning["level"] == "warning" and "development node" in str(warning["event"])
    assert str(warning["tls"]).startswith("OFF")


def test_node_dev_and_config_exclude_each_other(tmp_path: Path) -> None:
    result = _iop("node", "--dev", "--config", str(_plain_config(tmp_path)))
    assert result.returncode == 2 and "not allowed with" in result.stderr


# --- the wire library is quiet until the application configures logging ----------------------------

_CLIENT = """
import asyncio, sys
from pathlib import Path
from iop_wire.endpoint import dial
from iop_wire.tls import TlsConfig

async def main(port: int, certs: Path, configure: bool) -> None:
    if configure:
        from iop_wire.logs import configure as setup
        setup("info")
    tls = TlsConfig(enabled=True, cert=certs / "c-edge.crt", key=certs / "c-edge.key", ca=certs / "ca.crt")
    connection = await dial("127.0.0.1", port, tls=tls, server_hostname="localhost")
    await connection.capabilities()
    await connection.close("client done")
    print("client output")

asyncio.run(main(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "configure"))
"""


@pytest.mark.parametrize("configured", [False, True], ids=["library-default", "configured"])
async def test_wire_logs_nothing_to_stdout(pki: Pki, server: Listener, tmp_path: Path, configured: bool) -> None:
    pki.config("c", Role.EDGE)
    script = tmp_path / "client.py"
    script.write_text(_CLIENT)
    client = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        str(server.port),
        str(pki.directory),
        "configure" if configured else "plain",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = await client.communicate()
    assert client.returncode == 0, stderr.decode()
    assert stdout.decode() == "client output\n"
    if configured:  # the application asked for JSON logs on stderr: the wire's info lines are there
        events = [json.loads(line)["event"] for line in stderr.decode().splitlines()]
        assert "connection closed" in events
    else:
        assert stderr.decode() == ""
