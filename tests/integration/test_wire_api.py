"""The wire package's public API without the node, over real mTLS connections on 127.0.0.1.

The handler table and its replies and limits, ``dial`` and ``Listener`` as context managers,
:func:`relay` between two connections, :class:`KeepConnected`, and the pure helpers
(:class:`Backoff`, :func:`acting_caller`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import pytest
import structlog
from conftest import EchoHandler, Pki, assert_eventually

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import get_codec
from iop_wire.connection import Connection, ConnectionConfig, Handler, Inbound
from iop_wire.dialer import Backoff, KeepConnected, Target
from iop_wire.endpoint import Listener, ListenerConfig, dial, preface
from iop_wire.errors import IopError
from iop_wire.framing import HEADER_SIZE, encode_frame
from iop_wire.metrics import REGISTRY
from iop_wire.runs import EventSink, relay
from iop_wire.tls import PeerIdentity, Role, TlsConfig, acting_caller, server_context

Logs = list[MutableMapping[str, Any]]
StartListener = Callable[..., Awaitable[Listener]]

FAST = ConnectionConfig(heartbeat_interval=0.2)


@contextmanager
def captured() -> Iterator[Logs]:
    with structlog.testing.capture_logs() as logs:
        yield logs


def _limit_hits(limit: str) -> float:
    return REGISTRY.get_sample_value("iop_wire_limit_hits_total", {"limit": limit}) or 0.0


def _request(run_id: str, model: str = "m", tokens: int = 3) -> pb.RunRequest:
    return pb.RunRequest(run_id=run_id, model=model, sampling=pb.Sampling(max_tokens=tokens))


@pytest.fixture
async def listen(pki: Pki) -> AsyncIterator[StartListener]:
    """Start listeners for edges with the given handler and limits; all closed after the test."""
    listeners: list[Listener] = []

    async def start(handler: Handler, connection: ConnectionConfig = FAST, name: str = "test-node") -> Listener:
        config = ListenerConfig(
            tls=pki.config(name, Role.NODE), allowed_roles=frozenset({Role.EDGE, Role.NODE}), connection=connection
        )
        listeners.append(await Listener(config, handler).start())
        return listeners[-1]

    yield start
    for listener in listeners:
        await listener.close()


def _open(connection: Connection) -> bool:
    return not connection.closed


def _dial(listener: Listener, tls: TlsConfig, codec: str = "proto", config: ConnectionConfig = FAST) -> dial:
    return dial("127.0.0.1", listener.port, tls=tls, codec=codec, server_hostname="localhost", config=config)


# -- the handler table -------------------------------------------------------------------------


class _Table:
    """Message handlers that answer, stay silent, refuse, or fail."""

    def __init__(self) -> None:
        self.statuses: list[Inbound] = []

    async def capability(self, inbound: Inbound) -> None:
        reply = pb.Envelope(in_reply_to="a stale id", capability_response=pb.CapabilityResponse(node_id="table"))
        await inbound.reply(reply)  # reply() names the request, whatever was there

    async def status(self, inbound: Inbound) -> None:
        self.statuses.append(inbound)

    async def register(self, inbound: Inbound) -> None:
        raise IopError(pb.ERROR_CODE_PERMISSION_DENIED, f"{inbound.peer.name} may not register here")

    async def drain(self, inbound: Inbound) -> None:
        raise RuntimeError("a bug in the handler")

    def handler(self) -> Handler:
        messages = {
            "capability_request": self.capability,
            "node_status": self.status,
            "node_register": self.register,
            "node_drain": self.drain,
        }
        return Handler(run=EchoHandler().run, messages=messages)


async def test_handler_table_routes_by_body_and_replies_name_the_request(
    listen: StartListener, edge_tls: TlsConfig
) -> None:
    table = _Table()
    listener = await listen(table.handler())
    async with _dial(listener, edge_tls) as client:
        reply = await client.request(pb.Envelope(id="ask-1", capability_request=pb.CapabilityRequest()))
        assert reply.in_reply_to == "ask-1" and reply.capability_response.node_id == "table"
        assert reply.id and reply.HasField("sent_at")
        await client.send(pb.Envelope(node_status=pb.NodeStatus(node_id="n1", in_flight=2)))
        await assert_eventually(lambda: len(table.statuses) == 1)
        (status,) = table.statuses
        assert status.envelope.node_status.in_flight == 2
        assert (status.peer.name, status.peer.role) == ("test-edge", Role.EDGE) and status.peer.serial
        assert status.connection in listener.connections
        events = [e async for e in await client.open_run(_request("r"))]  # runs go to run=
        assert events[-1].WhichOneof("event") == "complete"


@pytest.mark.parametrize(
    ("envelope", "message"),
    [
        (pb.Envelope(node_registered=pb.NodeRegistered()), "unknown message type node_registered"),
        (pb.Envelope(), "unknown message type (none)"),  # e.g. a body field from a newer version
    ],
    ids=["not-in-table", "no-body"],
)
async def test_unknown_body_type_is_answered_and_the_connection_goes_on(
    listen: StartListener, edge_tls: TlsConfig, envelope: pb.Envelope, message: str
) -> None:
    listener = await listen(_Table().handler())
    async with _dial(listener, edge_tls) as client:
        with pytest.raises(IopError) as caught:  # request() resolves only by in_reply_to
            await client.request(envelope)
        assert caught.value.code == pb.ERROR_CODE_UNKNOWN_MESSAGE_TYPE and caught.value.message == message
        assert (await client.capabilities()).node_id == "table"


async def test_handler_refusal_is_the_reply(listen: StartListener, edge_tls: TlsConfig) -> None:
    listener = await listen(_Table().handler())
    async with _dial(listener, edge_tls) as client:
        with pytest.raises(IopError) as caught:
            await client.request(pb.Envelope(node_register=pb.NodeRegister(node_id="n1")))
        assert caught.value.code == pb.ERROR_CODE_PERMISSION_DENIED
        assert caught.value.message == "test-edge may not register here"
        assert not client.closed and (await client.capabilities()).node_id == "table"


async def test_handler_refusal_keeps_retryable(listen: StartListener, edge_tls: TlsConfig) -> None:
    async def busy(inbound: Inbound) -> None:
        raise IopError(pb.ERROR_CODE_UNAVAILABLE, "backend restarting", retryable=True)

    listener = await listen(Handler(messages={"capability_request": busy}))
    async with _dial(listener, edge_tls) as client:
        with pytest.raises(IopError) as caught:
            await client.capabilities()
    assert caught.value.code == pb.ERROR_CODE_UNAVAILABLE and caught.value.retryable


async def test_handler_bug_is_answered_internal_and_the_connection_goes_on(
    listen: StartListener, edge_tls: TlsConfig
) -> None:
    listener = await listen(_Table().handler())
    async with _dial(listener, edge_tls) as client:
        with captured() as logs, pytest.raises(IopError) as caught:
            await client.request(pb.Envelope(node_drain=pb.NodeDrain(reason="test")))
        assert caught.value.code == pb.ERROR_CODE_INTERNAL and caught.value.message == "internal error"
        assert "a bug" not in caught.value.message  # the exception's text stays on this side
        failure = next(e for e in logs if e["event"] == "message handler failed")
        assert failure["message"] == "node_drain" and failure["exc_info"]
        assert not client.closed and (await client.capabilities()).node_id == "table"


async def test_requests_over_max_requests_are_refused(listen: StartListener, edge_tls: TlsConfig) -> None:
    release = asyncio.Event()

    async def slow(inbound: Inbound) -> None:
        await release.wait()
        await inbound.reply(pb.Envelope(capability_response=pb.CapabilityResponse(node_id="slow")))

    listener = await listen(Handler(messages={"capability_request": slow}), ConnectionConfig(max_requests=2))
    before = _limit_hits("requests_per_connection")
    async with _dial(listener, edge_tls) as client:
        waiting = [asyncio.create_task(client.capabilities()) for _ in range(2)]
        await assert_eventually(lambda: sum(len(c._requests) for c in listener.connections) == 2)
        with captured() as logs, pytest.raises(IopError) as caught:
            await client.capabilities()
        assert caught.value.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED
        assert any(e["event"] == "request refused" for e in logs)
        assert _limit_hits("requests_per_connection") - before == 1
        release.set()
        assert [answer.node_id for answer in await asyncio.gather(*waiting)] == ["slow", "slow"]
        assert (await client.capabilities()).node_id == "slow"  # places free up again


# -- dial and Listener as context managers -----------------------------------------------------


async def test_dial_context_closes_the_connection(listen: StartListener, edge_tls: TlsConfig) -> None:
    listener = await listen(EchoHandler().wire())
    async with _dial(listener, edge_tls) as client:
        assert _open(client)
        await assert_eventually(lambda: len(listener.connections) == 1)
    assert client.closed and client.close_error is not None
    assert client.close_error.code == pb.ERROR_CODE_SHUTTING_DOWN
    await assert_eventually(lambda: not listener.connections)


async def test_listener_context_starts_and_closes(pki: Pki, edge_tls: TlsConfig) -> None:
    config = ListenerConfig(tls=pki.config("test-node", Role.NODE), connection=FAST)
    async with Listener(config, EchoHandler().wire()) as listener:
        port = listener.port
        client = await _dial(listener, edge_tls)
        stream = await client.open_run(_request("hang", model="hang"))
        assert (await anext(stream)).WhichOneof("event") == "start"
    last = await anext(stream)  # the listener's close ended the run, retryably
    assert last.error.code == pb.ERROR_CODE_SHUTTING_DOWN and last.error.retryable
    await asyncio.wait_for(client.wait_closed(), 5)
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


# -- relay: a run forwarded from one connection to another -------------------------------------


class _Middle:
    """Serves each run by opening it on a backend connection and relaying its events."""

    def __init__(self) -> None:
        self.backend: Connection | None = None

    async def run(self, request: pb.RunRequest, sink: EventSink) -> None:
        assert self.backend is not None
        upstream = pb.RunRequest()
        upstream.CopyFrom(request)
        upstream.run_id = f"backend-{request.run_id}"  # the backend's run has an id of its own
        stream = await self.backend.open_run(upstream)
        terminal = await relay(stream, sink)
        await sink.forward(*terminal)


@pytest.fixture(
    params=[
        "proto-proto",
        "json-proto",
        "proto-json",
        "json-json",
    ]
)
def codecs(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(client <-> middle codec, middle <-> backend codec)."""
    client, backend = request.param.split("-")
    return client, backend


