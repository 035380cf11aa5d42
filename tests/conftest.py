"""Shared fixtures: certificates minted per test, listeners on 127.0.0.1 port 0, polling."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import Authority
from iop_wire.connection import ConnectionConfig, Handler, Inbound
from iop_wire.endpoint import Listener, ListenerConfig
from iop_wire.errors import IopError
from iop_wire.runs import EventSink
from iop_wire.tls import Role, TlsConfig

# Real inference servers (llama-cpp-python, Ollama) for the adapter tests: tests/backends.
pytest_plugins = ["backends.fixtures"]

# In CI, property tests draw the same examples on every run: a red CI then always means a
# change broke something, never that this run happened on a rare input (found locally).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def process_stat(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command (0: state, 1: parent, 2: process group); None once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:  # it exited while we looked
        return None


def every_process_stat() -> Iterator[tuple[int, list[str]]]:
    """(pid, :func:`process_stat`) of every process running now."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := process_stat(entry)) is not None:
            yield int(entry), fields


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (dead, not yet reaped) or a dead process does not."""
    fields = process_stat(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def children_of_this_process() -> list[int]:
    """Pids whose parent is this test process."""
    return [pid for pid, fields in every_process_stat() if int(fields[1]) == os.getpid()]


async def forked_and_frozen(task: asyncio.Task[Any], ready: Callable[[], bool]) -> None:
    """Run the loop a step at a time until ``task`` has forked a child, then hold the loop (the task's
    pipes stay unconnected: it is inside create_subprocess_exec) until ``ready`` holds."""
    while not children_of_this_process():
        assert not task.done(), task
        await asyncio.sleep(0)
    deadline = time.monotonic() + 10
    while not ready():
        assert time.monotonic() < deadline, "the child did not get ready"
        time.sleep(0.01)  # noqa: ASYNC251  the loop must not run
    assert not task.done(), task


async def assert_eventually(condition: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01) -> None:
    """Poll ``condition`` until it holds, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


class TextSink:
    """An adapter's EventSink for text runs, called directly in a test: keeps the deltas, finish and usage."""

    def __init__(self) -> None:
        self.deltas: list[str] = []
        self.finish: pb.FinishReason.ValueType | None = None
        self.usage: pb.Usage | None = None
        self.counted_tokens: int | None = None

    async def delta(self, text: str) -> None:
        self.deltas.append(text)

    async def output(self, delta: pb.RunDelta) -> None:
        raise AssertionError("text runs write text")

    async def complete(
        self, finish_reason: pb.FinishReason.ValueType, usage: pb.Usage | None = None, timings: pb.Timings | None = None
    ) -> None:
        self.finish, self.usage = finish_reason, usage

    async def counted(self, tokens: int) -> None:
        self.finish, self.usage, self.counted_tokens = pb.FINISH_REASON_STOP, pb.Usage(), tokens

    def annotate(self, key: str, value: str) -> None:
        pass

    def counting(self, prompt_tokens: int, *, token_per_delta: bool = False) -> None:
        pass

    @property
    def text(self) -> str:
        return "".join(self.deltas)


@dataclass
class Pki:
    """A CA and a directory to write certificates into."""

    authority: Authority
    directory: Path

    def config(self, name: str, role: Role | None, **issue: object) -> TlsConfig:
        """Issue a certificate and return the TlsConfig that presents it."""
        ca = self.directory / "ca.crt"
        ca.write_bytes(self.authority.cert_pem)
        cert, key = self.authority.issue(name, role, **issue).write(self.directory, f"{name}-{role}")  # type: ignore[arg-type]
        return TlsConfig(enabled=True, cert=cert, key=key, ca=ca)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(Authority("test CA"), tmp_path)


class EchoHandler:
    """Serves runs by streaming ``max_tokens`` numbered words (default 3), or hanging on model 'hang'."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.messages: list[pb.Envelope] = []
        self.sent = 0

    async def run(self, request: pb.RunRequest, sink: EventSink) -> None:
        await sink.start(node_id="test-node", model=request.model, adapter="echo")
        count = request.sampling.max_tokens or 3
        try:
            if request.model == "hang":
                await asyncio.Event().wait()
            if request.model == "fail":
                raise IopError(pb.ERROR_CODE_BACKEND_ERROR, "backend said no")
            for index in range(count):
                await sink.delta(f"w{index} ")
                self.sent += 1
        except asyncio.CancelledError:
            self.cancelled.append(sink.cancel_reason)
            raise
        await sink.complete(pb.FINISH_REASON_STOP, pb.Usage(prompt_tokens=1, completion_tokens=count))

    async def capabilities(self) -> pb.CapabilityResponse:
        return pb.CapabilityResponse(
            node_id="test-node", version="test", adapters=[pb.AdapterInfo(name="echo", models=[pb.ModelInfo(name="m")])]
        )

    async def on_capabilities(self, inbound: Inbound) -> None:
        await inbound.reply(pb.Envelope(capability_response=await self.capabilities()))

    async def on_message(self, inbound: Inbound) -> None:
        self.messages.append(inbound.envelope)

    def wire(self) -> Handler:
        """The handler table a listener or dialer serves with."""
        return Handler(
            run=self.run, messages={"capability_request": self.on_capabilities, "node_status": self.on_message}
        )


@pytest.fixture
def handler() -> EchoHandler:
    return EchoHandler()


@pytest.fixture
async def server(pki: Pki, handler: EchoHandler) -> AsyncIterator[Listener]:
    """An mTLS listener for edges and admins, serving EchoHandler, with fast heartbeats."""
    config = ListenerConfig(
        tls=pki.config("test-node", Role.NODE),
        allowed_roles=frozenset({Role.EDGE, Role.ADMIN}),
        connection=ConnectionConfig(heartbeat_interval=0.2, max_frame_size=64 * 1024),
    )
    listener = await Listener(config, handler.wire()).start()
    yield listener
    await listener.close()


@pytest.fixture
def edge_tls(pki: Pki) -> TlsConfig:
    return pki.config("test-edge", Role.EDGE)
