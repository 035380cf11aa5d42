"""Runs over several control-planes (``iop_wire.failover``), against peers written with the wire API:
a connection that dies before the run's first output is left for another peer, and the reader
sees one clean stream; after output the run is continued on another peer (one stream, numbered
on, nothing repeated), or ends NODE_LOST (retryable) saying why it could not be."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from conftest import Pki, assert_eventually
from node_helpers import chat, kinds, text

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import ConnectionConfig, Handler
from iop_wire.dialer import KeepConnected, Links, Target
from iop_wire.endpoint import Listener, ListenerConfig
from iop_wire.errors import IopError
from iop_wire.failover import DEFAULT_MIGRATIONS, open_run_anywhere
from iop_wire.metrics import REGISTRY
from iop_wire.runs import EventSink
from iop_wire.tls import Role

Serve = Callable[[pb.RunRequest, EventSink, Listener], Awaitable[None]]


class Peer:
    """A control-plane stand-in serving runs with ``serve``; it can die (close every connection) at will."""

    def __init__(self, pki: Pki, serve: Serve) -> None:
        self.pki, self.serve = pki, serve
        self.runs: list[str] = []
        self.continued: list[str] = []
        """The runs it was sent with a continuation."""
        self.listener: Listener | None = None
        self.port = 0

    async def start(self) -> Peer:
        async def run(request: pb.RunRequest, sink: EventSink) -> None:
            self.runs.append(request.run_id)
            if request.HasField("continuation"):
                self.continued.append(request.run_id)
            assert self.listener is not None
            await self.serve(request, sink, self.listener)

        config = ListenerConfig(
            tls=self.pki.config("cp", Role.CONTROL_PLANE),
            allowed_roles=frozenset({Role.EDGE}),
            connection=ConnectionConfig(heartbeat_interval=0.5),
        )
        self.listener = await Listener(config, Handler(run=run)).start()
        self.port = self.listener.port
        return self

    @property
    def address(self) -> str:
        return f"localhost:{self.port}"


async def _answer(request: pb.RunRequest, sink: EventSink, listener: Listener) -> None:
    await sink.start(node_id="n", model=request.model, adapter="fake")
    for word in ("one", "two", "three"):
        await sink.delta(word + " ")
    await sink.complete(pb.FINISH_REASON_STOP)


def _crash(sink: EventSink, listener: Listener) -> None:
    """The peer process killed, as its dialer sees it: no goodbye, the socket reset; it listens no more."""
    listener.stop_accepting()
    sink._connection._writer.transport.abort()  # type: ignore[attr-defined]


async def _die_before_output(request: pb.RunRequest, sink: EventSink, listener: Listener) -> None:
    await sink.start(node_id="n", model=request.model, adapter="fake")
    await asyncio.sleep(0.05)
    _crash(sink, listener)
    await asyncio.sleep(10)


async def _die_after_output(request: pb.RunRequest, sink: EventSink, listener: Listener) -> None:
    await sink.start(node_id="n", model=request.model, adapter="fake")
    await sink.delta("one ")
    await asyncio.sleep(0.05)
    _crash(sink, listener)
    await asyncio.sleep(10)


_WORDS = ("one ", "two ", "three ", "four ", "five ")


def _cut_after(outputs: int) -> Serve:
    """A peer serving the five words from where the request's continuation ends, and dying after ``outputs`` of them."""

    async def serve(request: pb.RunRequest, sink: EventSink, listener: Listener) -> None:
        await sink.start(node_id="n", model=request.model, adapter="fake")
        delivered = request.continuation.completion_tokens
        assert request.continuation.text == "".join(_WORDS[:delivered]), "the continuation is what the reader got"
        for word in _WORDS[delivered : delivered + outputs]:
            await sink.delta(word)
        if delivered + outputs < len(_WORDS):
            await asyncio.sleep(0.05)
            _crash(sink, listener)
            await asyncio.sleep(10)
        usage = pb.Usage(prompt_tokens=2, completion_tokens=len(_WORDS))
        usage.continuation_prompt_tokens = request.continuation.continuation_prompt_tokens + delivered
        await sink.complete(pb.FINISH_REASON_STOP, usage)

    return serve


def _cut_then_refuse(refusal: IopError) -> Serve:
    """Dies after one word; answers a continuation with ``refusal`` (a control-plane or node that cannot continue)."""

    async def serve(request: pb.RunRequest, sink: EventSink, listener: Listener) -> None:
        if request.HasField("continuation"):
            await sink.error(refusal)
            return
        await _cut_after(1)(request, sink, listener)

    return serve


async def _tool_call_then_die(request: pb.RunRequest, sink: EventSink, listener: Listener) -> None:
    await sink.start(node_id="n", model=request.model, adapter="fake")
    await sink.output(pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, id="call-1")]))
    await asyncio.sleep(0.05)
    _crash(sink, listener)
    await asyncio.sleep(10)


