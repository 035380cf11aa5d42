"""Fair share with a real `iop node`: a caller flooding a model does not hold another's runs behind its queue.

One node of capacity 2 (mock, ~0.2 s a run). Caller A queues 12 runs, then caller B 2. Under the
default ``fairness: tokens`` B's runs take the next slots that free (A's counter grows with each of
its runs, B's is lifted to A's when it queues); under ``fifo`` they wait behind all of A's.
Asserted by the order of first outputs, with margin, never by timings; then the same flood under fifo.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import Pki, assert_eventually
from cp_helpers import client, with_node
from node_helpers import chat, kinds

from iop_control_plane.bootstrap import ControlPlaneApp
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection

MODEL = "mock-two"
ROUTE = {"model": MODEL, "adapter": "mock", "max_concurrency": 2, "options": {"tokens": 10, "tokens_per_second": 50}}
FLOOD, FAIR = 12, 2


@pytest.fixture
async def cp(pki: Pki, tmp_path: Path) -> AsyncIterator[ControlPlaneApp]:
    async with with_node(pki, tmp_path, [ROUTE], queue_size=64, queue_timeout=30) as app:
        yield app


async def _first_output(edge: Connection, caller: str, index: int) -> tuple[str, float]:
    """(caller, when its run's first delta arrived); the run is read to its end, which must be complete."""
    stream = await edge.open_run(chat(model=MODEL, run_id=f"{caller}-{index}", caller=pb.Caller(id=caller)))
    first, events = None, []
    async for event in stream:
        events.append(event)
        if first is None and event.WhichOneof("event") == "delta":
            first = time.monotonic()
    assert kinds(events)[-1] == "complete" and first is not None, events
    return caller, first


async def _order_of_first_outputs(app: ControlPlaneApp, pki: Pki) -> list[str]:
    edge = await client(app, pki)
    flood = [asyncio.create_task(_first_output(edge, "caller-a", index)) for index in range(FLOOD)]
    await assert_eventually(lambda: app.runs.queue.depth(MODEL) == FLOOD - 2, timeout=10)  # 2 run, the rest wait
    fair = [asyncio.create_task(_first_output(edge, "caller-b", index)) for index in range(FAIR)]
    await assert_eventually(lambda: app.runs.queue.depth(MODEL) == FLOOD - 2 + FAIR, timeout=10)
    firsts = await asyncio.wait_for(asyncio.gather(*flood, *fair), 60)
    return [caller for caller, _ in sorted(firsts, key=lambda pair: pair[1])]


async def test_a_flooding_caller_does_not_hold_another_behind_its_queue(cp: ControlPlaneApp, pki: Pki) -> None:
    order = await _order_of_first_outputs(cp, pki)
    b_places = [place for place, caller in enumerate(order) if caller == "caller-b"]
    assert max(b_places) <= 5, order  # the next slots that freed (2, 3), with margin for a report racing a slot
    metrics = cp.metrics.registry
    served = metrics.get_sample_value(
        "iop_control_plane_caller_tokens_total", {"caller": "caller-b", "kind": "completion"}
    )
    assert served == FAIR * 10
    waited = metrics.get_sample_value("iop_control_plane_caller_queue_wait_seconds_count", {"caller": "caller-b"})
    assert waited == FAIR

    cp.operations.apply(f"models: {{{MODEL}: {{fairness: fifo}}}}\n", "test")  # the same flood in arrival order
    order = await _order_of_first_outputs(cp, pki)
    assert order[-FAIR:] == ["caller-b"] * FAIR, order  # behind every run of the flood
