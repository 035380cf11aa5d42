"""Runs over real mTLS connections on 127.0.0.1: streaming, multiplexing, cancel, close, liveness."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from conftest import EchoHandler, Pki, assert_eventually

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import ConnectionConfig, EventSink
from iop_wire.endpoint import Listener, ListenerConfig, dial, open_stream
from iop_wire.errors import IopError
from iop_wire.tls import Role, TlsConfig


def _request(run_id: str, model: str = "m", tokens: int = 3) -> pb.RunRequest:
    return pb.RunRequest(run_id=run_id, model=model, sampling=pb.Sampling(max_tokens=tokens))


@pytest.mark.parametrize("codec", ["proto", "json"])
async def test_streaming_run_and_capabilities(server: Listener, edge_tls: TlsConfig, codec: str) -> None:
    connection = await dial("127.0.0.1", server.port, tls=edge_tls, codec=codec, server_hostname="localhost")
    assert connection.peer.name == "test-node" and connection.peer.role is Role.NODE
    capabilities = await connection.capabilities()
    assert capabilities.adapters[0].models[0].name == "m"
    events = [event async for event in await connection.open_run(_request("r1"))]
    assert [e.WhichOneof("event") for e in events] == ["start", "delta", "delta", "delta", "complete"]
    assert [e.sequence for e in events] == [0, 1, 2, 3, 4]
    assert "".join(e.delta.text for e in events) == "w0 w1 w2 "
    assert events[-1].complete.usage.completion_tokens == 3
    await connection.close()


async def test_server_sees_client_identity(server: Listener, edge_tls: TlsConfig) -> None:
    connection = await dial("127.0.0.1", server.port, tls=edge_tls, server_hostname="localhost")
    await assert_eventually(lambda: len(server.connections) == 1)
    (served,) = server.connections
    assert (served.peer.name, served.peer.role) == ("test-edge", Role.EDGE)
    await connection.close()


async def test_many_concurrent_runs_are_multiplexed(server: Listener, edge_tls: TlsConfig) -> None:
    connection = await dial("127.0.0.1", server.port, tls=edge_tls, server_hostname="localhost")

    async def text(index: int) -> str:
        stream = await connection.open_run(_request(f"run-{index}", tokens=index % 7 + 1))
        return "".join([event.delta.text async for event in stream])

    texts = await asyncio.gather(*(text(i) for i in range(100)))
    assert texts == ["".join(f"w{k} " for k in range(i % 7 + 1)) for i in range(100)]
    await connection.close()


async def test_cancel_reaches_the_handler_and_ends_the_stream(
    server: Listener, edge_tls: TlsConfig, handler: EchoHandler
) -> None:
    connection = await dial("127.0.0.1", server.port, tls=edge_tls, server_hostname="localhost")
    stream = await connection.open_run(_request("slow", model="hang"))
    assert (await anext(stream)).WhichOneof("event") == "start"
    await stream.cancel("user pressed stop")
    last = await anext(stream)
    assert last.error.code == pb.ERROR_CODE_CANCELLED and "user pressed stop" in last.error.message
    assert handler.cancelled == ["user pressed stop"]
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    await connection.close()


async def test_handler_error_becomes_error_event(server: Listener, edge_tls: TlsConfig) -> None:
    connection = await dial("127.0.0.1", server.port, tls=edge_tls, server_hostname="localhost")
    events = [e async for e in await connection.open_run(_request("f", model="fail"))]
    assert events[-1].error.code == pb.ERROR_CODE_BACKEND_ERROR
    assert events[-1].error.message == "backend said no" and events[-1].error.run_id == "f"
    await connection.close()


async def test_duplicate_run_id_is_a_protocol_violation(server: Listener, edge_tls: TlsConfig) -> None:
    connection = await dial("127.0.0.1", server.port, tls=edge_tls, server_hostname="localhost")
    first = await connection.open_run(_request("same", model="hang"))
    await anext(first)
    with pytest.raises(IopError) as caught:  # the answer goes to the duplicate request ...
        await connection.request(pb.Envelope(run_id="same", run_request=pb.RunRequest(run_id="same", model="m")))
    assert caught.value.code == pb.ERROR_CODE_PROTOCOL_VIOLATION and "already running" in caught.value.message
    await first.cancel("done")  # ... and the live run with that id goes on until it is cancelled
    last = await anext(first)
    assert last.error.code == pb.ERROR_CODE_CANCELLED
    await connection.close()


async def test_client_disconnect_cancels_its_runs(server: Listener, edge_tls: TlsConfig, handler: EchoHandler) -> None:
    connection = await dial("127.0.0.1", server.port, tls=edge_tls, server_hostname="localhost")
    stream = await connection.open_run(_request("orphan", model="hang"))
    await anext(stream)
    connection._writer.transport.abort()  # the client vanishes without a goodbye
    await assert_eventually(lambda: len(handler.cancelled) == 1)
    assert handler.cancelled[0].startswith("connection closed")


async def test_graceful_close_fails_in_flight_runs_retryably_on_both_ends(
    server: Listener, edge_tls: TlsConfig, handler: EchoHandler
) -> None:
    connection = await dial("127.0.0.1", server.port, tls=edge_tls, server_hostname="localhost")
    streams = [await connection.open_run(_request(f"h{i}", model="hang")) for i in range(3)]
    for stream in streams:
        await anext(stream)
    await server.close("node draining")  # the serving end closes
    for stream in streams:
        last = await anext(stream)
        assert last.error.retryable, last
        assert last.error.code == pb.ERROR_CODE_SHUTTING_DOWN
    assert len(handler.cancelled) == 3


async def test_local_close_ends_own_streams_with_retryable_error(
    pki: Pki, handler: EchoHandler, edge_tls: TlsConfig
) -> None:
    listener = await Listener(ListenerConfig(tls=pki.config("n", Role.NODE)), handler.wire()).start()
    connection = await dial("127.0.0.1", listener.port, tls=edge_tls, server_hostname="localhost")
    stream = await connection.open_run(_request("mine", model="hang"))
    await anext(stream)
    await connection.close("client going away")
    last = await anext(stream)
    assert last.error.retryable and "client going away" in last.error.message
    await assert_eventually(lambda: len(handler.cancelled) == 1)
    assert handler.cancelled[0].startswith("connection closed") and "client going away" in handler.cancelled[0]
    await listener.close()


async def test_silent_peer_is_declared_dead_after_three_missed_heartbeats(
    server: Listener, edge_tls: TlsConfig
) -> None:
    reader, writer = await open_stream("127.0.0.1", server.port, tls=edge_tls, server_hostname="localhost")
    # This raw client never sends anything: the server (0.2 s heartbeats) gives up after ~0.6 s
    # and says why in an error envelope before closing.
    data = await asyncio.wait_for(reader.read(), timeout=5)
    assert b"missed 3 heartbeats" in data
    writer.close()
    await assert_eventually(lambda: len(server.connections) == 0)


async def test_heartbeats_keep_an_idle_connection_alive(server: Listener, edge_tls: TlsConfig) -> None:
    config = ConnectionConfig(heartbeat_interval=0.1)
    connection = await dial("127.0.0.1", server.port, tls=edge_tls, server_hostname="localhost", config=config)
    # The protocol's own timer under test, not a wait for something to happen: five of the server's
    # heartbeat periods (0.2 s; a silent peer is cut off after 3) pass with no application traffic.
    await asyncio.sleep(1.0)
    assert not connection.closed
    assert (await connection.capabilities()).node_id == "test-node"
    await connection.close()


class _YieldingHandler(EchoHandler):
    """Like EchoHandler, but lets the event loop run between deltas, as real adapters do."""

    async def run(self, request: pb.RunRequest, sink: EventSink) -> None:
        await sink.start(node_id="n", model=request.model, adapter="yielding")
        for index in range(request.sampling.max_tokens):
            await sink.delta(f"w{index} ")
            self.sent += 1
            if index % 32 == 0:
                await asyncio.sleep(0)
        await sink.complete(pb.FINISH_REASON_STOP)


async def _until_steady(count: Callable[[], int], quiet: float = 0.2, timeout: float = 5.0) -> int:
    """``count()`` once it has not changed for ``quiet`` seconds (the writer has stalled); fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    last, since = count(), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"still changing after {timeout} s: {last}"
        await asyncio.sleep(0.01)
        if count() != last:
            last, since = count(), time.monotonic()
    return last


