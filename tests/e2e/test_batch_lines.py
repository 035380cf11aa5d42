"""Batches through the real stack: the create answers before validating; a line that cannot become
a run fails once; a stopped line stops its run on the node.

A line can pass the Batch API's checks and still not be a run: a lone surrogate is no UTF-8 and
``tools`` nested 40 deep is past protobuf's nesting limit. Before, such a line was leased again
and again (the batch never ended, a traceback each time); now it goes to the error file once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from .batch_helpers import jsonl, upload, worker_reachable
from .conftest import Stack, batch_ended, file_lines, running_stack, wait_for

FAST = {"model": "mock-fast", "adapter": "mock", "options": {"tokens": 2}}
LONG_OPTIONS = {"tokens": 600, "tokens_per_second": 20}
LONG = {"model": "mock-long", "adapter": "mock", "max_concurrency": 64, "options": LONG_OPTIONS}
"""A line of 30 s: it runs until cancelled, as far as these tests go."""


@pytest.fixture(scope="module")
def line_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    worker = {"batches": {"poll_interval": 0.05, "lease_seconds": 2.0, "concurrency": 8}}
    with running_stack(tmp_path_factory.mktemp("lines"), {"node-a": [FAST, LONG]}, worker=worker) as stack:
        yield worker_reachable(stack)


def _line(custom_id: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "mock-fast", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def test_a_line_that_cannot_become_a_run_fails_once_with_a_clear_error(line_stack: Stack) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(40)}}]
    lines = [_line(f"good-{i}", _chat("hi")) for i in range(4)]
    lines.append(_line("surrogate", _chat("a\ud800b")))  # json.dumps writes it as the escape \ud800
    lines.append(_line("deep-tools", _chat("hi", tools=tools)))
    client = line_stack.client()
    file_id = upload(client, "\n".join(lines).encode())
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    done = batch_ended(client, batch.id, timeout=30.0)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 2)
    errors = {line["custom_id"]: line for line in file_lines(client, done.error_file_id)}
    assert errors.keys() == {"surrogate", "deep-tools"}
    assert "not valid Unicode" in errors["surrogate"]["error"]["message"]
    assert "nested too deeply" in errors["deep-tools"]["error"]["message"]
    assert {line["response"]["status_code"] for line in errors.values()} == {400}
    assert line_stack.worker is not None
    log = line_stack.worker.log.read_text()
    assert "Traceback" not in log and "line failed unexpectedly" not in log


def _running_on_node(stack: Stack) -> int:
    return sum(1 for run in stack.runs("node-a") if run["model"] == "mock-long" and run["status"] == "running")


def test_cancelling_a_batch_cancels_its_running_lines_on_the_node(line_stack: Stack) -> None:
    """8 lines of 30 s each run at once; the cancel must end them on the node within seconds, not 30."""
    body = {"model": "mock-long", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}
    lines = [_line(f"long-{i}", body) for i in range(8)]
    client = line_stack.client()
    file_id = upload(client, "\n".join(lines).encode())
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: _running_on_node(line_stack) == 8, 15.0, 0.1, "8 lines running on the node")
    client.batches.cancel(batch.id)
    done = batch_ended(client, batch.id, timeout=15.0)
    assert done.status == "cancelled"
    wait_for(lambda: _running_on_node(line_stack) == 0, 10.0, 0.1, "the node's runs ending")
    statuses = [run["status"] for run in line_stack.runs("node-a") if run["model"] == "mock-long"]
    assert statuses == ["cancelled"] * 8


def test_a_large_batch_is_created_validating_and_the_worker_serves_meanwhile(line_stack: Stack) -> None:
    """20,000 lines of 4 KB (80 MB): the create answers ``validating`` without reading them, and a
    files list is answered while the batch is still being validated (before: the create read and
    stored every line before answering, 504 after 30 s at 50,000, and every other request waited)."""
    padding = "x" * 4000
    body = {"model": "mock-fast", "messages": [{"role": "user", "content": padding}], "max_tokens": 1}
    lines = [
        {"custom_id": f"big-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(20_000)
    ]
    client = line_stack.client(timeout=120.0)
    file_id = upload(client, jsonl(lines))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "validating"
    listed_at = time.monotonic()
    assert file_id in [item.id for item in client.files.list(limit=100).data]
    listed_in = time.monotonic() - listed_at
    still = client.batches.retrieve(batch.id)
    assert still.status == "validating", f"validation ended before the list did ({listed_in:.2f} s)"
    client.batches.cancel(batch.id)
    assert batch_ended(client, batch.id, timeout=60.0).status in ("cancelled", "failed")
