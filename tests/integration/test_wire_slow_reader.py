"""A run whose reader does not read stalls only itself: two real mTLS Connections on 127.0.0.1.

One end serves runs that stream at a steady pace (like a backend); the other opens a run it
never reads beside runs it reads. The unread run is cancelled at the server once its buffer
holds ``run_buffer_bytes``, its reader gets RESOURCE_EXHAUSTED / SLOW_CONSUMER, and the other
runs on the same connection go on as if it were not there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import structlog
from conftest import EchoHandler, Pki, assert_eventually

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection, ConnectionConfig, EventSink
from iop_wire.endpoint import Listener, ListenerConfig, dial
from iop_wire.metrics import REGISTRY
from iop_wire.runs import RunStream
from iop_wire.tls import Role, TlsConfig

_LIMITS = ConnectionConfig(run_buffer_bytes=256 * 1024, heartbeat_interval=1.0)
_NORMAL_TOKENS = 50
_PACE = 0.002  # seconds between a paced run's tokens (500 tokens/s, a fast backend)


class _PacedHandler(EchoHandler):
    """Model "paced" streams a token every _PACE seconds; "firehose" as fast as it can, yielding
    to the event loop every 16 tokens as a real adapter awaiting its backend does."""

    async def run(self, request: pb.RunRequest, sink: EventSink) -> None:
        await sink.start(node_id="n", model=request.model, adapter=request.model)
        try:
            for index in range(request.sampling.max_tokens):
                await sink.delta(f"w{index} ")
                if request.model == "paced":
                    await asyncio.sleep(_PACE)
                elif index % 16 == 0:
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled.append(sink.cancel_reason)
            raise
        await sink.complete(pb.FINISH_REASON_STOP)


def _slow_consumer_hits() -> float:
    return REGISTRY.get_sample_value("iop_wire_limit_hits_total", {"limit": "slow_consumer"}) or 0.0


async def _read_paced(stream: RunStream) -> tuple[float, pb.RunEvent]:
    """Seconds to the run's first delta, and its last event."""
    opened = time.monotonic()
    first = 0.0
    last = pb.RunEvent()
    async for event in stream:
        if event.HasField("delta") and not first:
            first = time.monotonic() - opened
        last = event
    return first, last


async def _open(connection: Connection, model: str, tokens: int, count: int, tag: str) -> list[RunStream]:
    sampling = pb.Sampling(max_tokens=tokens)
    return [
        await connection.open_run(pb.RunRequest(run_id=f"{tag}-{i}", model=model, sampling=sampling))
        for i in range(count)
    ]


async def _unread_runs(connection: Connection) -> list[RunStream]:
    """Two runs of a practically endless answer, opened and never read."""
    return await _open(connection, "firehose", 10_000_000, 2, "unread")


async def _normal_runs(connection: Connection, count: int, tag: str) -> list[tuple[float, pb.RunEvent]]:
    streams = await _open(connection, "paced", _NORMAL_TOKENS, count, tag)
    async with asyncio.timeout(30):  # stalled behind an unread run (the bug) fails here, not in a hang
        return await asyncio.gather(*(_read_paced(stream) for stream in streams))


@pytest.fixture
def handler() -> _PacedHandler:
    return _PacedHandler()


@pytest.fixture
async def connection(pki: Pki, edge_tls: TlsConfig, handler: _PacedHandler) -> AsyncIterator[Connection]:
    """A connection to a listener serving ``handler``, both with a 256 KiB run buffer."""
    config = ListenerConfig(tls=pki.config("n", Role.NODE), connection=_LIMITS)
    async with (
        Listener(config, handler.wire()) as listener,
        dial("127.0.0.1", listener.port, tls=edge_tls, server_hostname="localhost", config=_LIMITS) as connected,
    ):
        yield connected


async def test_an_unread_run_is_cancelled_alone_and_the_others_go_on(
    handler: _PacedHandler, connection: Connection
) -> None:
    alone = [event async for event in await connection.open_run(pb.RunRequest(run_id="baseline", model="paced"))]
    assert alone[-1].WhichOneof("event") == "complete"
    hits = _slow_consumer_hits()
    with structlog.testing.capture_logs() as logs:
        unread = await _unread_runs(connection)
        results = await _normal_runs(connection, 8, "normal")
        # The normal runs all completed, each with every token, while two runs went unread.
        assert all(last.WhichOneof("event") == "complete" for _, last in results)
        await assert_eventually(lambda: len(handler.cancelled) == 2, timeout=10)
    # Each unread run ended with the slow-consumer error (after what was dropped), nothing else.
    for stream in unread:
        events = [event async for event in stream]
        assert len(events) == 1, [e.WhichOneof("event") for e in events]
        error = events[0].error
        assert error.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED and error.reason == pb.ERROR_REASON_SLOW_CONSUMER
        assert stream.run_id in error.message and "behind" in error.message and not error.retryable
        assert stream.buffered_bytes == 0
    assert all("slow consumer" in reason for reason in handler.cancelled)
    assert _slow_consumer_hits() - hits == 2
    assert any(entry["event"] == "run cancelled" and entry["reason"] == "slow consumer" for entry in logs)
    # Nothing is left of them once the server's terminal events came, and the connection serves on.
    await assert_eventually(lambda: not connection._streams)
    assert not connection.closed
    again = await _normal_runs(connection, 1, "after")
    assert again[0][1].WhichOneof("event") == "complete"


@pytest.mark.serial  # alone, after the parallel tests: first tokens are held to 2x the quiet ones + 50 ms
async def test_the_unread_runs_do_not_delay_the_first_tokens_of_others(connection: Connection) -> None:
    """Time to first token of 8 paced runs beside 2 unread firehoses stays within 2x of without them."""
    await _normal_runs(connection, 8, "warm")
    quiet = max(first for first, _ in await _normal_runs(connection, 8, "quiet"))
    await _unread_runs(connection)
    attacked = await _normal_runs(connection, 8, "attacked")
    slowest = max(first for first, _ in attacked)
    # 50 ms of margin: on a loaded machine a few ms of scheduling noise would dwarf the 2x.
    assert slowest <= 2 * quiet + 0.05, (quiet, slowest)
    assert all(last.WhichOneof("event") == "complete" for _, last in attacked)