@pytest.mark.parametrize("yields", [False, True], ids=["busy-writer", "yielding-writer"])
async def test_slow_reader_bounds_the_writer(pki: Pki, edge_tls: TlsConfig, yields: bool) -> None:
    handler = _YieldingHandler() if yields else EchoHandler()
    small = ConnectionConfig(run_buffer_bytes=64 * 1024, write_buffer=16 * 1024)
    listener = await Listener(ListenerConfig(tls=pki.config("n", Role.NODE), connection=small), handler.wire()).start()
    connection = await dial("127.0.0.1", listener.port, tls=edge_tls, server_hostname="localhost", config=small)
    await assert_eventually(lambda: len(listener.connections) == 1)
    (served,) = listener.connections
    stream = await connection.open_run(_request("firehose", tokens=1_000_000))
    await anext(stream)
    # Its reader reads nothing more: once 64 KiB wait for it, the run is cancelled at the writer.
    await assert_eventually(lambda: stream.ended and not served._served, timeout=10)
    stalled_at = await _until_steady(lambda: handler.sent)
    # The writer stopped instead of producing its million deltas (one that never yields runs on
    # until its socket fills and only then lets the cancel be read).
    assert stalled_at < 500_000
    last = [event async for event in stream][-1]
    assert last.error.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED and last.error.reason == pb.ERROR_REASON_SLOW_CONSUMER
    await connection.close()
    await listener.close()


