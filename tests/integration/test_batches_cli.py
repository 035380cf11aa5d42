"""``iop batches ls|show|cancel`` against the worker of a platform started by ``iop up``.

One platform for the module (``iop up --dir tmp --port 0``); batches are created through its edge
with the official OpenAI SDK and read back with the CLI, over IOP with the admin certificate.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

IOP = [sys.executable, "-m", "iop_cli.main"]
# No state folder, key or worker address from the environment: each call names its own.
ENV = {k: v for k, v in os.environ.items() if k not in ("IOP_STATE_DIR", "IOP_API_KEY", "IOP_WORKER")}
T = TypeVar("T")


def _iop(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*IOP, *args], capture_output=True, text=True, timeout=60, check=False, env=env or ENV)


def _eventually(probe: Callable[[], T | None], timeout: float = 30) -> T:
    """The first non-None answer of ``probe``, polled until ``timeout``."""
    deadline = time.monotonic() + timeout
    while (found := probe()) is None:
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)
    return found


class Platform:
    """The module's platform: its state folder and an OpenAI client for its edge."""

    def __init__(self, state: Path, printed: str) -> None:
        from openai import OpenAI

        self.state = state
        values = dict(line.split(": ", 1) for line in printed.splitlines() if line.startswith(("base URL", "API key")))
        self.client = OpenAI(base_url=values["base URL"], api_key=values["API key"], max_retries=0)

    def batches(self, *args: str) -> subprocess.CompletedProcess[str]:
        return _iop("batches", *args, "--dir", str(self.state))

    def show(self, batch_id: str) -> dict[str, Any]:
        shown = self.batches("show", batch_id, "--json")
        assert shown.returncode == 0, shown.stderr
        answer: dict[str, Any] = json.loads(shown.stdout)
        return answer

    def create(self, lines: int, model: str) -> str:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        text = "".join(
            json.dumps({"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
            for n in range(lines)
        )
        uploaded = self.client.files.create(file=("lines.jsonl", text.encode()), purpose="batch")
        batch = self.client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        return batch.id

    def until(self, batch_id: str, *statuses: str) -> dict[str, Any]:
        return _eventually(lambda: batch if (batch := self.show(batch_id))["status"] in statuses else None)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    state = tmp_path_factory.mktemp("batches") / "state"
    started = _iop("up", "--dir", str(state), "--port", "0")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        running = Platform(state, started.stdout)
        yield running
        running.client.close()
    finally:
        _iop("down", "--dir", str(state))


@pytest.fixture(scope="module")
def finished(platform: Platform) -> str:
    """A 3-line batch that has completed."""
    batch_id = platform.create(3, "mock-fast")
    platform.until(batch_id, "completed")
    return batch_id


def test_ls_shows_a_created_batch(platform: Platform, finished: str) -> None:
    listed = platform.batches("ls")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["ID", "STATUS", "ENDPOINT", "DONE", "FAILED", "CREATED"]
    row = next(row.split() for row in rows if row.startswith(finished))
    assert row[1:5] == ["completed", "/v1/chat/completions", "3/3", "0"]
    as_json = json.loads(platform.batches("ls", "--json", "--limit", "100").stdout)
    assert finished in [batch["id"] for batch in as_json]


def test_show_json_has_the_batch_objects_fields(platform: Platform, finished: str) -> None:
    batch = platform.show(finished)
    assert batch["id"] == finished and batch["status"] == "completed"
    assert batch["endpoint"] == "/v1/chat/completions" and batch["completion_window"] == "24h"
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert batch["input_file_id"].startswith("file-") and batch["output_file_id"].startswith("file-")
    assert batch["error_file_id"] is None and batch["errors"] == []
    for moment in ("created_at", "in_progress_at", "finalizing_at", "completed_at", "expires_at"):
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", batch[moment]), moment
    assert batch["usage"]["completion_tokens"] > 0
    text = platform.batches("show", finished)
    assert text.returncode == 0, text.stderr
    assert "status: completed" in text.stdout and "requests: 3/3 done (3 completed, 0 failed)" in text.stdout
    # no progress bar once it has ended (a bar's "  ETA 14s"; an id such as file-cETAg... is not one)
    assert not re.search(r"  ETA (-|\d)", text.stdout), text.stdout


def test_show_draws_progress_and_cancel_stops_a_running_batch(platform: Platform) -> None:
    batch_id = platform.create(500, "mock-small")  # about 0.3 s a line: it runs for a while

    def bar() -> str | None:
        shown = platform.batches("show", batch_id)
        return next((line for line in shown.stdout.splitlines() if "lines/s" in line), None)

    assert re.fullmatch(r"\[[#.]{20}\] \d+/500 \d+%  \d+ lines/s  ETA (\d+s|\d+m\d\ds|\d+h\d\dm)", _eventually(bar)), (
        bar()
    )
    cancelled = platform.batches("cancel", batch_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert re.fullmatch(rf"batch {batch_id} (cancelling|cancelled) \(\d+ of 500 lines done\)\n", cancelled.stdout)
    batch = platform.until(batch_id, "cancelled")
    counts = batch["request_counts"]
    assert counts["total"] == 500 and counts["completed"] + counts["failed"] < 500
    assert batch["cancelling_at"] and batch["cancelled_at"]


def test_cancel_of_an_ended_batch_is_one_line(platform: Platform, finished: str) -> None:
    refused = platform.batches("cancel", finished)
    assert refused.returncode == 1
    assert refused.stderr == f"iop batches: batch {finished} already completed (3 of 3 lines done); nothing to cancel\n"


@pytest.mark.parametrize("command", ["show", "cancel"])
def test_an_unknown_batch_is_one_line_exit_1(platform: Platform, command: str) -> None:
    unknown = platform.batches(command, "batch_nosuchbatch000000000000")
    assert unknown.returncode == 1
    assert unknown.stderr.count("\n") == 1 and unknown.stdout == ""
    assert unknown.stderr.startswith(
        "iop batches: no batch 'batch_nosuchbatch000000000000' on the worker at 127.0.0.1:"
    )


def test_the_worker_is_found_by_option_environment_or_state_folder(platform: Platform, tmp_path: Path) -> None:
    address = f"127.0.0.1:{json.loads((platform.state / 'worker.ready').read_text())['port']}"
    certs = str(platform.state / "certs")
    by_option = _iop("batches", "ls", "--worker", address, "--certs", certs, "--dir", str(tmp_path))
    assert by_option.returncode == 0, by_option.stderr
    by_environment = _iop("batches", "ls", "--certs", certs, "--dir", str(tmp_path), env={**ENV, "IOP_WORKER": address})
    assert by_environment.returncode == 0, by_environment.stderr
    assert by_environment.stdout == by_option.stdout


def test_a_worker_that_cannot_be_asked_is_one_line_exit_2(platform: Platform, tmp_path: Path) -> None:
    unreachable = platform.batches("ls", "--worker", "127.0.0.1:1")
    assert unreachable.returncode == 2
    assert unreachable.stderr == "iop batches: cannot reach the worker at 127.0.0.1:1: connection refused\n"
    no_certs = _iop("batches", "ls", "--dir", str(tmp_path))
    assert no_certs.returncode == 2
    assert no_certs.stderr.count("\n") == 1 and "admin.crt" in no_certs.stderr
    bad = platform.batches("ls", "--limit", "0")
    assert bad.returncode == 2 and bad.stderr == "iop batches: --limit must be from 1 to 100, not 0\n"
