"""Admission with a real `iop node`: one node of capacity 1, so a second run waits for the first."""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import Pki, assert_eventually
from cp_helpers import client, with_node
from google.protobuf.timestamp_pb2 import Timestamp
from node_helpers import chat, collect, kinds

from iop_control_plane.bootstrap import ControlPlaneApp
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.runs import RunStream

MODEL = "mock-one"
ROUTE = {"model": MODEL, "adapter": "mock", "max_concurrency": 1, "options": {"tokens": 8, "tokens_per_second": 20}}
"""One run at a time, ~0.4 s each."""


@pytest.fixture
async def cp(pki: Pki, tmp_path: Path) -> AsyncIterator[ControlPlaneApp]:
    async with with_node(pki, tmp_path, [ROUTE], queue_size=2, queue_timeout=5) as app:
        yield app


async def _queued(app: ControlPlaneApp, depth: int) -> None:
    await assert_eventually(lambda: app.runs.queue.depth(MODEL) == depth, timeout=5)


async def _timed(stream: RunStream) -> tuple[list[pb.RunEvent], list[float]]:
    """A run's events and when each arrived."""
    events, times = [], []
    async for event in stream:
        events.append(event)
        times.append(time.monotonic())
    return events, times


def _exhausted(events: list[pb.RunEvent]) -> pb.Error:
    assert kinds(events) == ["error"], events
    error = events[0].error
    assert error.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED and error.retryable
    assert error.HasField("retry_after") and error.retry_after.ToTimedelta() > datetime.timedelta(0)
    return error


async def test_a_run_waits_for_the_slot_and_higher_priority_overtakes(cp: ControlPlaneApp, pki: Pki) -> None:
    edge = await client(cp, pki)
    first = await edge.open_run(chat(model=MODEL, run_id="first"))
    assert (await anext(first)).WhichOneof("event") == "start"
    low = await edge.open_run(chat(model=MODEL, run_id="low"))  # priority 0
    await _queued(cp, 1)
    high = await edge.open_run(chat(model=MODEL, run_id="high", priority=10))
    await _queued(cp, 2)
    assert cp.metrics.registry.get_sample_value("iop_control_plane_queue_depth", {"model": MODEL}) == 2

    assert kinds(await collect(first))[-1] == "complete"
    (high_events, high_times), (low_events, low_times) = await asyncio.gather(_timed(high), _timed(low))
    assert kinds(high_events)[-1] == "complete" and kinds(low_events)[-1] == "complete"
    low_output = low_times[kinds(low_events).index("delta")]
    assert high_times[-1] <= low_output  # the slot went to the higher priority first, though it came later
    assert cp.runs.queue.depth(MODEL) == 0
    metrics = cp.metrics.registry
    assert metrics.get_sample_value("iop_control_plane_queue_wait_seconds_count", {"outcome": "admitted"}) == 2
    assert metrics.get_sample_value("iop_control_plane_queue_depth", {"model": MODEL}) == 0


async def test_overflow_deadline_and_cancel(cp: ControlPlaneApp, pki: Pki) -> None:
    edge = await client(cp, pki)
    first = await edge.open_run(chat(model=MODEL))
    assert (await anext(first)).WhichOneof("event") == "start"

    deadline = Timestamp()
    deadline.FromDatetime(datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=0.2))
    late = await asyncio.wait_for(collect(await edge.open_run(chat(model=MODEL, deadline=deadline))), 5)
    assert _exhausted(late).reason == pb.ERROR_REASON_UNSPECIFIED  # the node was busy: no reason of the caller's

    waiting = [await edge.open_run(chat(model=MODEL)) for _ in range(2)]
    await _queued(cp, 2)
    overflow = await asyncio.wait_for(collect(await edge.open_run(chat(model=MODEL))), 5)
    assert _exhausted(overflow).reason == pb.ERROR_REASON_QUEUE_FULL
    assert cp.metrics.registry.get_sample_value("iop_control_plane_queue_refused_total", {"reason": "full"}) == 1

    await waiting[0].cancel("changed my mind")  # a queued run that is cancelled leaves at once
    await _queued(cp, 1)
    assert kinds(await collect(waiting[0])) == ["error"]
    assert kinds(await collect(first))[-1] == "complete"
    assert kinds(await collect(waiting[1]))[-1] == "complete"
    metrics = cp.metrics.registry
    assert metrics.get_sample_value("iop_control_plane_queue_wait_seconds_count", {"outcome": "deadline"}) == 1
    assert metrics.get_sample_value("iop_control_plane_queue_wait_seconds_count", {"outcome": "cancelled"}) == 1


async def test_a_caller_held_by_its_own_limit_is_told_so(cp: ControlPlaneApp, pki: Pki) -> None:
    cp.operations.apply("callers: {caller-x: {max_concurrency: 1}}\n", "test")
    edge = await client(cp, pki)
    first = await edge.open_run(chat(model=MODEL, caller=pb.Caller(id="caller-x")))
    assert (await anext(first)).WhichOneof("event") == "start"
    deadline = Timestamp()
    deadline.FromDatetime(datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=0.2))
    second = chat(model=MODEL, caller=pb.Caller(id="caller-x"), deadline=deadline)
    held = _exhausted(await asyncio.wait_for(collect(await edge.open_run(second)), 5))
    assert held.reason == pb.ERROR_REASON_CALLER_LIMIT and "caller-x" in held.message
    assert kinds(await collect(first))[-1] == "complete"
    metrics = cp.metrics.registry
    assert metrics.get_sample_value("iop_control_plane_queue_wait_seconds_count", {"outcome": "caller_limit"}) == 1
