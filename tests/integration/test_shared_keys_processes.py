"""Two real ``iop edge`` processes on one PostgreSQL (``store.url``), over real HTTP: a 600 rpm
key across both, and a key revoked with ``iop keys --store-url`` refused by both within a second.

No control-plane runs: each request's body is not JSON, so an admitted request is a 400 right
after its key and limits were checked; a refused one is a 429.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from key_store_helpers import new_database
from worker.pg_server import PgServer, pg_server, required_binaries

IOP = [sys.executable, "-m", "iop_cli.main"]


@pytest.fixture(scope="module")
def postgres() -> Iterator[PgServer]:
    """A PostgreSQL server for this module."""
    with pg_server(required_binaries()) as server:
        yield server


def _keys(*args: str) -> str:
    done = subprocess.run([*IOP, "keys", *args], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


class _Edges:
    def __init__(self, root: Path, url: str, count: int = 2) -> None:
        self.popens: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []
        for index in range(count):
            config = root / f"edge{index}.yaml"
            settings = {"store": {"url": url}, "control_plane": {"address": "127.0.0.1:1"}, "http": {"port": 0}}
            config.write_text(yaml.safe_dump(settings))
            ready = root / f"edge{index}.ready"
            with (root / f"edge{index}.log").open("ab") as log:
                command = [*IOP, "edge", "--config", str(config), "--ready-file", str(ready)]
                self.popens.append(
                    subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
                )
            deadline = time.monotonic() + 30
            while not ready.exists():
                assert self.popens[-1].poll() is None, (root / f"edge{index}.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "edge not ready"
                time.sleep(0.02)
            self.ports.append(json.loads(ready.read_text())["port"])

    def stop(self) -> None:
        for popen in self.popens:
            popen.send_signal(signal.SIGTERM)
        for popen in self.popens:
            popen.wait(timeout=20)


@pytest.fixture
def edges(tmp_path: Path, postgres: PgServer) -> Iterator[tuple[_Edges, str]]:
    import asyncio

    url = asyncio.run(new_database(postgres))
    running = _Edges(tmp_path, url)
    try:
        yield running, url
    finally:
        running.stop()


def _post(connection: http.client.HTTPConnection, secret: str) -> tuple[int, str | None]:
    headers = {"authorization": f"Bearer {secret}", "content-type": "application/json"}
    connection.request("POST", "/v1/chat/completions", body=b"{", headers=headers)
    answer = connection.getresponse()
    answer.read()
    return answer.status, answer.getheader("retry-after")


def test_600_rpm_across_two_edge_processes(edges: tuple[_Edges, str]) -> None:
    running, url = edges
    secret = _keys("create", "alice", "--rpm", "600", "--store-url", url)
    time.sleep(1.0)  # both edges see the new key (they look every 0.5 s)

    def client(worker: int) -> list[tuple[int, str | None]]:
        connection = http.client.HTTPConnection("127.0.0.1", running.ports[worker % 2], timeout=30)
        try:
            return [_post(connection, secret) for _ in range(125)]
        finally:
            connection.close()

    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:  # 16 clients, 8 on each edge, 2,000 requests
        answers = [answer for answers in pool.map(client, range(16)) for answer in answers]
    took = time.monotonic() - started
    statuses = [status for status, _ in answers]
    accepted, refused = statuses.count(400), statuses.count(429)
    print(f"two edge processes: {accepted} of 2000 accepted, {refused} refused, in {took:.1f} s")
    assert accepted + refused == 2000
    assert 570 <= accepted <= 630
    assert all(retry is not None and 1 <= int(retry) <= 61 for status, retry in answers if status == 429)


def test_a_key_revoked_with_iop_keys_is_refused_by_both_edge_processes_within_a_second(
    edges: tuple[_Edges, str],
) -> None:
    running, url = edges
    secret = _keys("create", "bob", "--store-url", url)
    connections = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for port in running.ports]
    deadline = time.monotonic() + 2
    while any(_post(connection, secret)[0] != 400 for connection in connections):
        assert time.monotonic() < deadline, "a new key not served within 2 s"
        time.sleep(0.02)
    command = time.monotonic()
    _keys("revoke", "bob", "--store-url", url)
    revoked = time.monotonic()  # the command has committed, somewhere since it started
    try:
        while any(_post(connection, secret)[0] != 401 for connection in connections):
            assert time.monotonic() - revoked < 1.0, "a revoked key still served after 1 s"
            time.sleep(0.02)
    finally:
        for connection in connections:
            connection.close()
    done = time.monotonic()
    print(f"revoked key refused by both edges {done - revoked:.2f} s after iop keys returned")
    print(f"({done - command:.2f} s after it started)")
