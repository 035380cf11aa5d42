"""Wire benchmarks: codec throughput and events/s over one loopback mTLS connection.

Run with ``just bench``. Prints a table; asserts nothing (targets are in README).
The streaming server runs in its own process, so client and server each get a core.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from table import print_table

from iop_gen.bp import iop as bp
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import init_dir
from iop_wire.codec import get_codec
from iop_wire.connection import EventSink
from iop_wire.endpoint import Listener, ListenerConfig, dial
from iop_wire.framing import FrameDecoder, encode_frame
from iop_wire.logs import configure
from iop_wire.tls import TlsConfig

TEXT = "hello"


def _delta_envelope(sequence: int) -> pb.Envelope:
    """A delta envelope built as EventSink and Connection.send_nowait build one."""
    envelope = pb.Envelope(
        id=str(sequence),
        run_id="run-0123456789",
        run_event=pb.RunEvent(sequence=sequence, delta=pb.RunDelta(text=TEXT)),
    )
    envelope.sent_at.FromNanoseconds(time.time_ns())
    return envelope


def _rate(call: Callable[[], object], seconds: float = 1.0) -> float:
    """Calls of ``call`` per second, on this one core."""
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(1000):
            call()
        count += 1000
    return count / elapsed


def _codec_pair(name: str) -> tuple[Callable[[], object], Callable[[], object]]:
    codec, decoder = get_codec(name), FrameDecoder()
    frame = bytes(encode_frame(codec.encode(_delta_envelope(7))))

    def encode() -> object:
        return encode_frame(codec.encode(_delta_envelope(7)))

    def decode() -> object:
        return codec.decode(decoder.feed(frame)[0])

    return encode, decode


def _typed_pair() -> tuple[Callable[[], object], Callable[[], object]]:
    def build() -> bp.Envelope:
        return bp.Envelope(
            id="7", run_id="run-0123456789", run_event=bp.RunEvent(sequence=7, delta=bp.RunDelta(text=TEXT))
        )

    raw = bytes(build())
    return (lambda: bytes(build())), (lambda: bp.Envelope.parse(raw))


def codec_rows() -> list[tuple[str, float]]:
    """Encodes and decodes per second of a run.event delta envelope."""
    rows = []
    for name in ("proto", "json"):
        encode, decode = _codec_pair(name)
        rows.append((f"encode run.event delta, {name} codec (envelope + frame)", _rate(encode)))
        rows.append((f"decode run.event delta, {name} codec (frame + envelope)", _rate(decode)))
    encode, decode = _typed_pair()
    rows.append(("encode run.event delta, betterproto2 (reference only)", _rate(encode, 0.5)))
    rows.append(("decode run.event delta, betterproto2 (reference only)", _rate(decode, 0.5)))
    return rows


class _Streamer:
    """Streams ``max_tokens`` deltas per run as fast as the connection takes them."""

    async def run(self, request: pb.RunRequest, sink: EventSink) -> None:
        count = request.sampling.max_tokens
        await sink.start(node_id="bench", model=request.model, adapter="bench")
        for _ in range(count):
            await sink.delta(TEXT)
        await sink.complete(pb.FINISH_REASON_LENGTH)

    async def capabilities(self) -> bp.CapabilityResponse:
        return bp.CapabilityResponse(node_id="bench")

    async def message(self, connection: object, envelope: pb.Envelope) -> None:
        return None


async def _serve(certs: Path) -> None:
    tls = TlsConfig(enabled=True, cert=certs / "node.crt", key=certs / "node.key", ca=certs / "ca.crt")
    listener = await Listener(ListenerConfig(tls=tls), lambda peer: _Streamer()).start()
    print(listener.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await listener.close()


async def _stream(port: int, certs: Path, codec: str, runs: int, tokens: int) -> float:
    tls = TlsConfig(enabled=True, cert=certs / "edge.crt", key=certs / "edge.key", ca=certs / "ca.crt")
    connection = await dial("127.0.0.1", port, tls=tls, codec=codec, server_hostname="localhost")

    async def one(index: int) -> int:
        stream = await connection.open_run(
            bp.RunRequest(run_id=f"r{index}", model="bench", sampling=bp.Sampling(max_tokens=tokens))
        )
        return len([event async for event in stream])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(runs)))
    elapsed = time.perf_counter() - start
    await connection.close()
    return sum(counts) / elapsed


def stream_rows(total_events: int) -> list[tuple[str, float]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        certs = Path(tmp)
        init_dir(certs)
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(certs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            for codec in ("proto", "json"):
                for runs in (1, 100):
                    rate = asyncio.run(_stream(port, certs, codec, runs, total_events // runs))
                    rows.append((f"events/s over one mTLS connection, {codec}, {runs} run(s)", rate))
        finally:
            server.communicate("", timeout=10)
    return rows


def main() -> None:
    configure("warning")
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", type=Path)
    parser.add_argument("--events", type=int, default=200_000)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve))
        return
    rows = codec_rows() + stream_rows(args.events)
    print_table([(name, f"{rate:,.0f}") for name, rate in rows], unit="per second")


if __name__ == "__main__":
    main()