async def test_role_not_allowed_is_refused_with_error(server: Listener, pki: Pki) -> None:
    worker = pki.config("w", Role.WORKER)
    with pytest.raises(IopError) as caught:
        await dial("127.0.0.1", server.port, tls=worker, server_hostname="localhost")
    assert caught.value.code == pb.ERROR_CODE_PERMISSION_DENIED and "worker" in caught.value.message


async def test_cancelled_stream_abandoned_by_its_reader_blocks_nothing(server: Listener, edge_tls: TlsConfig) -> None:
    config = ConnectionConfig(run_buffer_bytes=64 * 1024)
    connection = await dial("127.0.0.1", server.port, tls=edge_tls, server_hostname="localhost", config=config)
    abandoned = await connection.open_run(_request("walked-away", tokens=100_000))
    await anext(abandoned)
    await abandoned.cancel("not interested")
    del abandoned  # nobody reads it again
    events = [e async for e in await connection.open_run(_request("next", tokens=3))]
    assert [e.WhichOneof("event") for e in events][-1] == "complete"
    assert (await connection.capabilities()).node_id == "test-node"
    await connection.close()


async def test_a_full_stream_still_ends_when_the_connection_closes(pki: Pki, edge_tls: TlsConfig) -> None:
    handler = EchoHandler()
    listener = await Listener(ListenerConfig(tls=pki.config("n", Role.NODE)), handler.wire()).start()
    connection = await dial("127.0.0.1", listener.port, tls=edge_tls, server_hostname="localhost")
    stream = await connection.open_run(_request("unread", model="hang"))
    await assert_eventually(lambda: stream.buffered == 1)  # its start event waits for a reader
    await listener.close("going away")
    events = [e async for e in stream]  # reading again lets the connection see the close
    assert events[-1].WhichOneof("event") == "error" and events[-1].error.retryable


class _BrokenCapabilities(EchoHandler):
    async def capabilities(self) -> pb.CapabilityResponse:
        raise TypeError("'NoneType' object is not iterable")


class _SlowCapabilities(EchoHandler):
    async def capabilities(self) -> pb.CapabilityResponse:
        await asyncio.sleep(1.0)  # the slowness under test (5 heartbeat periods), not a synchronisation
        return await super().capabilities()


async def test_capability_failures_and_slowness_do_not_harm_the_connection(pki: Pki, edge_tls: TlsConfig) -> None:
    fast = ConnectionConfig(heartbeat_interval=0.2)
    for handler in (_BrokenCapabilities(), _SlowCapabilities()):
        config = ListenerConfig(tls=pki.config("n", Role.NODE), connection=fast)
        listener = await Listener(config, handler.wire()).start()
        connection = await dial("127.0.0.1", listener.port, tls=edge_tls, server_hostname="localhost", config=fast)
        if isinstance(handler, _BrokenCapabilities):
            with pytest.raises(IopError) as caught:
                await connection.capabilities()
            assert caught.value.code == pb.ERROR_CODE_INTERNAL
        else:  # a slow answer keeps the read loop free: runs go on, heartbeats too
            answer = asyncio.create_task(connection.capabilities())
            events = [e async for e in await connection.open_run(_request("meanwhile"))]
            assert events[-1].WhichOneof("event") == "complete"
            assert (await answer).node_id == "test-node"
        assert not connection.closed
        await connection.close()
        await listener.close()