@pytest.fixture
async def relayed(
    listen: StartListener, pki: Pki, edge_tls: TlsConfig, codecs: tuple[str, str]
) -> AsyncIterator[tuple[Connection, EchoHandler]]:
    """A client connected to a middle listener that relays every run to an EchoHandler backend."""
    backend_handler, middle = EchoHandler(), _Middle()
    backend = await listen(backend_handler.wire(), name="backend")
    front = await listen(Handler(run=middle.run), name="middle")
    middle.backend = await _dial(backend, pki.config("middle", Role.NODE), codec=codecs[1])
    async with _dial(front, edge_tls, codec=codecs[0]) as client:
        yield client, backend_handler
    await middle.backend.close()


async def _frames(client: Connection, run_id: str, codec: str, **request: Any) -> list[pb.Envelope]:
    """A run's events as the envelopes the client received."""
    stream = await client.open_run(_request(run_id, **request))
    envelopes = []
    while not stream.finished:
        event, body = await asyncio.wait_for(stream.next_frame(), 2)
        envelope = get_codec(codec).decode(body)
        assert envelope.run_event == event
        envelopes.append(envelope)
    return envelopes


async def test_relay_forwards_gapless_under_the_clients_run_id(
    relayed: tuple[Connection, EchoHandler], codecs: tuple[str, str]
) -> None:
    client, _ = relayed
    envelopes = await _frames(client, "client-run", codecs[0], tokens=50)
    assert {e.run_id for e in envelopes} == {"client-run"}
    assert [e.run_event.sequence for e in envelopes] == list(range(52))
    kinds = [e.run_event.WhichOneof("event") for e in envelopes]
    assert kinds == ["start", *["delta"] * 50, "complete"]
    assert "".join(e.run_event.delta.text for e in envelopes) == "".join(f"w{i} " for i in range(50))
    assert len({e.id for e in envelopes}) == 52


