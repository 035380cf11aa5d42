"""Both ends of one run on a connection: the RunStream a caller reads, the EventSink a server writes."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.errors import ConnectionClosed, IopError
from iop_wire.messages import error_message
from iop_wire.tls import PeerIdentity

__all__ = ["TERMINAL_EVENTS", "EventSink", "RunStream"]

#: The ``RunEvent.event`` cases after which a run's stream ends.
TERMINAL_EVENTS = frozenset({"complete", "error"})


class _Sender(Protocol):
    """What an EventSink needs of its connection."""

    peer: PeerIdentity
    closed: bool

    async def send(self, envelope: pb.Envelope, *, urgent: bool = False) -> None: ...

    def send_nowait(self, envelope: pb.Envelope) -> None: ...


class RunStream:
    """The events of one run this end opened, in order; ends after complete or error."""

    def __init__(self, run_id: str, capacity: int, cancel: Callable[[str, str], Awaitable[None]]) -> None:
        self.run_id = run_id
        self._cancel = cancel
        self._capacity = capacity
        self._events: deque[tuple[pb.RunEvent, bytes]] = deque()
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._finished = False
        self.cancelled = False
        """True once its reader asked to stop: only the terminal event is still delivered."""

    def __aiter__(self) -> RunStream:
        return self

    async def __anext__(self) -> pb.RunEvent:
        return (await self.next_frame())[0]

    async def next_frame(self) -> tuple[pb.RunEvent, bytes]:
        """The next event with its frame body as received, for relays that forward it as is."""
        while not self._events:
            if self._finished:
                raise StopAsyncIteration
            self._readable.clear()
            await self._readable.wait()
        item = self._events.popleft()
        self._writable.set()
        if item[0].WhichOneof("event") in TERMINAL_EVENTS:
            self._finished = True
        return item

    async def cancel(self, reason: str = "cancelled by client") -> None:
        """Ask the serving end to stop this run; its terminal event still arrives, nothing else.

        A caller that walks away after cancelling holds up nothing: output still buffered is
        dropped and more is not kept.
        """
        self.cancelled = True
        self._events = deque(item for item in self._events if item[0].WhichOneof("event") in TERMINAL_EVENTS)
        self._writable.set()
        await self._cancel(self.run_id, reason)

    @property
    def full(self) -> bool:
        """True while the reader is ``capacity`` events behind."""
        return len(self._events) >= self._capacity

    async def put(self, event: pb.RunEvent, body: bytes) -> None:
        while self.full:
            self._writable.clear()
            await self._writable.wait()
        self._events.append((event, body))
        self._readable.set()

    def end(self, event: pb.RunEvent, body: bytes) -> None:
        """Deliver the terminal event; it may exceed the capacity by this one event."""
        self._events.append((event, body))
        self._readable.set()

    def fail(self, error: IopError) -> None:
        """End the stream with ``error``."""
        self.end(pb.RunEvent(error=error_message(error)), b"")


class EventSink:
    """Writes one served run's events: start, deltas, then one complete or error.

    Adapters call these methods and never build messages; they encode straight to frames
    with upb. After the terminal event, or once the connection is gone, calls do nothing.
    """

    __slots__ = ("_connection", "_sequence", "_start", "cancel_reason", "finished", "run_id")

    def __init__(self, connection: _Sender, run_id: str) -> None:
        self._connection = connection
        self._sequence = 0
        self._start: pb.RunStart | None = None
        self.run_id = run_id
        self.finished = False
        """True once complete or error was sent."""
        self.cancel_reason = ""
        """Why the run was cancelled, when it was."""

    @property
    def peer(self) -> PeerIdentity:
        """Who asked for the run."""
        return self._connection.peer

    async def start(self, *, node_id: str, model: str, adapter: str) -> None:
        """The run has been admitted and started.

        The event goes out when the task's current step ends, or before the run's next event
        if that comes first: by then an adapter has sent its backend request, so announcing
        the run does not delay the work that produces its first token.
        """
        self._start = pb.RunStart(node_id=node_id, model=model, adapter=adapter)
        asyncio.get_running_loop().call_soon(self._send_start)

    def _send_start(self, *, closing: bool = False) -> None:
        start, self._start = self._start, None
        if start is None or self.finished or (self._connection.closed and not closing):
            return
        envelope = self._numbered(pb.Envelope(run_id=self.run_id, run_event=pb.RunEvent(start=start)))
        with contextlib.suppress(ConnectionClosed):  # the connection's close ends the run
            self._connection.send_nowait(envelope)

    async def delta(
        self,
        text: str = "",
        *,
        tool_calls: list[pb.ToolCallDelta] | None = None,
        logprobs: list[pb.TokenLogprob] | None = None,
        embeddings: list[pb.Embedding] | None = None,
    ) -> None:
        """New output: text and/or tool-call fragments, logprobs, embeddings."""
        envelope = pb.Envelope(run_id=self.run_id)  # filled in place: no nested message copied
        delta = envelope.run_event.delta
        delta.text = text
        if tool_calls:
            delta.tool_calls.extend(tool_calls)
        if logprobs:
            delta.logprobs.extend(logprobs)
        if embeddings:
            delta.embeddings.extend(embeddings)
        await self._send(envelope)

    async def complete(
        self,
        finish_reason: pb.FinishReason.ValueType,
        usage: pb.Usage | None = None,
        timings: pb.Timings | None = None,
    ) -> None:
        """The run finished normally."""
        complete = pb.RunComplete(finish_reason=finish_reason, usage=usage, timings=timings)
        await self._send(pb.Envelope(run_id=self.run_id, run_event=pb.RunEvent(complete=complete)), terminal=True)

    async def error(self, error: IopError) -> None:
        """The run failed (or was cancelled) with ``error``."""
        await self._send(self._error_envelope(error), terminal=True)

    async def _send(self, envelope: pb.Envelope, *, terminal: bool = False) -> None:
        if self.finished or self._connection.closed:
            return
        if self._start is not None:
            self._send_start()
        self._numbered(envelope)
        self.finished = terminal
        # The first output and the end are waited for: they skip the turn's batching. start is
        # not: it goes out while the adapter waits for its backend.
        urgent = terminal or envelope.run_event.sequence == 1
        await self._connection.send(envelope, urgent=urgent)

    def fail_now(self, error: IopError) -> None:
        """Queue a terminal error without waiting (used while the connection closes)."""
        if self.finished:
            return
        if self._start is not None:
            self._send_start(closing=True)
        self.finished = True
        self._connection.send_nowait(self._numbered(self._error_envelope(error)))

    def _error_envelope(self, error: IopError) -> pb.Envelope:
        error.run_id = self.run_id
        return pb.Envelope(run_id=self.run_id, run_event=pb.RunEvent(error=error_message(error)))

    def _numbered(self, envelope: pb.Envelope) -> pb.Envelope:
        """``envelope`` with its event numbered next in this run."""
        envelope.run_event.sequence = self._sequence
        self._sequence += 1
        return envelope
