"""EventSink: start first and after the step, gapless numbering, large deltas split, relaying."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import get_codec
from iop_wire.errors import IopError
from iop_wire.framing import DEFAULT_MAX_FRAME_SIZE, encode_frame
from iop_wire.runs import EventSink, RunStream, relay
from iop_wire.tls import ANONYMOUS


class Recorder:
    """The connection side of a sink: frames with the real codec and keeps what it would write."""

    peer = ANONYMOUS
    id = "c1"

    def __init__(self, codec: str = "proto", max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.closed = False
        self.codec = get_codec(codec)
        self.max_frame_size = max_frame_size
        self.frames: list[bytes] = []
        self._ids = itertools.count()

    @property
    def sent(self) -> list[pb.RunEvent]:
        return [self.codec.decode(bytes(frame[4:])).run_event for frame in self.frames]

    def next_id(self) -> str:
        return f"x{next(self._ids)}"

    def frame(self, envelope: pb.Envelope) -> bytearray:
        envelope.id = envelope.id or self.next_id()
        return encode_frame(self.codec.encode(envelope), self.max_frame_size)

    def frame_body(self, body: bytes) -> bytearray:
        return encode_frame(body, self.max_frame_size)

    async def send_frame(self, frame: bytes | bytearray, *, urgent: bool = False) -> None:
        self.send_frame_nowait(frame)

    def send_frame_nowait(self, frame: bytes | bytearray, *, urgent: bool = False) -> None:
        self.frames.append(bytes(frame))

    def kinds(self) -> list[tuple[str | None, int]]:
        return [(event.WhichOneof("event"), event.sequence) for event in self.sent]


async def test_start_waits_for_the_end_of_the_step_then_goes_out_alone() -> None:
    recorder = Recorder()
    sink = EventSink(recorder, "r1")
    await sink.start(node_id="n", model="m", adapter="a")
    assert recorder.sent == []  # the adapter's request would go out here, before the start
    await asyncio.sleep(0)
    assert recorder.kinds() == [("start", 0)]
    assert recorder.sent[0].start.node_id == "n"
    await sink.delta("x")
    assert recorder.kinds() == [("start", 0), ("delta", 1)]


async def test_an_event_in_the_same_step_sends_the_start_first_and_only_once() -> None:
    recorder = Recorder()
    sink = EventSink(recorder, "r2")
    await sink.start(node_id="n", model="m", adapter="a")
    await sink.delta("x")
    await sink.complete(pb.FINISH_REASON_STOP)
    await asyncio.sleep(0)
    assert recorder.kinds() == [("start", 0), ("delta", 1), ("complete", 2)]


async def test_a_connection_closing_before_the_step_ends_sends_the_start_then_the_error() -> None:
    recorder = Recorder()
    sink = EventSink(recorder, "r3")
    await sink.start(node_id="n", model="m", adapter="a")
    recorder.closed = True  # as Connection._shutdown does before it fails each run with fail_now
    sink.fail_now(IopError(pb.ERROR_CODE_SHUTTING_DOWN, "closing"))
    await asyncio.sleep(0)
    assert recorder.kinds() == [("start", 0), ("error", 1)]


async def test_no_start_is_written_once_the_connection_closed() -> None:
    recorder = Recorder()
    sink = EventSink(recorder, "r4")
    await sink.start(node_id="n", model="m", adapter="a")
    recorder.closed = True
    await asyncio.sleep(0)
    assert recorder.sent == []


def _vectors(count: int, size: int) -> list[pb.Embedding]:
    return [pb.Embedding(index=i, values=[float(i)] * size) for i in range(count)]


async def test_an_embedding_larger_than_a_frame_is_split_by_vector_with_a_gapless_sequence() -> None:
    recorder = Recorder()  # the real 4 MiB limit: 300 x 4096 floats is ~4.9 MB
    sink = EventSink(recorder, "emb")
    await sink.start(node_id="n", model="m", adapter="a")
    await sink.output(pb.RunDelta(embeddings=_vectors(300, 4096)))
    await sink.complete(pb.FINISH_REASON_STOP)
    kinds = recorder.kinds()
    assert [sequence for _, sequence in kinds] == list(range(len(kinds)))
    assert kinds[0][0] == "start" and kinds[-1][0] == "complete" and len(kinds) > 3
    arrived = [vector for event in recorder.sent for vector in event.delta.embeddings]
    assert [vector.index for vector in arrived] == list(range(300))
    assert all(len(vector.values) == 4096 and vector.values[0] == vector.index for vector in arrived)


@pytest.mark.parametrize("codec", ["proto", "json"])
async def test_text_larger_than_a_frame_is_split_by_size(codec: str) -> None:
    recorder = Recorder(codec, max_frame_size=2048)
    sink = EventSink(recorder, "txt")
    text = "".join(chr(0x4E00 + i % 500) for i in range(5000))  # 3 bytes each in UTF-8
    await sink.delta(text)
    await sink.complete(pb.FINISH_REASON_STOP)
    assert "".join(event.delta.text for event in recorder.sent) == text
    assert [event.sequence for event in recorder.sent] == list(range(len(recorder.sent)))
    assert all(len(frame) <= 2048 + 4 for frame in recorder.frames)


async def test_what_cannot_be_split_ends_the_run_at_the_next_number() -> None:
    recorder = Recorder(max_frame_size=4096)
    sink = EventSink(recorder, "big")
    await sink.delta("fits")
    with pytest.raises(IopError) as caught:  # one vector of 8 KB cannot be cut in two
        await sink.output(pb.RunDelta(embeddings=_vectors(1, 2048)))
    assert caught.value.code == pb.ERROR_CODE_FRAME_TOO_LARGE
    await sink.error(caught.value)  # what the connection does with a handler's IopError
    assert recorder.kinds() == [("delta", 0), ("error", 1)]
    assert "cannot be split" in recorder.sent[-1].error.message


def _received(run_id: str, events: list[pb.RunEvent]) -> list[tuple[pb.RunEvent, bytes]]:
    """Events as a connection delivers them to a RunStream: decoded, with the frame body."""
    bodies = []
    for sequence, event in enumerate(events):
        event.sequence = sequence
        body = pb.Envelope(id=str(sequence), run_id=run_id, run_event=event).SerializeToString()
        bodies.append((pb.Envelope.FromString(body).run_event, body))
    return bodies


@pytest.mark.parametrize("codec", ["proto", "json"])
async def test_relay_renumbers_into_the_requester_run_and_drops_a_second_start(codec: str) -> None:
    recorder = Recorder(codec)
    sink = EventSink(recorder, "edge-run")
    for attempt, events in enumerate(
        [
            [pb.RunEvent(start=pb.RunStart(node_id="a")), pb.RunEvent(error=pb.Error(code=pb.ERROR_CODE_UNAVAILABLE))],
            [
                pb.RunEvent(start=pb.RunStart(node_id="b")),
                pb.RunEvent(delta=pb.RunDelta(text="hi")),
                pb.RunEvent(error=pb.Error(code=pb.ERROR_CODE_BACKEND_ERROR, run_id="node-side")),
            ],
        ]
    ):
        stream = RunStream(f"node-side-{attempt}", lambda run_id, reason: None)
        for event, body in _received(f"node-side-{attempt}", events):
            if event.WhichOneof("event") == "error":
                stream.end(event, body)
            else:
                stream.put_nowait(event, body)
        terminal, body = await relay(stream, sink)
        assert terminal.WhichOneof("event") == "error"
    await sink.forward(terminal, body)  # the last attempt's end is the requester's
    sent = recorder.sent
    assert [(e.WhichOneof("event"), e.sequence) for e in sent] == [("start", 0), ("delta", 1), ("error", 2)]
    assert sent[0].start.node_id == "a" and sent[1].delta.text == "hi"
    assert sent[2].error.run_id == "edge-run" and sent[2].error.code == pb.ERROR_CODE_BACKEND_ERROR
    envelopes = [recorder.codec.decode(frame[4:]) for frame in recorder.frames]
    assert {envelope.run_id for envelope in envelopes} == {"edge-run"}
    assert len({envelope.id for envelope in envelopes}) == 3  # this connection's ids, not the node's


async def test_relay_cancels_upstream_when_the_requester_goes_away() -> None:
    cancelled: list[tuple[str, str]] = []
    stream = RunStream("up", lambda run_id, reason: cancelled.append((run_id, reason)))
    sink = EventSink(Recorder(), "down")
    sink.cancel_reason = "client went away"
    task = asyncio.create_task(relay(stream, sink))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled == [("up", "client went away")]
