"""One IOP connection: many runs multiplexed both ways over a framed asyncio stream.

Either end may open runs (send run.request and read run.events) and serve them: a
:class:`Handler` names the function that executes each run.request (writing through an
:class:`EventSink`) and one function per other message type it takes (``{body field: fn}``),
each given an :class:`Inbound` whose ``reply()`` answers it. The connection answers
heartbeats itself and correlates replies to :meth:`Connection.request` by ``in_reply_to``.

Every resource the peer can make this end hold is bounded (see :class:`ConnectionConfig`):
live runs it asks for, message handlers running for it, bytes waiting to be sent to it
(reading pauses above ``read_pause_bytes``), the time a frame's body may take, and its
silence. The reader never waits for one run's reader: each run this end opened keeps up to
``run_buffer_bytes`` of unread events, past which that run alone is cancelled (SLOW_CONSUMER).
A watchdog timer (:mod:`iop_wire.watchdog`: one per event loop for all connections), never behind
a send, sends our heartbeats and declares the peer dead when it has been silent, or has not read
what we sent, for ``missed_heartbeats`` of its heartbeat intervals.

Closing fails every run still open on it with a retryable error: runs this end reads get a
synthetic error event; runs this end serves are cancelled, and on a graceful close the peer
first gets an error event for each.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType

from google.protobuf.message import Error as ProtobufError

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import Codec
from iop_wire.config import ConnectionConfig
from iop_wire.errors import Code, ConnectionClosed, DecodeError, FrameError, IopError, code_name
from iop_wire.framing import FrameDecoder, encode_frame
from iop_wire.liveness import Liveness, Verdict
from iop_wire.logs import RateLimitedLog, library_logger
from iop_wire.messages import error_envelope, error_message
from iop_wire.metrics import CONNECTIONS, LIMIT_HITS, PEERS_LOST, PROTOCOL_VIOLATIONS
from iop_wire.runs import TERMINAL_EVENTS, EventSink, RunStream
from iop_wire.tls import ANONYMOUS, PeerIdentity, acting_caller
from iop_wire.watchdog import watch

__all__ = ["Connection", "ConnectionConfig", "Handler", "Inbound", "MessageHandler", "RunHandler"]

_log = library_logger("iop.wire")  # silent below WARNING until the application configures logging
_FAIR_SHARE = 64  # frames handled from one read before other tasks get a turn
_LOG_EVERY = 1.0  # seconds between log lines for one limit on one connection
_PAUSE_POLL = 0.01  # seconds between looks at a paused connection's unsent bytes


RunHandler = Callable[[pb.RunRequest, EventSink], Awaitable[None]]
"""Executes one run.request, writing to the sink; cancelled when the run is."""
MessageHandler = Callable[["Inbound"], Awaitable[None]]
"""Handles one envelope of its type; an IopError it raises is sent back as the reply."""


@dataclass(frozen=True, slots=True)
class Handler:
    """What this end serves on a connection: runs, and a function per other message type."""

    run: RunHandler | None = None
    """Serves run.request; None refuses runs with UNKNOWN_MESSAGE_TYPE."""
    messages: Mapping[str, MessageHandler] = field(default_factory=lambda: MappingProxyType({}))
    """``Envelope.body`` field name (``capability_request``, ``node_register``, ...) -> handler."""


@dataclass(slots=True)
class _Served:
    task: asyncio.Task[None]
    sink: EventSink
    started: bool = False
    """The task began: cancelling it now reaches the handler (before, it would never run at all)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