async def test_relay_forwards_a_backend_error_under_the_clients_run_id(
    relayed: tuple[Connection, EchoHandler], codecs: tuple[str, str]
) -> None:
    client, _ = relayed
    envelopes = await _frames(client, "client-fail", codecs[0], model="fail")
    assert [e.run_event.sequence for e in envelopes] == [0, 1]
    error = envelopes[-1].run_event.error
    assert (error.code, error.message, error.run_id) == (pb.ERROR_CODE_BACKEND_ERROR, "backend said no", "client-fail")


async def test_cancelling_the_clients_run_cancels_the_backend_run(relayed: tuple[Connection, EchoHandler]) -> None:
    client, backend = relayed
    stream = await client.open_run(_request("client-hang", model="hang"))
    assert (await asyncio.wait_for(anext(stream), 2)).WhichOneof("event") == "start"
    await stream.cancel("user pressed stop")
    last = await asyncio.wait_for(anext(stream), 2)
    assert last.error.code == pb.ERROR_CODE_CANCELLED and "user pressed stop" in last.error.message
    await assert_eventually(lambda: backend.cancelled == ["user pressed stop"])


# -- KeepConnected -----------------------------------------------------------------------------


async def test_keep_connected_redials_and_runs_its_session_per_connection(
    listen: StartListener, edge_tls: TlsConfig
) -> None:
    listener = await listen(EchoHandler().wire())
    sessions: list[tuple[Connection, str]] = []

    async def session(connection: Connection) -> None:  # on-connect work on every new connection
        sessions.append((connection, (await connection.capabilities()).node_id))

    target = Target("127.0.0.1", listener.port, tls=edge_tls, server_hostname="localhost", connection=FAST)
    async with KeepConnected(target, session, backoff=Backoff(initial=0.05, maximum=0.2)) as link:
        first = await link.connected(timeout=5)
        assert link.connects == 1 and sessions == [(first, "test-node")]
        await assert_eventually(lambda: len(listener.connections) == 1)
        (served,) = listener.connections
        await served.close("kicked")  # the server ends the connection: the link dials again
        await assert_eventually(lambda: link.connects == 2)
        second = await link.connected(timeout=5)
        assert second is not first and not _open(first) and _open(second)
        assert sessions == [(first, "test-node"), (second, "test-node")]
        task = link._task
    assert second.closed and link.connection is None  # stop() closed it ...
    assert task is not None and task.done()  # ... and ended the loop: no more dialing
    await assert_eventually(lambda: not listener.connections)
    assert link.connects == 2


