"""EventSink's ordering: start goes out after the run's current step, and always first."""

from __future__ import annotations

import asyncio

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.errors import ErrorCode, IopError
from iop_wire.runs import EventSink
from iop_wire.tls import ANONYMOUS


class Recorder:
    """The connection side of a sink: keeps what would be written, in order."""

    peer = ANONYMOUS

    def __init__(self) -> None:
        self.closed = False
        self.sent: list[pb.RunEvent] = []

    async def send(self, envelope: pb.Envelope, *, urgent: bool = False) -> None:
        self.send_nowait(envelope)

    def send_nowait(self, envelope: pb.Envelope) -> None:
        self.sent.append(envelope.run_event)

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
    sink.fail_now(IopError(ErrorCode.SHUTTING_DOWN, "closing"))
    await asyncio.sleep(0)
    assert recorder.kinds() == [("start", 0), ("error", 1)]


async def test_no_start_is_written_once_the_connection_closed() -> None:
    recorder = Recorder()
    sink = EventSink(recorder, "r4")
    await sink.start(node_id="n", model="m", adapter="a")
    recorder.closed = True
    await asyncio.sleep(0)
    assert recorder.sent == []
