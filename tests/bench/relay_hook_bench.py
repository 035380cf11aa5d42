"""What keeping a run's output to continue it costs the control-plane's relay, per event (no processes).

``iop_wire.relay`` forwards 20,000 delta events of one run (as a node sends them: protobuf bodies)
into an EventSink whose connection frames each one and sends nothing, three ways, interleaved:
without a hook (a policy with ``migrations: 0``), with the control-plane's hook (the relay keeps
the bodies as received and decodes them only at a migration) and with ``Delivered.add`` on every
delta (reading each one's fields as it passes). Process CPU per event, min and median of 15
rounds. Prints a table; asserts nothing.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

from table import print_table

from iop_control_plane.relay import _Output
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import get_codec
from iop_wire.continuation import Delivered
from iop_wire.framing import encode_frame
from iop_wire.runs import EventSink, RunStream, relay

EVENTS, ROUNDS = 20_000, 15
Hook = Callable[[pb.RunEvent, bytes], None] | None


class _Framing:
    """The part of a connection an EventSink uses: frames are built, and dropped."""

    peer = None
    id = "requester"
    closed = False
    codec = get_codec("proto")

    def frame(self, envelope: pb.Envelope) -> bytearray:
        return encode_frame(envelope.SerializeToString())

    def frame_body(self, body: bytes) -> bytearray:
        return encode_frame(body)

    def next_id(self) -> str:
        return "e"

    async def send_frame(self, frame: bytes | bytearray, *, urgent: bool = False) -> None:
        return None

    def send_frame_nowait(self, frame: bytes | bytearray, *, urgent: bool = False) -> None:
        return None


def _events() -> list[tuple[pb.RunEvent, bytes]]:
    """A run's deltas and complete as a node sends them (one word each), decoded as a connection does."""
    events = []
    for number in range(EVENTS + 1):
        envelope = pb.Envelope(id=f"id-{number}", run_id="0123456789abcdef.run-1.1")
        envelope.run_event.sequence = number
        if number < EVENTS:
            envelope.run_event.delta.text = "word "
        else:
            envelope.run_event.complete.finish_reason = pb.FINISH_REASON_STOP
        body = envelope.SerializeToString()
        events.append((pb.Envelope.FromString(body).run_event, body))
    return events


async def _round(events: list[tuple[pb.RunEvent, bytes]], hook: Hook) -> float:
    """Relay CPU per event, in us."""
    stream = RunStream("run", lambda run_id, reason: None)
    for event, body in events:
        stream.put_nowait(event, body)
    sink = EventSink(_Framing(), "run-1")  # type: ignore[arg-type] # framing only: nothing is sent
    began = time.process_time()
    await relay(stream, sink, on_delta=hook)
    return (time.process_time() - began) / EVENTS * 1e6


def _every_delta(delivered: Delivered) -> Hook:
    """A hook that reads every delta into ``delivered`` as it passes."""
    return lambda event, body: delivered.add(event.delta)


async def _measure() -> list[tuple[str, str]]:
    request, events = pb.RunRequest(model="m"), _events()
    samples: dict[str, list[float]] = {"no hook": [], "control-plane hook": [], "Delivered.add per delta": []}
    for _ in range(ROUNDS):
        every = Delivered(request)
        hooks: dict[str, Hook] = {
            "no hook": None,
            "control-plane hook": _Output(request).add,
            "Delivered.add per delta": _every_delta(every),
        }
        for name, hook in hooks.items():
            samples[name].append(await _round(events, hook))
    rows = []
    for name, values in samples.items():
        row = f"relay CPU per event, {name}: min / median of {ROUNDS}"
        rows.append((row, f"{min(values):.2f} / {statistics.median(values):.2f} us"))
    return rows


def main() -> None:
    print_table(asyncio.run(_measure()), unit="per event")


if __name__ == "__main__":
    main()