async def test_keep_connected_retries_until_the_peer_comes_up(pki: Pki, edge_tls: TlsConfig) -> None:
    with socket.socket() as probe:  # a port with nobody listening, for now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    target = Target("127.0.0.1", port, tls=edge_tls, server_hostname="localhost", connection=FAST)
    with captured() as logs:
        async with KeepConnected(target, backoff=Backoff(initial=0.02, maximum=0.05)) as link:
            await assert_eventually(lambda: sum(e["event"] == "peer unreachable" for e in logs) >= 3)
            config = ListenerConfig(port=port, tls=pki.config("late-node", Role.NODE), connection=FAST)
            async with Listener(config, EchoHandler().wire()):
                connection = await link.connected(timeout=5)
                assert connection.peer.name == "late-node" and link.connects == 1
    assert all(e["address"] == f"127.0.0.1:{port}" for e in logs if e["event"] == "peer unreachable")


@pytest.mark.parametrize(("failures", "base"), [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (4, 4.0), (10_000, 4.0)])
def test_backoff_doubles_to_its_maximum_with_jitter(failures: int, base: float) -> None:
    backoff = Backoff(initial=0.5, maximum=4.0)
    delays = [backoff.delay(failures) for _ in range(500)]
    assert all(0.5 * base <= delay <= base for delay in delays)
    assert max(delays) - min(delays) > 0.25 * base  # jittered: redials of many peers spread out


