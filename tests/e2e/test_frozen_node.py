"""A node that freezes is out in seconds, with every default (issue 18, item 2).

``iop up`` as a user runs it (its configs set no heartbeat, so every default applies); the node
process is stopped with SIGSTOP in the middle of a stream. Within 5 s the stream ends with a
node_lost error event, and a request sent 5 s after the freeze is not placed on the frozen node
(it is answered at once, 503: no node left), where before both hung for 60-90 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

IOP = [sys.executable, "-m", "iop_cli.main"]
ENV = {k: v for k, v in os.environ.items() if k not in ("IOP_STATE_DIR", "IOP_API_KEY")}
CHAT = {"model": "mock-small", "messages": [{"role": "user", "content": "tell me"}], "stream": True}


def _iop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*IOP, *args], capture_output=True, text=True, timeout=90, check=False, env=ENV)


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[tuple[Path, httpx.Client]]:
    """``iop up`` with its defaults: the state folder and an HTTP client with the key; down afterwards."""
    state = tmp_path / "state"
    started = _iop("up", "--dir", str(state), "--port", "0")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        lines = dict(line.split(": ", 1) for line in started.stdout.splitlines() if ": " in line)
        headers = {"authorization": f"Bearer {lines['API key']}"}
        with httpx.Client(base_url=lines["base URL"], headers=headers, timeout=30) as client:
            yield state, client
    finally:
        node = state / "node.pid"
        if node.exists():  # never leave a stopped process behind
            os.kill(int(node.read_text()), signal.SIGCONT)
        _iop("down", "--dir", str(state))


def test_a_frozen_node_is_out_in_seconds_with_defaults(platform: tuple[Path, httpx.Client]) -> None:
    state, client = platform
    node_pid = int((state / "node.pid").read_text())
    payloads: list[str] = []
    with client.stream("POST", "/chat/completions", json=CHAT) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line:
                continue
            payloads.append(line.removeprefix("data: "))
            if len(payloads) == 1:  # mid-stream (64 tokens at 200 a second): the node freezes
                os.kill(node_pid, signal.SIGSTOP)
                frozen_at = time.monotonic()
        ended_after = time.monotonic() - frozen_at
    last = json.loads(payloads[-1])
    assert last.get("error", {}).get("code") == "node_lost", payloads[-3:]
    assert ended_after < 5.0, ended_after

    time.sleep(max(0.0, 5.0 - (time.monotonic() - frozen_at)))  # the bound under test: 5 s after the freeze
    asked = time.monotonic()
    refused = client.post("/chat/completions", json={**CHAT, "stream": False}, timeout=10)
    answered_after = time.monotonic() - asked
    assert refused.status_code == 503, refused.text  # not placed on the frozen node
    assert answered_after < 2.0, answered_after
    print(f"stream ended {ended_after:.2f} s after the freeze; a new request answered in {answered_after:.2f} s")
