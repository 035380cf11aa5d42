"""Both ends of one run on a connection: the RunStream a caller reads, the EventSink a server writes.

A run's events are numbered 0, 1, 2, ... by its EventSink with no gaps: a number is taken
only by an event that was framed and queued. A delta too large for one frame is split into
several deltas (embeddings and other lists by item, text by size); what cannot be split ends
the run with an error at the next number. :func:`relay` forwards one run's events from a
RunStream into another connection's EventSink without encoding them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import Codec
from iop_wire.errors import ConnectionClosed, FrameError, IopError
from iop_wire.messages import error_message
from iop_wire.tls import PeerIdentity

__all__ = ["TERMINAL_EVENTS", "EventSink", "RunStream", "relay"]

#: The ``RunEvent.event`` cases after which a run's stream ends.
TERMINAL_EVENTS = frozenset({"complete", "error"})


class _Sender(Protocol):
    """What an EventSink needs of its connection."""

    peer: PeerIdentity
    id: str
    closed: bool
    codec: Codec

    def frame(self, envelope: pb.Envelope) -> bytearray: ...

    def next_id(self) -> str: ...

    async def send_frame(self, frame: bytes | bytearray, *, urgent: bool = False) -> None: ...

    def send_frame_nowait(self, frame: bytes | bytearray, *, urgent: bool = False) -> None: ...

    def frame_body(self, body: bytes) -> bytearray: ...


class RunStream:
    """The events of one run this end opened, in order; ends after complete or error.

    ``async with await connection.open_run(request) as stream:`` cancels the run when the block
    is left before its end (return, error or cancellation): whoever stops reading stops the run.
    """

    def __init__(self, run_id: str, cancel: Callable[[str, str], None], *, codec: str = "proto") -> None:
        self.run_id = run_id
        self.codec = codec
        """The codec the bodies of :meth:`next_frame` are in."""
        self._cancel = cancel
        self._events: deque[tuple[pb.RunEvent, bytes]] = deque()
        self._readable = asyncio.Event()
        self.buffered_bytes = 0
        """Frame bytes of the events that arrived and are not read yet."""
        self.finished = False
        """True once the terminal event was read."""
        self.ended = False
        """True once the terminal event arrived (it may not have been read yet)."""
        self.cancelled = False
        """True once its reader asked to stop: only the terminal event is still delivered."""
        self.terminal: pb.RunEvent | None = None
        """Its terminal event once it arrived (read or not): what :meth:`cancel_and_wait` returns."""
        self._ending: asyncio.Future[None] | None = None
        """Made by the first :meth:`cancel_and_wait` that must wait; done when the terminal event arrives."""

    def __aiter__(self) -> RunStream:
        return self

    async def __aenter__(self) -> RunStream:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Leaving the block before the run ended (return, error or cancellation) cancels the run."""
        if not self.finished:
            self.cancel_nowait("the caller stopped reading the run")

    async def __anext__(self) -> pb.RunEvent:
        return (await self.next_frame())[0]

    async def next_frame(self) -> tuple[pb.RunEvent, bytes]:
        """The next event with its frame body as received (in :attr:`codec`), for relays.

        The body is empty for an event made on this side (the connection closed, or a refusal
        that came as an envelope-level error).
        """
        while not self._events:
            if self.finished:
                raise StopAsyncIteration
            self._readable.clear()
            await self._readable.wait()
        return self._take()

    def next_nowait(self) -> pb.RunEvent | None:
        """The next event if it has arrived, else None: a reader that writes what is already here
        in one go (many deltas, one write) takes them without a wait each."""
        if not self._events:
            return None
        return self._take()[0]

    def next_frame_nowait(self) -> tuple[pb.RunEvent, bytes] | None:
        """:meth:`next_frame` if the event has arrived, else None."""
        return self._take() if self._events else None

    def _take(self) -> tuple[pb.RunEvent, bytes]:
        item = self._events.popleft()
        self.buffered_bytes -= len(item[1])
        if item[0].WhichOneof("event") in TERMINAL_EVENTS:
            self.finished = True
        return item

    async def cancel(self, reason: str = "cancelled by client") -> None:
        """Ask the serving end to stop this run; its terminal event still arrives, nothing else."""
        self.cancel_nowait(reason)
        await asyncio.sleep(0)

    def cancel_nowait(self, reason: str = "cancelled by client") -> None:
        """:meth:`cancel` without waiting: usable while a task is being cancelled.

        A caller that walks away after cancelling holds up nothing: output still buffered is
        dropped and more is not kept.
        """
        if self.cancelled or self.ended:
            return
        self._drop_output()
        self._cancel(self.run_id, reason)

    async def cancel_and_wait(self, timeout: float, reason: str = "cancelled by client") -> pb.RunEvent | None:
        """Cancel the run (unless it was already) and wait up to ``timeout`` seconds for its terminal event.

        That event says how the run ended on the serving end and what it used there: its error
        (a node's carries ``Error.usage``), or its complete if it finished meanwhile; an event made
        on this side (the connection closed) carries no usage. None: none came in time (the peer
        is slow, frozen or ignores the cancel). Nothing else is kept meanwhile, and the event stays
        readable by :meth:`next_frame` too: a caller that stopped reading gets the end of the run
        without holding its output.
        """
        self.cancel_nowait(reason)
        if self.terminal is None:
            if self._ending is None:
                self._ending = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.shield(self._ending)  # another waiter's timeout must not end this one's wait
        return self.terminal

    def overflow(self, error: IopError, reason: str) -> None:
        """Its reader fell too far behind: drop what waits, end with ``error``, cancel the run upstream."""
        if self.cancelled or self.ended:
            return
        self._drop_output()
        self.fail(error)
        self._cancel(self.run_id, reason)

    def _drop_output(self) -> None:
        """Stop keeping output: drop what waits (only a terminal event stays) and anything later."""
        self.cancelled = True
        self._events = deque(item for item in self._events if item[0].WhichOneof("event") in TERMINAL_EVENTS)
        self.buffered_bytes = sum(len(body) for _, body in self._events)

    @property
    def buffered(self) -> int:
        """Events that arrived and are not read yet."""
        return len(self._events)

    def put_nowait(self, event: pb.RunEvent, body: bytes) -> None:
        """Keep an event for the reader; never waits (the connection bounds :attr:`buffered_bytes`)."""
        self._events.append((event, body))
        self.buffered_bytes += len(body)
        self._readable.set()

    def end(self, event: pb.RunEvent, body: bytes) -> None:
        """Deliver the terminal event: always kept, whatever is buffered (nothing may keep a run from ending)."""
        if self.ended:
            return
        self.ended = True
        self.terminal = event
        self.put_nowait(event, body)
        if self._ending is not None and not self._ending.done():
            self._ending.set_result(None)

    def fail(self, error: IopError) -> None:
        """End the stream with ``error``."""
        error.run_id = error.run_id or self.run_id
        self.end(pb.RunEvent(error=error_message(error)), b"")


