"""Batches survive crashes: a worker, the control-plane or a node killed (SIGKILL) mid-batch, every
input line still ends in the output or error file exactly once; past its window a batch ends
``expired`` with the lines done so far; two workers on one PostgreSQL database share a batch and
the survivor takes over the lines of the one killed.

Driven with the official SDK through the edge, as a client would: files.create, batches.create,
batches.retrieve until the batch ends, files.content.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx2 as httpx
import openai
import pytest
from worker.pg_server import create_database, pg_server, required_binaries

from .batch_helpers import worker_reachable
from .conftest import Process, Stack, batch_ended, file_lines, running_stack, wait_for

# 4 tokens at 40 per second: about 0.1 s a line, 16 at once per node.
PACED = {
    "model": "mock-paced",
    "adapter": "mock",
    "max_concurrency": 16,
    "queue_size": 512,
    "options": {"tokens": 4, "tokens_per_second": 40},
}
# 10 tokens at 10 per second: about 1 s a line, 4 at once per node.
CRAWL = {
    "model": "mock-crawl",
    "adapter": "mock",
    "max_concurrency": 4,
    "options": {"tokens": 10, "tokens_per_second": 10},
}
WORKER = {"batches": {"lease_seconds": 1.0, "poll_interval": 0.05, "attempts": 20, "concurrency": 24}}


@pytest.fixture(scope="module")
def durable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two nodes serving the paced models and a worker on SQLite; each test leaves every process running."""
    nodes = {"node-a": [PACED, CRAWL], "node-b": [PACED, CRAWL]}
    with running_stack(tmp_path_factory.mktemp("durable"), nodes, worker=WORKER) as stack:
        yield worker_reachable(stack)


def _inputs(count: int, model: str = "mock-paced", prefix: str = "line") -> list[dict[str, Any]]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return [
        {"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(count)
    ]


def _create(client: openai.OpenAI, lines: list[dict[str, Any]], window: str = "24h") -> str:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window=window)  # type: ignore[arg-type]
    return batch.id


def _completed_at_least(client: openai.OpenAI, batch_id: str, count: int) -> None:
    """Wait until ``count`` lines are done and the batch is still running: a crash now is mid-batch."""

    def far_enough() -> bool:
        batch = client.batches.retrieve(batch_id)
        assert batch.status in ("validating", "in_progress"), f"the batch ended before the crash: {batch.status}"
        return batch.request_counts is not None and batch.request_counts.completed >= count

    wait_for(far_enough, 20.0, 0.05, f"{count} lines of {batch_id} done")


def _assert_exactly_once(client: openai.OpenAI, batch: Any, inputs: list[dict[str, Any]]) -> None:
    """Every input line is in the output or error file once; the counts agree with the files."""
    assert batch.status == "completed", batch
    output, errors = file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
    seen = Counter(line["custom_id"] for line in output + errors)
    assert [custom_id for custom_id, times in seen.items() if times > 1] == []
    assert set(seen) == {line["custom_id"] for line in inputs}
    assert errors == [], errors[:3]
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(inputs), len(output), len(errors))


def test_a_worker_killed_mid_batch_resumes_it_after_a_restart(durable: Stack) -> None:
    client, worker = durable.client(), durable.worker
    assert worker is not None
    inputs = _inputs(300, prefix="worker")
    batch_id = _create(client, inputs)
    _completed_at_least(client, batch_id, 40)
    worker.kill()
    worker.restart()  # same config: same SQLite file, same port behind the edge
    _assert_exactly_once(client, batch_ended(client, batch_id), inputs)


def test_a_control_plane_killed_mid_batch_loses_no_line(durable: Stack) -> None:
    client = durable.client()
    control_plane = durable.control_plane
    assert control_plane is not None
    inputs = _inputs(300, prefix="cp")
    batch_id = _create(client, inputs)
    _completed_at_least(client, batch_id, 40)
    control_plane.kill()
    control_plane.restart()  # same port: the nodes, the worker and the edge dial it again
    _assert_exactly_once(client, batch_ended(client, batch_id), inputs)


def test_a_node_killed_mid_batch_loses_no_line(durable: Stack) -> None:
    client, node = durable.client(), durable.nodes["node-a"]
    inputs = _inputs(300, prefix="node")
    batch_id = _create(client, inputs)
    _completed_at_least(client, batch_id, 40)
    node.kill()
    try:
        _assert_exactly_once(client, batch_ended(client, batch_id), inputs)
    finally:
        node.restart()