async def _embed_then_die(request: pb.RunRequest, sink: EventSink, listener: Listener) -> None:
    await sink.start(node_id="n", model=request.model, adapter="fake")
    await sink.output(pb.RunDelta(embeddings=[pb.Embedding(index=0, values=[0.5])]))
    await asyncio.sleep(0.05)
    _crash(sink, listener)
    await asyncio.sleep(10)


async def _shutting_down(request: pb.RunRequest, sink: EventSink, listener: Listener) -> None:
    await sink.error(IopError(pb.ERROR_CODE_SHUTTING_DOWN, "stopping", retryable=True))


@asynccontextmanager
async def _links(pki: Pki, *peers: Peer) -> AsyncIterator[Links]:
    tls = pki.config("edge-t", Role.EDGE)
    config = ConnectionConfig(heartbeat_interval=0.5)
    links = Links([KeepConnected(Target("localhost", p.port, tls=tls, connection=config)) for p in peers])
    links.start()
    try:
        await assert_eventually(lambda: len(links.up()) == len(peers))
        yield links
    finally:
        await links.stop()
        for peer in peers:
            assert peer.listener is not None
            await peer.listener.close()


def _failovers(outcome: str) -> float:
    return REGISTRY.get_sample_value("iop_wire_run_failovers_total", {"outcome": outcome}) or 0.0


async def _read(
    links: Links, request: pb.RunRequest, migrations: int = DEFAULT_MIGRATIONS
) -> tuple[list[pb.RunEvent], int]:
    stream = await open_run_anywhere(links, request, migrations=migrations)
    async with asyncio.timeout(10), stream:
        events = [event async for event in stream]
    return events, stream.reopened + stream.migrated


@pytest.mark.parametrize("dying", [_die_before_output, _shutting_down], ids=["connection-lost", "shutting-down"])
async def test_a_run_left_before_output_is_opened_again_and_read_as_one_stream(pki: Pki, dying: Serve) -> None:
    doomed, healthy = await Peer(pki, dying).start(), await Peer(pki, _answer).start()
    async with _links(pki, doomed, healthy) as links:
        for _ in range(2):  # whichever peer the turn starts with
            before = _failovers("reopened")
            events, reopened = await _read(links, chat())
            assert _failovers("reopened") - before == reopened
            assert kinds(events) == ["start", "delta", "delta", "delta", "complete"], "one start, nothing lost"
            assert text(events) == "one two three "
            if doomed.runs and reopened:
                break
        assert doomed.runs and healthy.runs


async def test_a_run_lost_after_output_ends_node_lost_retryable(pki: Pki) -> None:
    doomed = await Peer(pki, _die_after_output).start()
    before = _failovers("lost_after_output")
    async with _links(pki, doomed) as links:
        events, reopened = await _read(links, chat())
    assert kinds(events) == ["start", "delta", "error"] and reopened == 0
    assert _failovers("lost_after_output") == before + 1
    error = events[-1].error
    assert error.code == pb.ERROR_CODE_NODE_LOST and error.retryable
    assert doomed.address in error.message and "after 1 output" in error.message
    assert "not continued: no other control-plane" in error.message


async def test_a_run_with_no_peer_left_ends_with_the_retryable_loss(pki: Pki) -> None:
    doomed = await Peer(pki, _die_before_output).start()
    before = _failovers("none_left")
    async with _links(pki, doomed) as links:
        events, reopened = await _read(links, chat())
    assert kinds(events) == ["start", "error"] and reopened == 0
    assert _failovers("none_left") == before + 1
    assert events[-1].error.retryable and events[-1].error.code != pb.ERROR_CODE_NODE_LOST


async def test_a_cancelled_run_is_not_opened_again(pki: Pki) -> None:
    slow, healthy = await Peer(pki, _die_before_output).start(), await Peer(pki, _answer).start()
    async with _links(pki, slow, healthy) as links:
        while True:
            stream = await open_run_anywhere(links, chat())
            if stream.address == slow.address:
                break
            [event async for event in stream]
        await assert_eventually(lambda: bool(slow.runs))  # a run cancelled before it started is another matter
        stream.cancel_nowait("the client went away")
        async with asyncio.timeout(10):
            events = [event async for event in stream]
    assert kinds(events)[-1] == "error" and stream.reopened == 0


async def test_a_run_cut_after_output_is_continued_on_another_peer_as_one_stream(pki: Pki) -> None:
    first, second = await Peer(pki, _cut_after(3)).start(), await Peer(pki, _cut_after(3)).start()
    before = _failovers("continued")
    async with _links(pki, first, second) as links:
        events, moved = await _read(links, chat())
    assert kinds(events) == ["start", "delta", "delta", "delta", "delta", "delta", "complete"], "one start"
    assert text(events) == "".join(_WORDS), "nothing repeated, nothing missing"
    assert [event.sequence for event in events] == list(range(7)), "numbered on from the last event read"
    usage = events[-1].complete.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.continuation_prompt_tokens) == (2, 5, 3)
    assert moved == 1 and _failovers("continued") == before + 1
    assert len(first.runs) == len(second.runs) == 1 and len(first.continued + second.continued) == 1


