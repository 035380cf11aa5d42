"""``iop up`` / ``down`` / ``status`` / ``chat`` / ``models``: the whole platform as real processes.

One platform (control-plane, node, worker, edge over mTLS) is started for the module and shared by the
tests that only use it; the tests that start their own stop it before they end.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import yaml
from conftest import process_alive

IOP = [sys.executable, "-m", "iop_cli.main"]
SERVICES = ("control-plane", "node", "worker", "edge")
# No state folder or key from the environment: each test names its own folder.
ENV = {k: v for k, v in os.environ.items() if k not in ("IOP_STATE_DIR", "IOP_API_KEY")}


def _iop(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*IOP, *args], capture_output=True, text=True, timeout=timeout, check=False, env=ENV, input=stdin
    )


def _printed(output: str, label: str) -> str:
    return next(line.removeprefix(f"{label}: ") for line in output.splitlines() if line.startswith(f"{label}: "))


def _pids(state: Path) -> dict[str, int]:
    return {name: int((state / f"{name}.pid").read_text()) for name in SERVICES if (state / f"{name}.pid").exists()}


def _wait_gone(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if process_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """A state folder; whatever a failed test left running there is stopped."""
    folder = tmp_path / "state"
    yield folder
    if _pids(folder):
        _iop("down", "--dir", str(folder))


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A running platform: its state folder and what ``iop up`` printed."""
    state = tmp_path_factory.mktemp("up") / "state"
    started = _iop("up", "--dir", str(state), "--port", "0")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield state, started.stdout
    finally:
        _iop("down", "--dir", str(state))


def test_up_prints_the_base_url_the_key_and_an_sdk_example(platform: tuple[Path, str]) -> None:
    state, printed = platform
    base, key = _printed(printed, "base URL"), _printed(printed, "API key")
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", base)
    assert _printed(printed, "console") == base.removesuffix("/v1") + "/console"
    assert key.startswith("sk-") and key == (state / "api-key").read_text().strip()
    assert (state / "api-key").stat().st_mode & 0o777 == 0o600
    assert "from openai import OpenAI" in printed
    assert f'client = OpenAI(base_url="{base}", api_key="{key}")' in printed
    metrics = re.findall(r"metrics (http://127\.0\.0\.1:\d+/metrics)", printed)
    assert len(metrics) == 4  # on in every generated config
    for url, family in zip(metrics, ("iop_control_plane_", "iop_node_", "iop_worker_", "iop_edge_"), strict=True):
        with urllib.request.urlopen(url, timeout=10) as answer:  # noqa: S310 - our own services on loopback
            assert family in answer.read().decode(), url


def _console_post(url: str, key: str) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url, data=b"{}", method="POST", headers={"authorization": f"Bearer {key}"})  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=20) as answer:  # noqa: S310 - our own edge on loopback
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_console_drains_a_node_with_the_admin_certificate_up_wrote(platform: tuple[Path, str]) -> None:
    state, printed = platform
    console, key = _printed(printed, "console"), _printed(printed, "API key")
    edge = yaml.safe_load((state / "edge.yaml").read_text())
    assert edge["console"]["admin_cert"] == str((state / "certs" / "admin.crt").resolve())
    request = urllib.request.Request(console + "/api/me", headers={"authorization": f"Bearer {key}"})  # noqa: S310
    with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - our own edge on loopback
        assert json.loads(answer.read())["admin"] is True  # up's key is an admin key
    node = yaml.safe_load((state / "node.yaml").read_text())["node_id"]
    try:
        status, body = _console_post(f"{console}/api/nodes/{node}/drain", key)
        assert status == 200 and "drain" in str(body["message"]), body
    finally:
        status, body = _console_post(f"{console}/api/nodes/{node}/undrain", key)
    assert status == 200, body


