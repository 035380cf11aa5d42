"""Streams cut by a lost node and continued on another (issue 22), read at the wire level.

A requester (the edge's certificate) opens runs on the control-plane with ``iop_wire``, where
each event's sequence number is visible, and keeps every event with the moment it arrived. While
the streams run, one node is killed (SIGKILL: its kernel closes the socket) and, half a second
later, another is frozen (SIGSTOP: silent until the control-plane's liveness window lapses); an
admin connection asks ``nodes.list`` every few milliseconds to time when the control-plane marks
each unavailable. ``tests/e2e/test_migration.py`` asserts on what the streams received and
``tests/bench/migration_bench.py`` measures the gaps from the same run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx2 as httpx

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection
from iop_wire.endpoint import dial
from iop_wire.tls import TlsConfig

from .conftest import Stack

MODEL = "mock-paced"
TOKENS, PACE = 60, 20.0
"""Each stream is 60 tokens at 20 a second: 3 s uninterrupted, long enough to be cut mid-way."""
CONTINUED_ROUTES = [
    {"model": MODEL, "adapter": "mock", "max_concurrency": 64, "options": {"tokens": TOKENS, "tokens_per_second": PACE}}
]
"""Every node serves the paced model with room for all the streams, so any survivor can take any run."""
NODES = ("node-a", "node-b", "node-c")
STREAMS = 32
DELTAS_BEFORE_A_FAULT = 10
"""Every stream has this many deltas (half a second) before the first fault: all are mid-stream."""
BETWEEN_FAULTS = 0.5
"""Seconds from one fault to the next: a killed node's runs have moved by then, some onto the node frozen next."""
_POLL = 0.005


def requests(label: str) -> list[pb.RunRequest]:
    """``STREAMS`` streaming runs of ``MODEL``, half chats and half completions, each a prompt of its own
    (the mock's text is a function of model and prompt; the same for every label); run ids ``<label>-<index>``."""
    made = []
    for index in range(STREAMS):
        prompt = f"stream {index}: tell a long story"
        request = pb.RunRequest(run_id=f"{label}-{index:02d}", model=MODEL, stream=True)
        if index % 2:
            request.kind = pb.RUN_KIND_COMPLETION
            request.prompt.append(prompt)
        else:
            request.kind = pb.RUN_KIND_CHAT
            request.messages.append(pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text=prompt)]))
        made.append(request)
    return made


@dataclass
class Received:
    """Everything the requester received of one run, each event with the moment (``perf_counter``) it arrived."""

    request: pb.RunRequest
    events: list[tuple[float, pb.RunEvent]] = field(default_factory=list)

    @property
    def started_on(self) -> str:
        """The node named by the run's first start event."""
        return next((event.start.node_id for _, event in self.events if event.HasField("start")), "")

    def kinds(self) -> list[str]:
        return [event.WhichOneof("event") or "" for _, event in self.events]

    @property
    def text(self) -> str:
        return "".join(event.delta.text for _, event in self.events if event.HasField("delta"))

    @property
    def end(self) -> pb.RunEvent:
        return self.events[-1][1]

    def deltas(self) -> int:
        return sum(event.HasField("delta") for _, event in self.events)

    def gap_at_migration(self) -> float | None:
        """Seconds from the last delta of the attempt that was lost to the first delta of its continuation,
        for a run continued once (None for one that was not, or did not complete).

        The mock's usage says where the cut was: a continuation re-reads, as continuation_prompt_tokens,
        the tokens delivered before it, one per delta (a run continued twice reports the sum of both cuts).
        """
        if not self.end.HasField("complete"):
            return None
        delivered = self.end.complete.usage.continuation_prompt_tokens
        arrivals = [at for at, event in self.events if event.HasField("delta")]
        return arrivals[delivered] - arrivals[delivered - 1] if 0 < delivered < len(arrivals) else None


async def receive(connection: Connection, request: pb.RunRequest, into: Received) -> Received:
    """Open ``request`` and keep every event of it in ``into`` as it arrives, until its end."""
    async with await connection.open_run(request) as stream:
        async for event in stream:
            into.events.append((time.perf_counter(), event))
    return into


async def receive_all(connection: Connection, made: list[pb.RunRequest]) -> list[Received]:
    """Every run of ``made`` at once, to its end."""
    return list(await asyncio.gather(*(receive(connection, request, Received(request)) for request in made)))