def test_a_batch_past_its_window_expires_with_the_lines_done(durable: Stack) -> None:
    client = durable.client()
    inputs = _inputs(40, model="mock-crawl", prefix="slow")  # 8 at once, 1 s each: 5 s of work
    batch_id = _create(client, inputs, window="3s")
    batch = batch_ended(client, batch_id)
    assert batch.status == "expired" and batch.expired_at is not None
    output, errors = file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
    done = [line["custom_id"] for line in output]
    assert len(done) == len(set(done)) == batch.request_counts.completed
    assert 0 < batch.request_counts.completed < len(inputs)
    assert set(done) <= {line["custom_id"] for line in inputs}
    assert errors == [], errors[:3]  # the lines cut off by the window are in neither file
    assert batch.request_counts.failed == 0


def test_a_cancel_stops_the_running_lines_and_keeps_the_finished_ones(durable: Stack) -> None:
    client = durable.client()
    inputs = _inputs(40, model="mock-crawl", prefix="cancel")  # 8 at once, 1 s each
    batch_id = _create(client, inputs)
    _completed_at_least(client, batch_id, 1)
    client.batches.cancel(batch_id)
    batch = batch_ended(client, batch_id, timeout=5.0)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    wait_for(lambda: durable.running("mock-crawl") is None, 5.0, 0.05, "the running lines cancelled on the nodes")
    output, errors = file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
    done = [line["custom_id"] for line in output]
    assert len(done) == len(set(done)) == batch.request_counts.completed
    assert 0 < batch.request_counts.completed < len(inputs)
    assert set(done) <= {line["custom_id"] for line in inputs}
    assert errors == [], errors[:3]
    assert batch.request_counts.failed == 0


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """A fresh database on a PostgreSQL server of this module's own."""
    with pg_server(required_binaries()) as server:
        yield server.url(asyncio.run(create_database(server, "batches")))


def _metric(stack: Stack, worker: str, name: str) -> float:
    """The sum of a worker's samples of ``name`` (all labels), from its /metrics."""
    port = json.loads((stack.root / f"{worker}.ready").read_text())["metrics_port"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(value) for value in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def _frozen_holding_leases(process: Process, url: str, owner_prefix: str) -> bool:
    """SIGSTOP ``process``; True if it holds a lease now (it stays stopped), else SIGCONT and False."""
    process.popen.send_signal(signal.SIGSTOP)

    async def held() -> int:
        conn = await asyncpg.connect(url)
        try:
            query = "SELECT count(*) FROM lines WHERE status = 'leased' AND lease_owner LIKE $1"
            return int(await conn.fetchval(query, owner_prefix + "%"))
        finally:
            await conn.close()

    if asyncio.run(held()) > 0:
        return True
    process.popen.send_signal(signal.SIGCONT)
    time.sleep(0.02)
    return False


def test_two_workers_on_postgresql_share_a_batch_and_survive_one_killed(postgres_url: str, tmp_path: Path) -> None:
    settings = {
        "store": {"url": postgres_url},
        "metrics_port": 0,
        "batches": {"lease_seconds": 1.0, "poll_interval": 0.05, "attempts": 20, "concurrency": 8},
    }
    with running_stack(tmp_path / "stack", {"node-a": [PACED]}, worker=settings) as stack:
        other = stack.add_worker("worker-b", settings)
        client = stack.client()
        inputs = _inputs(300, prefix="pg")
        batch_id = _create(client, inputs)
        lines = "iop_worker_lines_total"
        wait_for(lambda: _metric(stack, "worker-b", lines) >= 10, 20.0, 0.05, "worker-b finishing lines")
        assert client.batches.retrieve(batch_id).status == "in_progress"
        # Killed between two leases (or once the survivor had leased the batch's last lines), worker-b
        # would leave nothing to take over: freeze it until PostgreSQL shows it holding lines.
        wait_for(
            lambda: _frozen_holding_leases(other, postgres_url, "worker-b-"),
            20.0,
            0.0,
            "worker-b frozen holding leases",
        )
        other.kill()  # with lines leased: the survivor takes them once the leases lapse
        _assert_exactly_once(client, batch_ended(client, batch_id), inputs)
        assert _metric(stack, "worker", lines) > 0
        assert _metric(stack, "worker", "iop_worker_lease_takeovers_total") > 0