def test_the_official_openai_sdk_gets_an_answer(platform: tuple[Path, str]) -> None:
    from openai import OpenAI

    _, printed = platform
    client = OpenAI(base_url=_printed(printed, "base URL"), api_key=_printed(printed, "API key"), max_retries=0)
    answer = client.chat.completions.create(model="mock-small", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content
    client.close()


def test_a_batch_runs_through_the_worker_up_started(platform: tuple[Path, str]) -> None:
    from openai import OpenAI

    state, printed = platform
    client = OpenAI(base_url=_printed(printed, "base URL"), api_key=_printed(printed, "API key"), max_retries=0)
    body = {"model": "mock-small", "messages": [{"role": "user", "content": "hi"}]}
    lines = "".join(
        json.dumps({"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
        for n in range(5)
    )
    uploaded = client.files.create(file=("five.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 30
    while batch.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None and batch.request_counts.completed == 5
    assert batch.output_file_id is not None
    answers = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(answer["custom_id"] for answer in answers) == [f"line-{n}" for n in range(5)]
    assert all(answer["response"]["status_code"] == 200 for answer in answers)
    client.close()
    assert yaml.safe_load((state / "edge.yaml").read_text())["worker"] == {
        "address": f"127.0.0.1:{json.loads((state / 'worker.ready').read_text())['port']}",
        "server_name": "localhost",
    }


def test_status_lists_four_healthy_services(platform: tuple[Path, str]) -> None:
    state, _ = platform
    table = _iop("status", "--dir", str(state))
    assert table.returncode == 0, table.stdout + table.stderr
    assert table.stdout.splitlines()[0].split() == ["SERVICE", "PID", "ADDRESS", "HEALTH", "RESTARTS", "LAST", "EXIT"]
    as_json = _iop("status", "--dir", str(state), "--json")
    rows = json.loads(as_json.stdout)
    assert [row["service"] for row in rows] == list(SERVICES)
    assert all(row["up"] for row in rows), rows
    assert {row["service"]: row["pid"] for row in rows} == _pids(state)
    worker = next(row for row in rows if row["service"] == "worker")
    assert worker["health"] == "ok" and re.fullmatch(r"127\.0\.0\.1:\d+", worker["address"]), worker


def test_chat_streams_an_answer_to_a_prompt_or_to_stdin(platform: tuple[Path, str]) -> None:
    state, _ = platform
    said = _iop("chat", "--dir", str(state), "hello")
    assert said.returncode == 0, said.stderr
    assert said.stdout.strip()
    piped = _iop("chat", "--dir", str(state), "--model", "mock-fast", stdin="hi\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.strip()


def test_chat_on_a_terminal_keeps_a_conversation_until_ctrl_d(platform: tuple[Path, str]) -> None:
    state, _ = platform
    controller, terminal = os.openpty()
    try:
        # The terminal's line discipline hands over one line per read, and ^D at a line's start as EOF.
        os.write(controller, b"hello\nand then?\n\x04")
        talked = subprocess.run(
            [*IOP, "chat", "--dir", str(state), "--model", "mock-small"],
            stdin=terminal,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env=ENV,
        )
    finally:
        os.close(controller)
        os.close(terminal)
    assert talked.returncode == 0, talked.stderr
    turns = talked.stdout.split("> ")
    assert len(turns) == 4 and all(turn.strip() for turn in turns[1:3]), talked.stdout


def test_chat_errors_are_one_line(platform: tuple[Path, str], tmp_path: Path) -> None:
    state, _ = platform
    unknown = _iop("chat", "--dir", str(state), "--model", "no-such-model", "hi")
    assert unknown.returncode == 1
    assert unknown.stderr.count("\n") == 1 and unknown.stderr.startswith("iop chat: ") and "(HTTP 4" in unknown.stderr
    nowhere = _iop("chat", "--dir", str(tmp_path), "hi")
    assert nowhere.returncode == 2
    assert nowhere.stderr.count("\n") == 1 and "iop up" in nowhere.stderr


def test_models_lists_what_the_platform_serves(platform: tuple[Path, str]) -> None:
    state, _ = platform
    listed = _iop("models", "--dir", str(state))
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert rows[0] == ["MODEL", "MAX-CONCURRENCY", "STATE"]
    shown = {row[0]: row[1:] for row in rows[1:]}
    assert shown["mock-small"] == ["4", "-"] and shown["mock-fast"] == ["64", "-"]  # node.yaml's routes; not served
    as_json = json.loads(_iop("models", "--dir", str(state), "--json").stdout)
    mock_small = {model["id"]: model for model in as_json}["mock-small"]
    assert mock_small["max_concurrency"] == 4 and mock_small["state"] is None and mock_small["served"] is None


def test_admin_commands_find_the_control_plane_up_started(platform: tuple[Path, str]) -> None:
    """``iop nodes ls --dir`` dials the port this folder's control-plane listens on, 7400 or not."""
    state, _ = platform
    env = {k: v for k, v in ENV.items() if k != "IOP_CONTROL_PLANE"}
    listed = subprocess.run(
        [*IOP, "nodes", "ls", "--dir", str(state), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert [node["node_id"] for node in json.loads(listed.stdout)] == ["local-node"]
    # A folder whose control-plane.ready names a port where nobody listens: that port is dialed, not 7400.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        empty = state.parent / "empty"
        empty.mkdir(exist_ok=True)
        (empty / "control-plane.ready").write_text(json.dumps({"pid": 1, "port": port}))
        refused = subprocess.run(
            [*IOP, "nodes", "ls", "--dir", str(empty), "--certs", str(state / "certs")],
            capture_output=True,
            check=False,
            text=True,
            timeout=60,
            env=env,
        )
    assert refused.returncode == 2 and f"127.0.0.1:{port}" in refused.stderr, refused.stderr


def test_a_second_up_says_it_runs_and_changes_nothing(platform: tuple[Path, str]) -> None:
    state, printed = platform
    before = {path.name: path.stat().st_mtime_ns for path in state.iterdir() if path.suffix in (".yaml", ".pid")}
    again = _iop("up", "--dir", str(state))
    assert again.returncode == 0, again.stderr
    assert "already running" in again.stdout
    assert _printed(again.stdout, "base URL") == _printed(printed, "base URL")
    after = {path.name: path.stat().st_mtime_ns for path in state.iterdir() if path.suffix in (".yaml", ".pid")}
    assert after == before


def test_model_on_a_running_platform_is_one_line_and_changes_nothing(
    platform: tuple[Path, str], tmp_path: Path
) -> None:
    state, _ = platform
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    before = (state / "node.yaml").read_text()
    refused = _iop("up", "--dir", str(state), "--model", str(model))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.startswith(f"iop up: the platform runs in {state} (") and refused.stderr.count("\n") == 1
    # the command as iop_command spells it here: 'iop down', '.venv/bin/iop down' or 'uv run iop down'
    assert re.search(r"--model applies when it starts: '[^']*iop down --dir \S+' first$", refused.stderr.strip())
    assert (state / "node.yaml").read_text() == before


def test_down_stops_every_process(state: Path) -> None:
    started = _iop("up", "--dir", str(state), "--port", "0")
    assert started.returncode == 0, started.stdout + started.stderr
    pids = _pids(state)
    assert set(pids) == set(SERVICES) and all(process_alive(pid) for pid in pids.values())
    stopped = _iop("down", "--dir", str(state))
    assert stopped.returncode == 0, stopped.stderr
    assert [line.split()[0] for line in stopped.stdout.splitlines()] == ["edge", "worker", "node", "control-plane"]
    assert _wait_gone(list(pids.values())) == []
    assert _pids(state) == {}
    assert _iop("status", "--dir", str(state)).returncode == 1


@pytest.mark.timeout(240)
def test_two_ups_of_two_folders_started_at_once_both_start(tmp_path: Path) -> None:
    """Both found the control-plane's 7400 (and the metrics ports) free and wrote them; the second
    to bind exited "in use". Now the second waits until the first's services listen, then chooses."""
    folders = [tmp_path / "one", tmp_path / "two"]
    results: dict[Path, subprocess.CompletedProcess[str]] = {}

    def up(folder: Path) -> None:
        results[folder] = _iop("up", "--dir", str(folder), "--port", "0", timeout=180)

    try:
        threads = [threading.Thread(target=up, args=(folder,)) for folder in folders]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for folder in folders:
            assert results[folder].returncode == 0, results[folder].stdout + results[folder].stderr
        ports = [yaml.safe_load((folder / "control-plane.yaml").read_text())["listen"]["port"] for folder in folders]
        assert ports[0] != ports[1]
    finally:
        for folder in folders:
            _iop("down", "--dir", str(folder))


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 - our own edge on loopback
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _status(state: Path) -> dict[str, dict[str, object]]:
    listed = _iop("status", "--dir", str(state), "--json")
    return {row["service"]: row for row in json.loads(listed.stdout)}


@pytest.mark.parametrize("killed", ["edge", "control-plane"])
def test_a_killed_service_is_restarted_and_down_stops_all(state: Path, killed: str) -> None:
    started = _iop("up", "--dir", str(state), "--port", "0")
    assert started.returncode == 0, started.stdout + started.stderr
    base, key = _printed(started.stdout, "base URL"), _printed(started.stdout, "API key")
    old = _pids(state)[killed]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    rows = _status(state)
    while time.monotonic() < deadline and not all(row["up"] for row in rows.values()):
        time.sleep(0.2)
        rows = _status(state)
    assert all(row["up"] for row in rows.values()), rows
    assert rows[killed]["pid"] != old and rows[killed]["restarts"] == 1, rows[killed]
    assert rows[killed]["last_exit"] == "signal 9 (SIGKILL)"
    assert "service exited" in (state / "supervise.log").read_text()
    ready = base.removesuffix("/v1") + "/ready"  # the edge serves a model again once it has reconnected
    while time.monotonic() < deadline and _http_status(ready) != 200:
        time.sleep(0.2)
    from openai import OpenAI  # the base URL up printed still answers: the edge kept its port

    with OpenAI(base_url=base, api_key=key, max_retries=2) as client:
        answer = client.chat.completions.create(model="mock-small", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content
    pids = [int((state / "supervise.pid").read_text()), *_pids(state).values()]
    assert _iop("down", "--dir", str(state)).returncode == 0
    assert _wait_gone(pids) == []
    assert _pids(state) == {} and not (state / "supervise.pid").exists()


def test_an_edge_port_in_use_is_one_line_naming_it(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        refused = _iop("up", "--dir", str(tmp_path / "state"), "--port", str(port))
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and str(port) in refused.stderr
    assert _pids(tmp_path / "state") == {}


def test_an_unreachable_backend_is_one_line_naming_it(tmp_path: Path) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}"
    refused = _iop("up", "--dir", str(tmp_path / "state"), "--port", "0", "--backend", url)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and url in refused.stderr
    assert _pids(tmp_path / "state") == {}


def test_foreground_prefixes_every_line_and_ctrl_c_stops_it_all(state: Path) -> None:
    command = [*IOP, "up", "--dir", str(state), "--port", "0", "--foreground"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV) as up:
        assert up.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not any(line.startswith("base URL: ") for line in lines):
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
        assert any(line.startswith("base URL: ") for line in lines), "".join(lines)
        assert {line.split(" | ")[0] for line in lines if " | " in line} >= {"control-plane", "node", "worker", "edge"}
        pids = _pids(state)
        assert set(pids) == set(SERVICES)
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=30)
    assert up.returncode == 0, rest
    assert _wait_gone(list(pids.values())) == []
    assert _pids(state) == {}


class _Backend(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server that lists two models and, like llama.cpp's, its slots (``answers``)."""

    answers: ClassVar[dict[str, object]] = {
        "/v1/models": {"object": "list", "data": [{"id": "tiny-a"}, {"id": "tiny-b"}]},
        "/api/tags": {"models": [{"name": "tiny-a"}, {"name": "tiny-b"}]},
        "/slots": [{"id": 0}, {"id": 1}, {"id": 2}],
    }

    def do_GET(self) -> None:
        body = json.dumps(self.answers.get(self.path, {})).encode()
        self.send_response(200 if self.path in self.answers else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # quiet: pytest turns stray output into noise
        pass


@contextlib.contextmanager
def _backend(answers: dict[str, object] | None = None) -> Iterator[str]:
    """A fake backend on 127.0.0.1 answering ``answers`` (default: ``_Backend.answers``); its URL."""
    handler = type("Handler", (_Backend,), {"answers": answers if answers is not None else _Backend.answers})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("scheme", "path", "adapter", "concurrency"), [("", "/v1", "vllm", 3), ("ollama:", "", "ollama", 4)]
)
def test_backend_serves_the_servers_models(
    tmp_path: Path, scheme: str, path: str, adapter: str, concurrency: int
) -> None:
    state = tmp_path / "state"
    with _backend() as url:
        try:
            started = _iop("up", "--dir", str(state), "--port", "0", "--backend", scheme + url + path)
            assert started.returncode == 0, started.stdout + started.stderr
            routes = yaml.safe_load((state / "node.yaml").read_text())["routes"]
            assert routes == [
                {"model": name, "adapter": adapter, "max_concurrency": concurrency, "options": {"base_url": url}}
                for name in ("tiny-a", "tiny-b")
            ]
            listed = _iop("models", "--dir", str(state)).stdout.splitlines()
            assert [line.split() for line in listed[1:]] == [
                ["tiny-a", str(concurrency), "-"],
                ["tiny-b", str(concurrency), "-"],
            ]
        finally:
            _iop("down", "--dir", str(state))


_LISTING = {"object": "list", "data": [{"id": "m", "owned_by": "someone"}]}


@pytest.mark.parametrize(
    ("answers", "concurrency"),
    [
        ({"/v1/models": _LISTING, "/props": {"total_slots": 6}}, 6),  # llama.cpp's server
        ({"/v1/models": _LISTING, "/slots": [{"id": 0}, {"id": 1}]}, 2),  # llama.cpp's, /props not served
        ({"/v1/models": {"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]}}, 256),  # vLLM
        ({"/v1/models": _LISTING, "/props": {"total_slots": "many"}, "/slots": {}}, 64),  # says nothing usable
    ],
)
def test_backend_routes_take_the_concurrency_the_server_says(answers: dict[str, object], concurrency: int) -> None:
    from iop_cli.configs import backend_routes

    with _backend(answers) as url:
        assert [route["max_concurrency"] for route in backend_routes(url)] == [concurrency]


def test_foreground_stops_the_others_when_one_exits(state: Path) -> None:
    command = [*IOP, "up", "--dir", str(state), "--port", "0", "--foreground"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV) as up:
        assert up.stdout is not None
        for line in up.stdout:
            if line.startswith("base URL: "):
                break
        pids = _pids(state)
        os.kill(pids["node"], signal.SIGKILL)
        rest, _ = up.communicate(timeout=30)
    assert up.returncode == 1, rest
    assert "node exited" in rest
    assert _wait_gone(list(pids.values())) == []


def test_a_node_config_of_an_older_up_is_named_not_started(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "node.yaml").write_text("node_id: mine\nlisten: {port: 7401}\n")
    refused = _iop("up", "--dir", str(state), "--port", "0")
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "node.yaml has no control_plane.address" in refused.stderr
    assert (state / "node.yaml").read_text() == "node_id: mine\nlisten: {port: 7401}\n"
    assert _pids(state) == {}


def test_an_edge_config_of_an_older_up_gets_the_worker_and_console_appended(state: Path) -> None:
    started = _iop("up", "--dir", str(state), "--port", "0")
    assert started.returncode == 0, started.stdout + started.stderr
    assert _iop("down", "--dir", str(state)).returncode == 0
    edge = state / "edge.yaml"
    older = {key: value for key, value in yaml.safe_load(edge.read_text()).items() if key not in ("worker", "console")}
    edge.write_text(yaml.safe_dump(older, sort_keys=False) + "# my notes\n")
    again = _iop("up", "--dir", str(state), "--port", "0")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{edge}: added worker" in again.stdout
    config = yaml.safe_load(edge.read_text())
    assert config["worker"]["address"] == f"127.0.0.1:{json.loads((state / 'worker.ready').read_text())['port']}"
    assert f"{edge}: added console" in again.stdout
    assert config["console"]["admin_cert"] == str((state / "certs" / "admin.crt").resolve())
    assert "# my notes\n" in edge.read_text()
    assert _iop("status", "--dir", str(state)).returncode == 0