@dataclass
class Fault:
    """One node signalled (SIGKILL or SIGSTOP) under the streams, when (``perf_counter``), and when the
    control-plane first listed it unavailable."""

    node_id: str
    signal: signal.Signals
    at: float
    unavailable_at: float | None = None

    @property
    def detection(self) -> float | None:
        """Seconds from the signal to the control-plane marking the node unavailable."""
        return None if self.unavailable_at is None else self.unavailable_at - self.at


def tls(stack: Stack, role: str) -> TlsConfig:
    """The stack's certificate for ``role`` (as ``iop certs init`` wrote it)."""
    return TlsConfig(
        enabled=True, cert=stack.certs / f"{role}.crt", key=stack.certs / f"{role}.key", ca=stack.certs / "ca.crt"
    )


async def dial_control_plane(stack: Stack, role: str) -> Connection:
    """A connection to the stack's control-plane under its ``role`` certificate (edge: a requester; admin)."""
    return await dial("127.0.0.1", stack.cp_port, tls=tls(stack, role), server_hostname="localhost")


async def _watch_unavailable(admin: Connection, faults: list[Fault], count: int) -> None:
    """Note when each signalled node is first listed unavailable (``nodes.list`` every few ms), until all
    ``count`` faults are in ``faults`` and seen."""
    while len(faults) < count or any(fault.unavailable_at is None for fault in faults):
        listed = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
        down = {node.node_id for node in listed.nodes if node.state != pb.NODE_STATE_READY}
        for fault in faults:
            if fault.unavailable_at is None and fault.node_id in down:
                fault.unavailable_at = time.perf_counter()
        await asyncio.sleep(_POLL)


async def cut_streams(
    stack: Stack, made: list[pb.RunRequest], signals: tuple[signal.Signals, ...] = (signal.SIGKILL, signal.SIGSTOP)
) -> tuple[list[Received], list[Fault]]:
    """Run ``made`` at once; once each has ``DELTAS_BEFORE_A_FAULT`` deltas, send the first signal to the
    node whose runs started most, the next one ``BETWEEN_FAULTS`` s later to the next such node...;
    every run to its end.

    A node sent SIGSTOP is sent SIGCONT before returning, whatever happened (it then finds its
    connection closed and registers again).
    """
    connection = await dial_control_plane(stack, "edge")
    admin = await dial_control_plane(stack, "admin")
    faults: list[Fault] = []
    try:
        received = [Received(request) for request in made]
        streams = asyncio.gather(*(receive(connection, r.request, r) for r in received))
        await _until_mid_stream(received)
        busiest = [node_id for node_id, _ in Counter(r.started_on for r in received).most_common(len(signals))]
        watching = asyncio.create_task(_watch_unavailable(admin, faults, len(signals)))
        for node_id, sent in zip(busiest, signals, strict=True):
            if faults:
                await asyncio.sleep(BETWEEN_FAULTS)
            os.kill(stack.nodes[node_id].popen.pid, sent)
            faults.append(Fault(node_id, sent, time.perf_counter()))
        await asyncio.wait_for(streams, 60)
        await asyncio.wait_for(watching, 30)
        return received, faults
    finally:
        for fault in faults:
            if fault.signal == signal.SIGSTOP:
                os.kill(stack.nodes[fault.node_id].popen.pid, signal.SIGCONT)
        await connection.close()
        await admin.close()


async def _until_mid_stream(received: list[Received]) -> None:
    """Until every run has ``DELTAS_BEFORE_A_FAULT`` deltas (or has ended: the test then says how)."""
    deadline = time.monotonic() + 30
    while not all(r.deltas() >= DELTAS_BEFORE_A_FAULT or r.kinds()[-1:] in (["complete"], ["error"]) for r in received):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not every stream reached {DELTAS_BEFORE_A_FAULT} deltas: {[r.deltas() for r in received]}"
            )
        await asyncio.sleep(_POLL)


def control_plane_metric(stack: Stack, series: str) -> float:
    """One series of the control-plane's /metrics (``name{labels}`` as printed; 0 when absent); the
    control-plane must have been started with ``metrics: {port: 0}``."""
    assert stack.control_plane is not None
    port = json.loads(stack.control_plane.ready_file.read_text())["metrics_port"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(series + " ")), 0.0)


def attempts_on(stack: Stack, node_id: str) -> set[str]:
    """The requester's run ids of every attempt the node recorded (as ``<connection>.<run id>.<attempt>``)."""
    with sqlite3.connect(f"file:{stack.node_db(node_id)}?mode=ro", uri=True, timeout=10) as db:
        return {row[0].split(".")[-2] for row in db.execute("SELECT run_id FROM runs")}