class EventSink:
    """Writes one served run's events: start, deltas, then one complete or error.

    Adapters call these methods and never build envelopes; events are encoded straight to
    frames with upb. After the terminal event, or once the connection is gone, calls do nothing.
    """

    __slots__ = (
        "_connection",
        "_relay_suffix",
        "_sequence",
        "_start",
        "cancel_reason",
        "finished",
        "first_output_at",
        "outputs",
        "run_id",
        "started",
    )

    def __init__(self, connection: _Sender, run_id: str) -> None:
        self._connection = connection
        self._sequence = 0
        self._start: pb.RunStart | None = None
        self._relay_suffix: bytes | None = None
        self.run_id = run_id
        self.finished = False
        """True once complete or error was sent."""
        self.started = False
        """True once a start event was sent."""
        self.outputs = 0
        """Delta events sent so far."""
        self.first_output_at: float | None = None
        """time.monotonic() when the first delta was sent."""
        self.cancel_reason = ""
        """Why the run was cancelled, when it was."""

    @property
    def peer(self) -> PeerIdentity:
        """Who asked for the run (from its certificate)."""
        return self._connection.peer

    @property
    def connection_id(self) -> str:
        """The connection the run arrived on: run ids are scoped to it."""
        return self._connection.id

    @property
    def sequence(self) -> int:
        """The number the next event will carry."""
        return self._sequence

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
        if start is None or self.finished or self.started or (self._connection.closed and not closing):
            return
        with contextlib.suppress(ConnectionClosed):  # the connection's close ends the run
            self._connection.send_frame_nowait(self._framed(self._envelope(pb.RunEvent(start=start))))
            self.started = True

    async def delta(self, text: str) -> None:
        """New text: the per-token fast path."""
        envelope = pb.Envelope(run_id=self.run_id)  # filled in place: no nested message copied
        envelope.run_event.delta.text = text
        await self._send(envelope)

    async def output(self, delta: pb.RunDelta) -> None:
        """New output of any kind: text, tool-call fragments, logprobs, embeddings."""
        envelope = pb.Envelope(run_id=self.run_id)
        envelope.run_event.delta.CopyFrom(delta)
        await self._send(envelope)

    async def complete(
        self,
        finish_reason: pb.FinishReason.ValueType,
        usage: pb.Usage | None = None,
        timings: pb.Timings | None = None,
        *,
        counted_tokens: int = 0,
    ) -> None:
        """The run finished normally (``counted_tokens``: a RUN_KIND_COUNT_TOKENS run's count)."""
        complete = pb.RunComplete(
            finish_reason=finish_reason, usage=usage, timings=timings, counted_tokens=counted_tokens
        )
        await self._send(self._envelope(pb.RunEvent(complete=complete)), terminal=True)

    async def error(self, error: IopError) -> None:
        """The run failed (or was cancelled) with ``error``."""
        await self._send(self._error_envelope(error), terminal=True)

    def fail_now(self, error: IopError) -> None:
        """Queue a terminal error without waiting (used while the connection closes)."""
        if self.finished:
            return
        if self._start is not None:
            self._send_start(closing=True)
        self.finished = True
        self._connection.send_frame_nowait(self._framed(self._error_envelope(error)))

    async def forward(self, event: pb.RunEvent, body: bytes) -> None:
        """Relay an event another connection delivered (``body``: its envelope's protobuf bytes, or b"").

        The event is renumbered into this run's sequence; a second ``start`` (a retry on
        another server) is dropped. Where both connections use the proto codec the received
        bytes are sent as they are, with the new envelope id, run id and sequence appended
        (protobuf's last-field-wins and message merging): nothing is decoded or encoded again.
        """
        kind = event.WhichOneof("event")
        if self.finished or self._connection.closed or (kind == "start" and self.started):
            return
        if self._start is not None:
            self._send_start()
        if body and self._connection.codec.name == "proto":
            frame = self._forwarded(body, error=kind == "error")
        else:  # another codec on either side: re-encode the decoded event
            envelope = self._envelope(event)
            if kind == "error":
                envelope.run_event.error.run_id = self.run_id
            frame = self._framed(envelope, numbered=False)
            self._sequence += 1
        terminal = kind in TERMINAL_EVENTS
        self.finished = terminal
        self.started = True
        first = False
        if kind == "delta":
            self.outputs += 1
            if first := self.outputs == 1:
                self.first_output_at = time.monotonic()
        await self._connection.send_frame(frame, urgent=terminal or first)

    # -- numbering and framing ----------------------------------------------------------------

    async def _send(self, envelope: pb.Envelope, *, terminal: bool = False) -> None:
        if self.finished or self._connection.closed:
            return
        if self._start is not None:
            self._send_start()
        try:
            frame = self._framed(envelope)
        except FrameError:
            if terminal or not envelope.run_event.HasField("delta"):
                raise  # a complete or error too large: only a bug or a huge message gets here
            await self._send_split(envelope.run_event.delta)
            return
        self.finished = terminal
        first = False
        if not terminal:
            self.outputs += 1
            if first := self.outputs == 1:
                self.first_output_at = time.monotonic()
        # The first output and the end are waited for: they skip the turn's batching. start is
        # not: it goes out while the adapter waits for its backend.
        await self._connection.send_frame(frame, urgent=terminal or first)

    async def _send_split(self, delta: pb.RunDelta) -> None:
        """Send a delta too large for one frame as several, each as large as fits."""
        for part in _halves(delta):
            envelope = pb.Envelope(run_id=self.run_id)
            envelope.run_event.delta.CopyFrom(part)
            try:
                frame = self._framed(envelope)
            except FrameError:
                if _halves(part) == [part]:
                    raise IopError(
                        pb.ERROR_CODE_FRAME_TOO_LARGE,
                        f"an output of {part.ByteSize()} bytes cannot be split to fit a frame",
                    ) from None
                await self._send_split(part)
                continue
            self.outputs += 1
            if first := self.outputs == 1:
                self.first_output_at = time.monotonic()
            await self._connection.send_frame(frame, urgent=first)

    def _framed(self, envelope: pb.Envelope, *, numbered: bool = True) -> bytearray:
        """``envelope`` numbered next in this run and framed; the number is taken only if it fits."""
        envelope.run_event.sequence = self._sequence
        frame = self._connection.frame(envelope)
        if numbered:
            self._sequence += 1
        return frame

    def _forwarded(self, body: bytes, *, error: bool) -> bytearray:
        if self._relay_suffix is None:
            self._relay_suffix = _string_field(2, self.run_id.encode())
        event = _varint_field(1, self._sequence)
        if error:  # the inner Error names the run too
            event += _bytes_field(13, _string_field(4, self.run_id.encode()))
        suffix = _string_field(1, self._connection.next_id().encode()) + self._relay_suffix
        suffix += _bytes_field(11, event)
        self._sequence += 1
        return self._connection.frame_body(body + suffix)

    def _envelope(self, event: pb.RunEvent) -> pb.Envelope:
        return pb.Envelope(run_id=self.run_id, run_event=event)

    def _error_envelope(self, error: IopError) -> pb.Envelope:
        error.run_id = self.run_id
        return self._envelope(pb.RunEvent(error=error_message(error)))