def _stop_after(outputs: int) -> Serve:
    """A peer that stops gracefully after ``outputs`` words (SHUTTING_DOWN over its open connection), and
    serves the rest of a continuation."""
    cut = _cut_after(len(_WORDS))

    async def serve(request: pb.RunRequest, sink: EventSink, listener: Listener) -> None:
        if request.HasField("continuation"):
            await cut(request, sink, listener)
            return
        await sink.start(node_id="n", model=request.model, adapter="fake")
        for word in _WORDS[:outputs]:
            await sink.delta(word)
        await sink.error(IopError(pb.ERROR_CODE_SHUTTING_DOWN, "the control-plane is stopping", retryable=True))

    return serve


async def test_a_run_whose_control_plane_stops_after_output_is_continued(pki: Pki) -> None:
    first, second = await Peer(pki, _stop_after(2)).start(), await Peer(pki, _stop_after(2)).start()
    async with _links(pki, first, second) as links:
        events, moved = await _read(links, chat())
    assert kinds(events)[-1] == "complete", events[-1]
    assert text(events) == "".join(_WORDS) and [event.sequence for event in events] == list(range(7))
    assert moved == 1 and events[-1].complete.usage.continuation_prompt_tokens == 2


async def test_a_run_is_continued_at_most_migrations_times(pki: Pki) -> None:
    peers = [await Peer(pki, _cut_after(1)).start() for _ in range(3)]
    async with _links(pki, *peers) as links:
        events, moved = await _read(links, chat(), migrations=1)
    assert kinds(events) == ["start", "delta", "delta", "error"] and moved == 1
    assert text(events) == "one two " and [event.sequence for event in events] == [0, 1, 2, 3]
    error = events[-1].error
    assert error.code == pb.ERROR_CODE_NODE_LOST and error.retryable
    assert "after 2 output(s)" in error.message and "(migrations: 1)" in error.message


async def test_a_run_is_not_continued_with_migrations_0_or_past_its_deadline(pki: Pki) -> None:
    first, second = await Peer(pki, _cut_after(1)).start(), await Peer(pki, _cut_after(1)).start()
    async with _links(pki, first, second) as links:
        events, moved = await _read(links, chat(), migrations=0)
        assert kinds(events) == ["start", "delta", "error"] and moved == 0
        assert "(migrations: 0)" in events[-1].error.message
        late = chat()
        late.deadline.FromNanoseconds(time.time_ns() + 10_000_000)  # past by the time the connection is lost
        events, moved = await _read(links, late)
    assert kinds(events) == ["start", "delta", "error"] and moved == 0
    assert events[-1].error.code == pb.ERROR_CODE_NODE_LOST and "its deadline passed" in events[-1].error.message


@pytest.mark.parametrize(
    ("refusal", "why"),
    [
        (
            IopError(pb.ERROR_CODE_UNAVAILABLE, "no node can continue it", retryable=True),
            "no other control-plane could take it (the last one answered UNAVAILABLE: no node can continue it)",
        ),
        (
            IopError(pb.ERROR_CODE_INVALID_ARGUMENT, "the cli adapter cannot continue", param="continuation"),
            "the control-plane at {refuser} answered INVALID_ARGUMENT: the cli adapter cannot continue",
        ),
    ],
    ids=["retryable-refusal-tried-elsewhere", "refusal-for-good"],
)
async def test_a_refused_continuation_ends_node_lost_quoting_the_refusal(pki: Pki, refusal: IopError, why: str) -> None:
    first, second = [await Peer(pki, _cut_then_refuse(refusal)).start() for _ in range(2)]
    async with _links(pki, first, second) as links:
        events, moved = await _read(links, chat())
    assert kinds(events) == ["start", "delta", "error"] and moved == 1
    assert [event.sequence for event in events] == [0, 1, 2]
    error = events[-1].error
    assert error.code == pb.ERROR_CODE_NODE_LOST and error.retryable, "the client sends the run again"
    cut, refuser = (second, first) if first.continued else (first, second)
    assert f"control-plane at {cut.address} was lost after 1 output(s)" in error.message, "not the refuser"
    assert f"not continued: {why.format(refuser=refuser.address)}" in error.message, error.message


@pytest.mark.parametrize(
    ("dying", "why"),
    [(_tool_call_then_die, "tool calls are not continued"), (_embed_then_die, "embeddings are not continued")],
    ids=["tool-call", "embedding"],
)
async def test_output_that_cannot_be_handed_on_ends_node_lost_saying_why(pki: Pki, dying: Serve, why: str) -> None:
    first, second = await Peer(pki, dying).start(), await Peer(pki, dying).start()
    before = _failovers("lost_after_output")
    async with _links(pki, first, second) as links:
        events, moved = await _read(links, chat())
    assert kinds(events) == ["start", "delta", "error"] and moved == 0
    assert [event.sequence for event in events] == [0, 1, 2]
    error = events[-1].error
    assert error.code == pb.ERROR_CODE_NODE_LOST and error.retryable and why in error.message
    assert _failovers("lost_after_output") == before + 1
    assert len(first.runs) + len(second.runs) == 1, "no second attempt"