class Connection:
    """A framed, multiplexed IOP connection over an asyncio stream pair."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        codec: Codec,
        *,
        peer: PeerIdentity = ANONYMOUS,
        handler: Handler | None = None,
        config: ConnectionConfig = ConnectionConfig(),
        label: str = "",
        side: str = "dialed",
    ) -> None:
        self.peer = peer
        self.codec = codec
        self.config = config
        self.id = secrets.token_hex(8)
        """Unique per connection (also across restarts): run ids are scoped to it."""
        self.closed = False
        self.close_error: IopError | None = None
        """Why the connection closed, once it has."""
        self._reader, self._writer = reader, writer
        self._handler = handler or Handler()
        self._side = side
        self._decoder = FrameDecoder(config.max_frame_size)
        self._ids = itertools.count()
        self._out: list[bytes | bytearray] = []
        self._out_bytes = 0
        self._written = 0
        self._flush_scheduled = False
        self._streams: dict[str, RunStream] = {}
        self._served: dict[str, _Served] = {}
        self._pending: dict[str, asyncio.Future[pb.Envelope]] = {}
        self._requests: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._loop = asyncio.get_running_loop()
        self._liveness = Liveness(config, self._loop.time())
        self._beat = pb.Heartbeat()
        self._beat.interval.FromNanoseconds(int(config.heartbeat_interval * 1e9))
        self._beats = itertools.count()
        self._next_beat = 0.0
        self._limit_logs = RateLimitedLog(_LOG_EVERY)
        self._done = asyncio.Event()
        self._closing = asyncio.Event()
        self._log = _log.bind(peer=peer.name, role=peer.role, conn=label or self.id)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Connection:
        """Start reading, heartbeating and watching the peer; returns self."""
        CONNECTIONS.labels(self._side).inc()
        self._tasks = [asyncio.create_task(self._read_loop(), name="iop-read")]
        self._next_beat = self._loop.time()
        watch(self, self._next_beat)
        return self

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()

    async def wait_closed(self) -> None:
        """Wait until the connection has closed (its socket shut: up to ``close_timeout`` after it began)."""
        await self._done.wait()

    async def wait_closing(self) -> None:
        """Wait until the connection begins to close: its runs are failing now, the socket may linger."""
        await self._closing.wait()

    @property
    def last_heard(self) -> float:
        """When the peer's last whole frame arrived (any frame: heartbeats too), as ``time.time()``."""
        return time.time() - (self._loop.time() - self._liveness.last_frame)

    @property
    def address(self) -> str:
        """The peer's ``host:port`` as seen on this socket ("" when unknown)."""
        peername = self._writer.get_extra_info("peername")
        return f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else ""

    async def close(self, reason: str = "closing", code: Code = pb.ERROR_CODE_SHUTTING_DOWN) -> None:
        """Close gracefully: every open run, both ways, gets a retryable error first."""
        await self._shutdown(ConnectionClosed(reason, code), notify_peer=True)

    async def _shutdown(self, error: IopError, *, notify_peer: bool, abort: bool = False) -> None:
        if self.closed:
            await self._done.wait()
            return
        self.closed = True
        self.close_error = error
        self._closing.set()
        CONNECTIONS.labels(self._side).dec()
        self._log.info("connection closed", reason=error.message, code=error.name)
        # Runs end retryably: SHUTTING_DOWN on a graceful close, UNAVAILABLE for anything else.
        run_code = error.code if error.code == pb.ERROR_CODE_SHUTTING_DOWN else pb.ERROR_CODE_UNAVAILABLE
        notify_peer = notify_peer and not abort
        try:
            served_tasks = self._end_runs(error, run_code, notify_peer=notify_peer)
            if notify_peer and not self._writer.is_closing():
                self.send_nowait(error_envelope(error))
            self._flush()
            current = asyncio.current_task()
            for task in (*self._tasks, *self._requests):
                if task is not current:
                    task.cancel()
            if abort:  # the peer does not read: nothing we write would reach it
                self._writer.transport.abort()
            else:
                await self._close_transport()
            if served_tasks:  # let cancelled runs record how they ended before close() returns
                await asyncio.wait(served_tasks, timeout=self.config.close_timeout)
        except BaseException:
            self._writer.transport.abort()
            raise
        finally:
            self._done.set()

    def _end_runs(self, error: IopError, code: Code, *, notify_peer: bool) -> list[asyncio.Task[None]]:
        """Fail every run on this connection; return the served runs' tasks (now cancelled)."""
        served_tasks = []
        for served in list(self._served.values()):
            if notify_peer and not self._writer.is_closing():
                served.sink.fail_now(IopError(code, error.message, retryable=True))
            served.sink.cancel_reason = f"connection closed: {error.message}"
            served.task.cancel()
            served_tasks.append(served.task)
        for stream in list(self._streams.values()):
            stream.fail(ConnectionClosed(f"connection closed: {error.message}", code))
        self._streams.clear()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionClosed(error.message, code))
        return served_tasks

    async def _close_transport(self) -> None:
        self._writer.close()
        try:
            await asyncio.wait_for(self._writer.wait_closed(), self.config.close_timeout)
        except (TimeoutError, OSError, ssl.SSLError):
            self._writer.transport.abort()

    # -- sending -----------------------------------------------------------------------------

    def next_id(self) -> str:
        """A fresh envelope id, unique on this connection."""
        return str(next(self._ids))

    def frame(self, envelope: pb.Envelope) -> bytearray:
        """``envelope`` stamped (id, sent_at), encoded and framed; FrameError if it is too large."""
        if not envelope.id:
            envelope.id = str(next(self._ids))
        envelope.sent_at.FromNanoseconds(time.time_ns())  # 6 times cheaper than GetCurrentTime
        return encode_frame(self.codec.encode(envelope), self.config.max_frame_size)

    def frame_body(self, body: bytes) -> bytearray:
        """An already-encoded envelope framed (a relay forwarding what it received)."""
        return encode_frame(body, self.config.max_frame_size)

    async def send(self, envelope: pb.Envelope, *, urgent: bool = False) -> None:
        """Send ``envelope``, waiting while the socket is behind."""
        self._queue(self.frame(envelope), urgent=urgent)
        await self._backpressure()

    def send_nowait(self, envelope: pb.Envelope, *, urgent: bool = False) -> None:
        """Queue ``envelope``; raises ConnectionClosed once closed.

        Frames are gathered and written once per event-loop turn (throughput); an ``urgent``
        one (a request, a run's first token and its end) goes out at once, with whatever was
        gathered before it, because someone is waiting for exactly that frame.
        """
        self._queue(self.frame(envelope), urgent=urgent)

    async def send_frame(self, frame: bytes | bytearray, *, urgent: bool = False) -> None:
        """Send a framed envelope, waiting while the socket is behind."""
        self._queue(frame, urgent=urgent)
        await self._backpressure()

    def send_frame_nowait(self, frame: bytes | bytearray, *, urgent: bool = False) -> None:
        """Queue a framed envelope."""
        self._queue(frame, urgent=urgent)

    async def _backpressure(self) -> None:
        """Wait while the transport is over its high-water mark or ``write_buffer`` bytes wait here."""
        if self._out_bytes >= self.config.write_buffer:
            self._flush()
        # Returns at once unless the transport paused writing (TCP or TLS buffers full): a
        # producer that yields between frames is held here too.
        await self._writer.drain()

    def _queue(self, frame: bytes | bytearray, *, urgent: bool = False) -> None:
        if self._writer.is_closing():
            raise ConnectionClosed("connection is closed")
        self._out.append(frame)
        self._out_bytes += len(frame)
        if urgent:  # written now, with what was gathered before it; no turn-end flush needed
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            if self.config.flush_delay:
                self._loop.call_later(self.config.flush_delay, self._flush)
            else:
                self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and not self._writer.is_closing():
            self._writer.write(b"".join(self._out))
            self._written += self._out_bytes
        self._out.clear()
        self._out_bytes = 0

    @property
    def unsent(self) -> int:
        """Bytes queued for the peer that it has not taken yet (ours and the transport's)."""
        return self._out_bytes + self._writer.transport.get_write_buffer_size()

    # -- opening runs and requests -----------------------------------------------------------

    async def open_run(self, request: pb.RunRequest, *, urgent: bool = True) -> RunStream:
        """Send a run.request and return the stream of its events.

        ``urgent`` (the default) writes it at once; False lets it share the turn's write with the
        other frames of the turn (a front end opening many runs at once: one TLS record for all).
        """
        if not request.run_id:
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, "run.request needs a run_id")
        if request.run_id in self._streams:
            raise IopError(pb.ERROR_CODE_PROTOCOL_VIOLATION, f"run {request.run_id} is already open")
        if self.closed:
            raise ConnectionClosed("connection is closed")
        frame = self._run_request_frame(request)  # before anything is registered: a failure leaves nothing
        stream = RunStream(request.run_id, self.cancel_run, codec=self.codec.name)
        self._streams[request.run_id] = stream
        try:
            self._queue(frame, urgent=urgent)
            await self._backpressure()
        except BaseException:
            if self._streams.get(request.run_id) is stream and not self.closed:
                # Sent, but nobody will read it: the run is cancelled and its terminal event absorbed.
                stream.cancel_nowait("the caller gave up while the run request was being sent")
            elif self._streams.get(request.run_id) is stream:
                del self._streams[request.run_id]
            raise
        return stream

    def _run_request_frame(self, request: pb.RunRequest) -> bytearray:
        """The run.request framed, or INVALID_ARGUMENT: too large (TOO_LARGE) or not encodable (UNENCODABLE)."""
        try:
            return self.frame(pb.Envelope(run_id=request.run_id, run_request=request))
        except FrameError as exc:
            reason, why = pb.ERROR_REASON_TOO_LARGE, f"is too large to send: {exc.message}"
        except (ValueError, RecursionError, ProtobufError) as exc:  # UnicodeEncodeError is a ValueError
            reason, why = pb.ERROR_REASON_UNENCODABLE, f"cannot be encoded: {_first_line(exc)}"
        raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, f"run request {why}", run_id=request.run_id, reason=reason)

    def cancel_run(self, run_id: str, reason: str) -> None:
        """Send cancel.request for ``run_id`` (without waiting for the socket)."""
        if self.closed:
            return
        cancel = pb.CancelRequest(run_id=run_id, reason=reason)
        self.send_nowait(pb.Envelope(run_id=run_id, cancel_request=cancel), urgent=True)

    async def request(self, envelope: pb.Envelope, timeout: float = 10.0) -> pb.Envelope:
        """Send ``envelope`` and wait for the envelope whose ``in_reply_to`` names it.

        An ``error`` answer is raised as IopError.
        """
        envelope.id = envelope.id or str(next(self._ids))
        future: asyncio.Future[pb.Envelope] = self._loop.create_future()
        self._pending[envelope.id] = future
        try:
            await self.send(envelope, urgent=True)
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(envelope.id, None)

    async def capabilities(self, timeout: float = 10.0) -> pb.CapabilityResponse:
        """Ask the peer for its capabilities."""
        reply = await self.request(pb.Envelope(capability_request=pb.CapabilityRequest()), timeout)
        if reply.WhichOneof("body") != "capability_response":
            raise IopError(pb.ERROR_CODE_PROTOCOL_VIOLATION, "capability.request answered with something else")
        return reply.capability_response

    # -- receiving ---------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                if self.unsent > self.config.read_pause_bytes:
                    await self._pause_reading()
                data = await self._reader.read(self.config.read_size)
                if not data:
                    await self._on_eof()
                    return
                frames = self._decoder.feed(data)
                self._liveness.received(self._loop.time(), frames=len(frames), partial=self._decoder.buffered > 0)
                for index, body in enumerate(frames, 1):
                    await self._on_frame(body)
                    # One read may hold thousands of small frames, each of which may start work:
                    # let other tasks run now and then (not after every frame, or the writes
                    # of a turn stop coalescing).
                    if index % _FAIR_SHARE == 0:
                        await asyncio.sleep(0)
        except FrameError as exc:
            LIMIT_HITS.labels("frame_size").inc()
            self._log.warning("bad frame", reason=exc.message)
            await self._shutdown(exc, notify_peer=True)
        except (ConnectionError, ssl.SSLError, OSError) as exc:
            self._log.warning("connection lost", reason=str(exc) or type(exc).__name__)
            await self._shutdown(ConnectionClosed(f"connection lost: {exc}"), notify_peer=False)
        except ConnectionClosed:
            return  # closed by another task while this one was sending
        except Exception as exc:  # noqa: BLE001 - a bug must close this connection, not leave it deaf
            self._log.exception("connection failed", reason=type(exc).__name__)
            failure = IopError(pb.ERROR_CODE_INTERNAL, f"internal error: {type(exc).__name__}")
            await self._shutdown(failure, notify_peer=True)

    async def _pause_reading(self) -> None:
        """Read nothing more while the peer leaves our answers unread; TCP then holds it back."""
        LIMIT_HITS.labels("read_paused").inc()
        self._log.warning("reading paused", reason="peer is not reading", unsent=self.unsent)
        self._liveness.held = True
        try:
            while self.unsent > self.config.read_pause_bytes // 2 and not self.closed:
                self._flush()
                await self._writer.drain()
                if self.unsent > self.config.read_pause_bytes // 2:
                    # drain() returns at once while the transport is under its own high-water
                    # mark, which may be above ours: look again later instead of spinning.
                    await asyncio.sleep(_PAUSE_POLL)
        finally:
            self._liveness.resumed(self._loop.time())
        self._log.info("reading resumed", unsent=self.unsent)

    @property
    def _reading_paused(self) -> bool:
        """True while this end holds reading back (the peer reads nothing of what we send)."""
        return self._liveness.held

    async def _on_eof(self) -> None:
        if self._decoder.buffered:
            reason = f"peer closed the connection mid-frame ({self._decoder.buffered} bytes unread)"
            self._log.warning("bad frame", reason=reason)
        elif self.close_error is not None:
            reason = f"peer closed the connection: {self.close_error.message}"
        else:
            reason = "peer closed the connection"
        await self._shutdown(ConnectionClosed(reason), notify_peer=False)

    async def _on_frame(self, body: bytes) -> None:
        try:
            envelope = self.codec.decode(body)
        except DecodeError as exc:
            self._log.warning("bad frame", reason=exc.message)
            await self.send(error_envelope(exc))
            return
        kind = envelope.WhichOneof("body")
        if kind == "run_event":
            self._on_run_event(envelope, body)
        elif kind == "run_request":
            await self._on_run_request(envelope)
        elif kind == "heartbeat":
            self._on_heartbeat(envelope.heartbeat)
        elif kind == "cancel_request":
            self._on_cancel_request(envelope)
        elif envelope.in_reply_to in self._pending:
            self._resolve(envelope)
        elif kind == "error":
            self._on_error(envelope, body)
        elif kind is not None and kind in self._handler.messages:
            await self._on_message(self._handler.messages[kind], envelope)
        else:
            await self._reject(envelope, pb.ERROR_CODE_UNKNOWN_MESSAGE_TYPE, f"unknown message type {kind or '(none)'}")

    async def _reject(
        self, envelope: pb.Envelope, code: Code, message: str, *, run_id: str = "", retryable: bool = False
    ) -> None:
        self._log.warning("rejected envelope", reason=message, code=code_name(code))
        error = IopError(code, message, retryable=retryable, run_id=run_id)
        await self.send(error_envelope(error, in_reply_to=envelope.id))

    def _resolve(self, envelope: pb.Envelope) -> None:
        future = self._pending.get(envelope.in_reply_to)
        if future is None or future.done():
            return
        if envelope.WhichOneof("body") == "error":
            future.set_exception(IopError.from_message(envelope.error))
        else:
            future.set_result(envelope)

    def _on_run_event(self, envelope: pb.Envelope, body: bytes) -> None:
        stream = self._streams.get(envelope.run_id)
        if stream is None:  # a run never opened here, or one whose terminal event came: delivered to no one
            self._violation("run_event_for_unknown_run", "event dropped: no such run", run_id=envelope.run_id)
            return
        event = envelope.run_event
        if event.WhichOneof("event") in TERMINAL_EVENTS:
            del self._streams[envelope.run_id]
            stream.end(event, body)  # never waits: nothing may keep a run from ending
            return
        if stream.cancelled:
            return  # its reader asked to stop, or fell too far behind; only the terminal event still matters
        # Never waits for the run's reader: one run that is not read must not stall the others.
        stream.put_nowait(event, body)
        if stream.buffered_bytes > self.config.run_buffer_bytes and stream.buffered > 1:
            self._slow_consumer(stream)

    def _slow_consumer(self, stream: RunStream) -> None:
        """End one run whose reader is ``run_buffer_bytes`` behind: its reader gets the error, the peer a cancel."""
        limit = self.config.run_buffer_bytes
        self._limit_hit("slow_consumer", "run cancelled", run_id=stream.run_id, unread_bytes=stream.buffered_bytes)
        error = IopError(
            pb.ERROR_CODE_RESOURCE_EXHAUSTED,
            f"run {stream.run_id} cancelled: its reader fell {stream.buffered_bytes} bytes behind "
            f"(run_buffer_bytes is {limit})",
            retryable=False,
            reason=pb.ERROR_REASON_SLOW_CONSUMER,
        )
        stream.overflow(error, "the run's reader fell too far behind (slow consumer)")

    def _on_error(self, envelope: pb.Envelope, body: bytes) -> None:
        stream = self._streams.pop(envelope.run_id, None)
        if stream is not None:  # a run.request refused before it became a run
            stream.end(pb.RunEvent(error=envelope.error), b"")  # not a run.event's bytes: none to forward
            return
        err = envelope.error
        level = self._log.info if err.code == pb.ERROR_CODE_SHUTTING_DOWN else self._log.warning
        level("peer reported error", code=code_name(err.code), reason=err.message)
        self.close_error = IopError.from_message(err)

    def _on_heartbeat(self, beat: pb.Heartbeat) -> None:
        # Any whole frame counts as a sign of life (the read loop noted the time); the interval
        # tells how long this peer may stay silent, within our bound.
        interval = beat.interval.ToNanoseconds() / 1e9
        capped_before = self._liveness.peer_interval == self.config.max_peer_interval
        if not self._liveness.announce(interval) and not capped_before:  # log once per connection
            LIMIT_HITS.labels("peer_heartbeat_interval").inc()
            self._log.warning("peer heartbeat interval clamped", announced=interval, used=self.config.max_peer_interval)

    async def _on_run_request(self, envelope: pb.Envelope) -> None:
        request = envelope.run_request
        run_id = request.run_id or envelope.run_id
        if self._handler.run is None:
            await self._reject(
                envelope,
                pb.ERROR_CODE_UNKNOWN_MESSAGE_TYPE,
                "run.request is not served on this connection",
                run_id=run_id,
            )
        elif not run_id:
            await self._reject(envelope, pb.ERROR_CODE_INVALID_ARGUMENT, "run.request needs a run_id")
        elif run_id in self._served and not self._served[run_id].sink.finished:
            # Not a run event: the live run with this id goes on, and its stream must not end.
            await self._reject(
                envelope, pb.ERROR_CODE_PROTOCOL_VIOLATION, f"run {run_id} is already running", run_id=run_id
            )
        elif len(self._served) >= self.config.max_runs:
            self._limit_hit("runs_per_connection", "run refused", run_id=run_id, limit=self.config.max_runs)
            error = IopError(
                pb.ERROR_CODE_RESOURCE_EXHAUSTED,
                f"this connection already has {self.config.max_runs} runs in progress",
                retryable=True,
                run_id=run_id,
            )
            refusal = pb.Envelope(run_id=run_id, run_event=pb.RunEvent(sequence=0, error=error_message(error)))
            await self.send(refusal)  # gathered with the turn's other frames: a flood costs no write each
        else:
            request.run_id = run_id
            sink = EventSink(self, run_id)
            task = self._loop.create_task(self._serve(self._handler.run, request, sink))
            self._served[run_id] = _Served(task, sink)

    async def _serve(self, run: RunHandler, request: pb.RunRequest, sink: EventSink) -> None:
        error: IopError | None = None
        try:
            served = self._served.get(sink.run_id)
            if served is not None and served.sink is sink:
                served.started = True
            if sink.cancel_reason:  # cancel.request came before the task ran: the handler never starts
                raise asyncio.CancelledError
            await run(request, sink)
            if not sink.finished:
                error = IopError(pb.ERROR_CODE_INTERNAL, "run ended without complete or error")
        except asyncio.CancelledError:
            error = IopError(pb.ERROR_CODE_CANCELLED, sink.cancel_reason or "cancelled")
        except IopError as exc:
            error = exc
        except Exception:  # noqa: BLE001 - a handler's bug fails its run, not the connection
            self._log.exception("run handler failed", run_id=sink.run_id)
            error = IopError(pb.ERROR_CODE_INTERNAL, "internal error")
        try:
            if error is not None:
                with contextlib.suppress(ConnectionClosed):  # closing ended the run already: nothing to tell
                    await sink.error(error)
        finally:
            served = self._served.get(sink.run_id)
            if served is not None and served.sink is sink:  # the id may already name a newer run
                del self._served[sink.run_id]

    def _on_cancel_request(self, envelope: pb.Envelope) -> None:
        message = envelope.cancel_request
        served = self._served.get(message.run_id or envelope.run_id)
        if served is not None:
            served.sink.cancel_reason = message.reason or "cancelled by client"
            if served.started:  # a task cancelled before it runs never runs: it would end no run
                served.task.cancel()

    async def _on_message(self, handler: MessageHandler, envelope: pb.Envelope) -> None:
        if len(self._requests) >= self.config.max_requests:
            self._limit_hit("requests_per_connection", "request refused", limit=self.config.max_requests)
            error = IopError(
                pb.ERROR_CODE_RESOURCE_EXHAUSTED, f"{self.config.max_requests} requests are already being answered"
            )
            await self.send(error_envelope(error, in_reply_to=envelope.id))
            return
        # Answering may take a while (a node may ask its backends): never in the read loop.
        task = self._loop.create_task(self._handle(handler, envelope))
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    async def _handle(self, handler: MessageHandler, envelope: pb.Envelope) -> None:
        try:
            await handler(Inbound(self, envelope))
        except IopError as exc:  # the handler refused it: say so (the whole error: param, retry_after), go on
            if not self.closed:
                self._log.warning("rejected envelope", reason=exc.message, code=code_name(exc.code))
                await self.send(error_envelope(exc, in_reply_to=envelope.id))
        except ConnectionClosed:
            return
        except Exception:  # noqa: BLE001 - answer with an error; the connection goes on
            self._log.exception("message handler failed", message=envelope.WhichOneof("body"))
            if not self.closed:
                await self._reject(envelope, pb.ERROR_CODE_INTERNAL, "internal error")

    def _violation(self, kind: str, event: str, **fields: object) -> None:
        """Count a protocol violation by the peer; logged like a limit hit (at most once a second)."""
        PROTOCOL_VIOLATIONS.labels(kind).inc()
        self._rate_limited_log(kind, event, **fields)

    def _limit_hit(self, name: str, event: str, **fields: object) -> None:
        """Count a limit that bit; log it at most once a second per connection, with what was not logged."""
        LIMIT_HITS.labels(name).inc()
        self._rate_limited_log(name, event, **fields)

    def _rate_limited_log(self, name: str, event: str, **fields: object) -> None:
        self._limit_logs.warning(name, self._log, event, reason=name.replace("_", " "), **fields)

    # -- liveness ----------------------------------------------------------------------------

    def look(self, now: float, *, judge: bool) -> float | None:
        """The watchdog's look (loop time ``now``): our heartbeat out when due, and, when ``judge``,
        the peer's liveness in; the loop time to look again, None once the connection is done."""
        if self.closed:
            return None
        # A peer beating faster than we do is looked at as often as its window needs.
        nap = min(self.config.watch_tick, self._liveness.window / 6)
        try:
            if now + nap / 2 >= self._next_beat:  # the look nearest the beat's time sends it
                self._heartbeat(now)
            if judge and (verdict := self._judge(now)) is not None:
                self._tasks.append(self._loop.create_task(self._peer_dead(verdict), name="iop-peer-dead"))
                return None
        except ConnectionClosed:
            return None
        except Exception as exc:  # noqa: BLE001 - a bug must close this connection, not stop the watchdog
            self._log.exception("connection failed", reason=type(exc).__name__)
            failure = IopError(pb.ERROR_CODE_INTERNAL, f"internal error: {type(exc).__name__}")
            self._tasks.append(self._loop.create_task(self._shutdown(failure, notify_peer=True)))
            return None
        return now + nap

    def excuse(self, seconds: float) -> None:
        """This end's event loop stood still for ``seconds``: what the peer sent meanwhile is not read yet."""
        self._liveness.excuse(seconds)

    def _heartbeat(self, now: float) -> None:
        self._beat.sequence = next(self._beats)
        self.send_nowait(pb.Envelope(heartbeat=self._beat), urgent=True)
        self._next_beat += self.config.heartbeat_interval
        if self._next_beat <= now:  # our loop stood still for more than an interval: no burst to catch up
            self._next_beat = now + self.config.heartbeat_interval

    def _judge(self, now: float) -> Verdict | None:
        unsent = self._writer.transport.get_write_buffer_size()
        return self._liveness.check(now, written=self._written, unsent=unsent)

    async def _peer_dead(self, verdict: Verdict) -> None:
        PEERS_LOST.labels(verdict.reason).inc()
        message = verdict.message
        if verdict.reason == "frame_timeout":
            LIMIT_HITS.labels("frame_timeout").inc()
            message = f"{message} ({self._decoder.buffered} bytes so far)"
        self._log.warning("peer dead", reason=message)
        code = pb.ERROR_CODE_DEADLINE_EXCEEDED if verdict.reason == "frame_timeout" else pb.ERROR_CODE_UNAVAILABLE
        # A peer that does not read gets nothing more: its socket is aborted, not closed politely.
        await self._shutdown(ConnectionClosed(message, code), notify_peer=True, abort=verdict.reason == "unread")


@dataclass(frozen=True, slots=True)
class Inbound:
    """An envelope handed to a message handler, with the means to answer it."""

    connection: Connection
    envelope: pb.Envelope

    @property
    def peer(self) -> PeerIdentity:
        """Who sent it, from its certificate."""
        return self.connection.peer

    @property
    def caller(self) -> str:
        """Who the request is for: the envelope's ``caller`` from a peer that acts for others, else the peer."""
        return acting_caller(self.peer, self.envelope.caller)

    async def reply(self, envelope: pb.Envelope) -> None:
        """Send ``envelope`` as the answer (its ``in_reply_to`` is set to this envelope's id)."""
        envelope.in_reply_to = self.envelope.id
        await self.connection.send(envelope, urgent=True)
