"""A peer written by hand, for the tests that attack a listener: raw frames, heartbeats, reads."""

from __future__ import annotations

import asyncio
import itertools

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import get_codec
from iop_wire.framing import HEADER_SIZE, encode_frame

PROTO = get_codec("proto")


def frame(envelope: pb.Envelope) -> bytes:
    """``envelope`` as one protobuf frame."""
    return bytes(encode_frame(PROTO.encode(envelope)))


def heartbeat_frame(sequence: int, interval_ns: int) -> bytes:
    """A heartbeat announcing ``interval_ns``."""
    beat = pb.Heartbeat(sequence=sequence)
    beat.interval.FromNanoseconds(interval_ns)
    return frame(pb.Envelope(id=f"hb-{sequence}", heartbeat=beat))


async def heartbeats(writer: asyncio.StreamWriter, interval: float, *, announce: float | None = None) -> None:
    """Send a heartbeat every ``interval`` until the connection is gone: alive, but maybe reading nothing.

    ``announce`` is the interval the heartbeats promise (default ``interval``): a peer judged by a
    longer promise than it keeps is not declared silent by a moment's delay in the receiver's loop.
    """
    promised = int((announce or interval) * 1e9)
    for sequence in itertools.count():
        if writer.is_closing():
            return
        writer.write(heartbeat_frame(sequence, promised))
        await asyncio.sleep(interval)  # the protocol's own timer, not a wait for a condition


async def read_envelope(reader: asyncio.StreamReader, codec: str = "proto") -> pb.Envelope:
    """The next envelope that is not a heartbeat (5 s at most for its header)."""
    while True:
        size = int.from_bytes(await asyncio.wait_for(reader.readexactly(HEADER_SIZE), 5), "big")
        envelope = get_codec(codec).decode(await reader.readexactly(size))
        if envelope.WhichOneof("body") != "heartbeat":
            return envelope