def _halves(delta: pb.RunDelta) -> list[pb.RunDelta]:
    """``delta`` in two or more smaller deltas, or ``[delta]`` when it cannot be split."""
    kinds = [field for field, _ in delta.ListFields()]
    if len(kinds) > 1:  # one delta per kind of content first
        parts = []
        for field in kinds:
            part = pb.RunDelta()
            if field.name == "text":
                part.text = delta.text
            else:
                getattr(part, field.name).extend(getattr(delta, field.name))
            parts.append(part)
        return parts
    if not kinds:
        return [delta]
    name = kinds[0].name
    if name == "text":
        if len(delta.text) < 2:
            return [delta]
        middle = len(delta.text) // 2
        return [pb.RunDelta(text=delta.text[:middle]), pb.RunDelta(text=delta.text[middle:])]
    items = getattr(delta, name)
    if len(items) < 2:
        return [delta]
    first, second = pb.RunDelta(), pb.RunDelta()
    middle = len(items) // 2
    getattr(first, name).extend(items[:middle])
    getattr(second, name).extend(items[middle:])
    return [first, second]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes_field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


_string_field = _bytes_field


async def relay(
    stream: RunStream,
    sink: EventSink,
    *,
    first_output: Callable[[], None] | None = None,
    on_delta: Callable[[pb.RunEvent, bytes], None] | None = None,
) -> tuple[pb.RunEvent, bytes]:
    """Forward ``stream``'s events into ``sink`` until its terminal event, returned unforwarded.

    The caller decides what the terminal event means: forward it (``sink.forward``), or try
    the run elsewhere when it failed before any output (``sink.outputs == 0``). If the task
    is cancelled (the requester cancelled or went away), or forwarding fails (the requester's
    connection closed under it), the run is cancelled upstream too: nobody reads it any more.
    ``first_output`` is called once, when this stream's first output has been forwarded (the sink
    may hold an earlier attempt's); ``on_delta`` with each delta event forwarded and its body as
    received (b"" unless protobuf): a relay that keeps the delivered output to continue the run
    elsewhere (:class:`iop_wire.continuation.Delivered`) may keep the bytes and decode them only then.
    """
    as_received = stream.codec == "proto"  # only protobuf bytes can be forwarded as they are
    before = sink.outputs
    try:
        while True:
            try:
                event, body = await stream.next_frame()
            except StopAsyncIteration:
                raise IopError(pb.ERROR_CODE_INTERNAL, f"run {stream.run_id} was already read to its end") from None
            if not as_received:
                body = b""
            kind = event.WhichOneof("event")
            if kind in TERMINAL_EVENTS:
                return event, body
            await sink.forward(event, body)
            if on_delta is not None and kind == "delta":
                on_delta(event, body)
            if first_output is not None and sink.outputs > before:
                first_output()
                first_output = None
    except BaseException:  # CancelledError, or ConnectionClosed from a requester gone mid-forward
        stream.cancel_nowait(sink.cancel_reason or "cancelled by the requester")
        raise