# -- identity ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "acts_for_others"),
    [
        (Role.EDGE, True),
        (Role.WORKER, True),
        (Role.CONTROL_PLANE, True),
        (Role.NODE, False),
        (Role.ADMIN, False),
        (None, False),
    ],
)
def test_only_trusted_roles_may_name_the_caller(role: Role | None, acts_for_others: bool) -> None:
    peer = PeerIdentity("cert-name", role)
    assert acting_caller(peer, "api-key-7") == ("api-key-7" if acts_for_others else "cert-name")
    assert acting_caller(peer, "") == "cert-name"


# -- liveness is about the peer, not about our own backpressure --------------------------------


async def _scripted_node(pki: Pki, script: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> asyncio.Server:
    """A hand-written node: accepts the preface, reads one run.request, then runs ``script``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def read_frame() -> bytes:
            return await reader.readexactly(int.from_bytes(await reader.readexactly(HEADER_SIZE), "big"))

        assert await read_frame() == b"IOP/1 proto"
        writer.write(preface("proto"))
        assert get_codec("proto").decode(await read_frame()).WhichOneof("body") == "run_request"
        await script(writer)
        await reader.read()  # until the client closes
        writer.close()

    context = server_context(pki.config("scripted-node", Role.NODE))
    return await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)


def _event_frame(sequence: int, event: pb.RunEvent) -> bytes:
    event.sequence = sequence
    envelope = pb.Envelope(id=f"e{sequence}", run_id="r", run_event=event)
    return bytes(encode_frame(get_codec("proto").encode(envelope)))


async def test_a_slow_reader_of_a_run_is_not_taken_for_a_slow_peer(pki: Pki, edge_tls: TlsConfig) -> None:
    async def script(writer: asyncio.StreamWriter) -> None:
        frames = [_event_frame(0, pb.RunEvent(start=pb.RunStart(node_id="scripted")))]
        frames += [_event_frame(i, pb.RunEvent(delta=pb.RunDelta(text=f"w{i} "))) for i in range(1, 11)]
        frames.append(_event_frame(11, pb.RunEvent(complete=pb.RunComplete(finish_reason=pb.FINISH_REASON_STOP))))
        stream = b"".join(frames)
        cut = len(stream) - len(frames[-1]) // 2
        writer.write(stream[:cut])  # ten whole events and half of the last ...
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(stream[cut:])  # ... whose rest follows at once

    node = await _scripted_node(pki, script)
    config = ConnectionConfig(heartbeat_interval=5.0, frame_timeout=0.3)
    port = node.sockets[0].getsockname()[1]
    async with dial("127.0.0.1", port, tls=edge_tls, server_hostname="localhost", config=config) as client:
        stream = await client.open_run(_request("r"))
        assert (await anext(stream)).WhichOneof("event") == "start"
        await assert_eventually(lambda: stream.buffered == 11)  # our reader is behind, not the node
        await asyncio.sleep(1.0)  # the reader takes its time (a slow downstream), longer than frame_timeout
        events = [event async for event in stream]
        assert not client.closed, client.close_error
    node.close()
    await node.wait_closed()
    assert [e.sequence for e in events] == list(range(1, 12)) and events[-1].WhichOneof("event") == "complete"


async def test_a_connection_says_when_it_begins_to_close_and_where_its_peer_is(
    listen: StartListener, edge_tls: TlsConfig
) -> None:
    listener = await listen(Handler())
    client = await dial("127.0.0.1", listener.port, tls=edge_tls, server_hostname="localhost", config=FAST)
    await assert_eventually(lambda: len(listener.connections) == 1)
    (served,) = listener.connections
    host, port = client._writer.get_extra_info("sockname")[:2]
    assert served.address == f"{host}:{port}"
    closing = asyncio.create_task(served.wait_closing())
    await asyncio.sleep(0)
    assert not closing.done()
    client._writer.transport.abort()  # the peer vanishes
    await asyncio.wait_for(closing, 5)
    assert served.closed
