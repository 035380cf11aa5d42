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
from iop_wire.connection import EventSink, Handler
from iop_wire.endpoint import Listener, ListenerConfig, dial
from iop_wire.framing import FrameDecoder, encode_frame
from iop_wire.logs import configure
from iop_wire.runs import relay
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


async def _stream_deltas(request: pb.RunRequest, sink: EventSink) -> None:
    """Streams ``max_tokens`` deltas as fast as the connection takes them."""
    await sink.start(node_id="bench", model=request.model, adapter="bench")
    for _ in range(request.sampling.max_tokens):
        await sink.delta(TEXT)
    await sink.complete(pb.FINISH_REASON_LENGTH)


def _tls(certs: Path, role: str) -> TlsConfig:
    return TlsConfig(enabled=True, cert=certs / f"{role}.crt", key=certs / f"{role}.key", ca=certs / "ca.crt")


async def _answer_cpu_queries(listener: Listener) -> None:
    """Serve until stdin closes; each line read is answered with this process's CPU seconds."""
    loop = asyncio.get_running_loop()
    print(listener.port, flush=True)
    while await loop.run_in_executor(None, sys.stdin.readline):
        print(time.process_time(), flush=True)
    await listener.close()


async def _serve(certs: Path) -> None:
    listener = await Listener(ListenerConfig(tls=_tls(certs, "node")), Handler(run=_stream_deltas)).start()
    await _answer_cpu_queries(listener)


async def _serve_relay(certs: Path, upstream_port: int) -> None:
    """A relay, as the control-plane will be: each run re-opened upstream and relayed back."""
    upstream = await dial("127.0.0.1", upstream_port, tls=_tls(certs, "control-plane"), server_hostname="localhost")

    async def forward(request: pb.RunRequest, sink: EventSink) -> None:
        request.run_id = f"{sink.connection_id}.{request.run_id}"  # run ids are scoped per peer
        terminal = await relay(await upstream.open_run(request), sink)
        await sink.forward(*terminal)

    config = ListenerConfig(tls=_tls(certs, "control-plane"))
    listener = await Listener(config, Handler(run=forward)).start()
    await _answer_cpu_queries(listener)
    await upstream.close()


async def _stream(port: int, certs: Path, codec: str, runs: int, tokens: int) -> float:
    connection = await dial("127.0.0.1", port, tls=_tls(certs, "edge"), codec=codec, server_hostname="localhost")

    async def one(index: int) -> int:
        stream = await connection.open_run(
            pb.RunRequest(run_id=f"r{index}", model="bench", sampling=pb.Sampling(max_tokens=tokens))
        )
        return len([event async for event in stream])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(runs)))
    elapsed = time.perf_counter() - start
    await connection.close()
    return sum(counts) / elapsed


class _Process:
    """A benchmark server in its own process: its port, and its CPU time on request."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None and self.process.stdin is not None
        self._in, self._out = self.process.stdin, self.process.stdout
        self.port = int(self._out.readline())

    def cpu(self) -> float:
        self._in.write("cpu\n")
        self._in.flush()
        return float(self._out.readline())

    def stop(self) -> None:
        self.process.communicate("", timeout=10)


def stream_rows(total_events: int) -> list[tuple[str, str]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        certs = Path(tmp)
        init_dir(certs)
        server = _Process("--serve", str(certs))
        relayer = _Process("--relay", str(certs), "--upstream", str(server.port))
        try:
            for codec in ("proto", "json"):
                for runs in (1, 100):
                    rate = asyncio.run(_stream(server.port, certs, codec, runs, total_events // runs))
                    rows.append((f"events over one mTLS connection, {codec}, {runs} run(s)", f"{rate:,.0f}/s"))
            for runs in (1, 100):
                before = relayer.cpu()
                start = time.perf_counter()
                rate = asyncio.run(_stream(relayer.port, certs, "proto", runs, total_events // runs))
                events = rate * (time.perf_counter() - start)
                per_event = (relayer.cpu() - before) / events * 1e6
                name = f"relayed events (client -> relay -> server, proto), {runs} run(s)"
                rows.append((name, f"{rate:,.0f}/s, relay CPU {per_event:.2f} us/event"))
        finally:
            relayer.stop()
            server.stop()
    return rows


def main() -> None:
    configure("warning")
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", type=Path)
    parser.add_argument("--relay", type=Path)
    parser.add_argument("--upstream", type=int)
    parser.add_argument("--events", type=int, default=200_000)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve))
        return
    if args.relay:
        asyncio.run(_serve_relay(args.relay, args.upstream))
        return
    rows = [(name, f"{rate:,.0f}/s") for name, rate in codec_rows()] + stream_rows(args.events)
    print_table(rows, unit="result")


if __name__ == "__main__":
    main()
