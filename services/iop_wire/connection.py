"""One IOP connection: many runs multiplexed both ways over a framed asyncio stream.

Either end may open runs (send run.request and read run.events) and serve them (a
:class:`Handler` executes each run.request, writing through an :class:`EventSink`). The
connection also answers heartbeats and capability requests, correlates replies by
``in_reply_to``, and applies backpressure both ways:

- sending: frames produced in one event-loop turn go out in one write; a sender waits for the
  socket once more than ``write_buffer`` bytes are queued;
- receiving: each run buffers at most ``run_buffer`` events; when its reader falls behind,
  the connection stops reading and TCP pushes back on the peer.

Closing fails every run still open on it with a retryable error: runs this end reads get a
synthetic error event; runs this end serves are cancelled, and on a graceful close the peer
first gets an error event for each.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from iop_gen.bp import iop as bp
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import Codec
from iop_wire.errors import ConnectionClosed, DecodeError, ErrorCode, FrameError, IopError
from iop_wire.framing import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, encode_frame
from iop_wire.messages import error_envelope, from_typed, to_typed
from iop_wire.runs import TERMINAL_EVENTS, EventSink, RunStream
from iop_wire.tls import ANONYMOUS, PeerIdentity

__all__ = ["Connection", "ConnectionConfig", "EventSink", "Handler", "RunStream"]

_log = structlog.get_logger("iop.wire")


@dataclass(frozen=True, slots=True)
class ConnectionConfig:
    """Limits and timers of one connection."""

    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    """Largest frame body accepted or sent, in bytes."""
    heartbeat_interval: float = 30.0
    """Seconds between heartbeats sent; the peer is dead after ``missed_heartbeats`` silent intervals."""
    missed_heartbeats: int = 3
    """Silent intervals after which the peer is declared dead."""
    run_buffer: int = 256
    """Events buffered per run on the receiving side before reading pauses."""
    write_buffer: int = 256 * 1024
    """Bytes queued for sending before a sender waits for the socket to drain."""
    read_size: int = 256 * 1024
    """Bytes asked of the socket per read."""
    close_timeout: float = 5.0
    """Seconds a close waits for the peer before aborting the socket."""


class Handler(Protocol):
    """What a connection calls for the requests it serves."""

    async def run(self, request: pb.RunRequest, sink: EventSink) -> None:
        """Execute ``request``, reporting through ``sink``; cancelled when the run is.

        The request stays a upb message (typed by its mypy-protobuf stub): converting it to
        betterproto2 would cost ~100 us per run, a third of a one-token run's budget.
        """
        ...

    async def capabilities(self) -> bp.CapabilityResponse:
        """Answer a capability.request."""
        ...

    async def message(self, connection: Connection, envelope: pb.Envelope) -> None:
        """Any other envelope (node.register, node.status, node.drain, ...); IopError refuses it."""
        ...


@dataclass(slots=True)
class _Served:
    task: asyncio.Task[None]
    sink: EventSink


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
    ) -> None:
        self.peer = peer
        self.codec = codec
        self.config = config
        self.closed = False
        self.close_error: IopError | None = None
        """Why the connection closed, once it has."""
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._decoder = FrameDecoder(config.max_frame_size)
        self._ids = itertools.count()
        self._out: list[bytes | bytearray] = []
        self._out_bytes = 0
        self._flush_scheduled = False
        self._streams: dict[str, RunStream] = {}
        self._served: dict[str, _Served] = {}
        self._pending: dict[str, asyncio.Future[pb.Envelope]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._peer_interval = 0.0
        self._loop = asyncio.get_running_loop()
        self._last_heard = self._loop.time()
        self._reading_paused = False
        self._done = asyncio.Event()
        self._log = _log.bind(peer=peer.name, role=peer.role, conn=label)
        self._dispatch: dict[str, Callable[[pb.Envelope, bytes], Awaitable[None]]] = {
            "run_event": self._on_run_event,
            "run_request": self._on_run_request,
            "cancel_request": self._on_cancel_request,
            "capability_request": self._on_capability_request,
            "heartbeat": self._on_heartbeat,
            "error": self._on_error,
        }

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Connection:
        """Start reading and heartbeating; returns self."""
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="iop-read"),
            asyncio.create_task(self._heartbeat_loop(), name="iop-heartbeat"),
        ]
        return self

    async def wait_closed(self) -> None:
        """Wait until the connection has closed."""
        await self._done.wait()

    async def close(self, reason: str = "closing", code: ErrorCode = ErrorCode.SHUTTING_DOWN) -> None:
        """Close gracefully: every open run, both ways, gets a retryable error first."""
        await self._shutdown(ConnectionClosed(reason, code), notify_peer=True)

    async def _shutdown(self, error: IopError, *, notify_peer: bool) -> None:
        if self.closed:
            await self._done.wait()
            return
        self.closed = True
        self.close_error = error
        self._log.info("connection closed", reason=error.message, code=error.code.name)
        # Runs end retryably: SHUTTING_DOWN on a graceful close, UNAVAILABLE for anything else.
        run_code = error.code if error.code == ErrorCode.SHUTTING_DOWN else ErrorCode.UNAVAILABLE
        try:
            served_tasks = self._end_runs(error, run_code, notify_peer=notify_peer)
            if notify_peer and not self._writer.is_closing():
                self.send_nowait(error_envelope(error))
            self._flush()
            current = asyncio.current_task()
            for task in (*self._tasks, *self._side_tasks):
                if task is not current:
                    task.cancel()
            await self._close_transport()
            if served_tasks:  # let cancelled runs record how they ended before close() returns
                await asyncio.wait(served_tasks, timeout=self.config.close_timeout)
        except BaseException:
            self._writer.transport.abort()
            raise
        finally:
            self._done.set()

    def _end_runs(self, error: IopError, code: ErrorCode, *, notify_peer: bool) -> list[asyncio.Task[None]]:
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

    async def send(self, envelope: pb.Envelope, *, urgent: bool = False) -> None:
        """Send ``envelope``, waiting while more than ``write_buffer`` bytes are queued."""
        self.send_nowait(envelope, urgent=urgent)
        await self._backpressure()

    async def send_body(self, body: bytes) -> None:
        """Send an already-encoded envelope (a relay forwarding a frame it received)."""
        self._queue(encode_frame(body, self.config.max_frame_size))
        await self._backpressure()

    async def _backpressure(self) -> None:
        """Wait while the transport is over its high-water mark or ``write_buffer`` bytes wait here."""
        if self._out_bytes >= self.config.write_buffer:
            self._flush()
        # Returns at once unless the transport paused writing (TCP or TLS buffers full): a
        # producer that yields between frames is held here too.
        await self._writer.drain()

    def send_nowait(self, envelope: pb.Envelope, *, urgent: bool = False) -> None:
        """Queue ``envelope``; raises ConnectionClosed once closed.

        Frames are gathered and written once per event-loop turn (throughput); an ``urgent``
        one (a request, a run's first token and its end) goes out at once, with whatever was
        gathered before it, because someone is waiting for exactly that frame.
        """
        if not envelope.id:
            envelope.id = str(next(self._ids))
        envelope.sent_at.FromNanoseconds(time.time_ns())  # 6 times cheaper than GetCurrentTime
        self._queue(encode_frame(self.codec.encode(envelope), self.config.max_frame_size), urgent=urgent)

    def _queue(self, frame: bytes | bytearray, *, urgent: bool = False) -> None:
        if self._writer.is_closing():
            raise ConnectionClosed("connection is closed")
        self._out.append(frame)
        self._out_bytes += len(frame)
        if urgent:  # written now, with what was gathered before it; no turn-end flush needed
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and not self._writer.is_closing():
            self._writer.write(b"".join(self._out))
        self._out.clear()
        self._out_bytes = 0

    # -- opening runs and requests -----------------------------------------------------------

    async def open_run(self, request: bp.RunRequest | pb.RunRequest) -> RunStream:
        """Send a run.request and return the stream of its events."""
        message = request if isinstance(request, pb.RunRequest) else from_typed(request, pb.RunRequest)
        if not message.run_id:
            raise IopError(ErrorCode.INVALID_ARGUMENT, "run.request needs a run_id")
        if message.run_id in self._streams:
            raise IopError(ErrorCode.PROTOCOL_VIOLATION, f"run {message.run_id} is already open")
        if self.closed:
            raise ConnectionClosed("connection is closed")
        stream = RunStream(message.run_id, self.config.run_buffer, self.cancel_run)
        self._streams[message.run_id] = stream
        await self.send(pb.Envelope(run_id=message.run_id, run_request=message), urgent=True)
        return stream

    async def cancel_run(self, run_id: str, reason: str) -> None:
        """Send cancel.request for ``run_id``."""
        cancel = pb.CancelRequest(run_id=run_id, reason=reason)
        await self.send(pb.Envelope(run_id=run_id, cancel_request=cancel), urgent=True)

    async def request(self, envelope: pb.Envelope, timeout: float = 10.0) -> pb.Envelope:
        """Send ``envelope`` and wait for the envelope whose ``in_reply_to`` names it."""
        envelope.id = envelope.id or str(next(self._ids))
        future: asyncio.Future[pb.Envelope] = self._loop.create_future()
        self._pending[envelope.id] = future
        try:
            await self.send(envelope, urgent=True)
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(envelope.id, None)

    async def capabilities(self, timeout: float = 10.0) -> bp.CapabilityResponse:
        """Ask the peer for its capabilities."""
        reply = await self.request(pb.Envelope(capability_request=pb.CapabilityRequest()), timeout)
        if reply.WhichOneof("body") != "capability_response":
            raise IopError(ErrorCode.PROTOCOL_VIOLATION, "capability.request answered with something else")
        return to_typed(reply.capability_response, bp.CapabilityResponse)

    # -- receiving ---------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._reader.read(self.config.read_size)
                if not data:
                    await self._on_eof()
                    return
                self._last_heard = self._loop.time()
                for body in self._decoder.feed(data):
                    await self._on_frame(body)
        except FrameError as exc:
            self._log.warning("bad frame", reason=exc.message)
            await self._shutdown(exc, notify_peer=True)
        except (ConnectionError, ssl.SSLError, OSError) as exc:
            self._log.warning("connection lost", reason=str(exc) or type(exc).__name__)
            await self._shutdown(ConnectionClosed(f"connection lost: {exc}"), notify_peer=False)
        except ConnectionClosed:
            return  # closed by another task while this one was sending
        except Exception as exc:  # noqa: BLE001 - a bug must close this connection, not leave it deaf
            self._log.exception("connection failed", reason=type(exc).__name__)
            failure = IopError(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")
            await self._shutdown(failure, notify_peer=True)

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
        handler = self._dispatch.get(kind) if kind else None
        if handler is not None:
            await handler(envelope, body)
        elif envelope.in_reply_to in self._pending:
            self._resolve(envelope)
        elif kind is not None and self._handler is not None:
            try:
                await self._handler.message(self, envelope)
            except IopError as exc:  # the handler refused it: say so, and go on
                await self._reject(envelope, exc.code, exc.message)
        else:
            await self._reject(envelope, ErrorCode.UNKNOWN_MESSAGE_TYPE, f"unknown message type {kind or '(none)'}")

    async def _reject(self, envelope: pb.Envelope, code: ErrorCode, message: str) -> None:
        self._log.warning("rejected envelope", reason=message, code=code.name)
        error = IopError(code, message, retryable=False, run_id=envelope.run_id)
        await self.send(error_envelope(error, in_reply_to=envelope.id))

    def _resolve(self, envelope: pb.Envelope) -> None:
        future = self._pending.get(envelope.in_reply_to)
        if future is None or future.done():
            return
        if envelope.WhichOneof("body") == "error":
            err = envelope.error
            future.set_exception(IopError(ErrorCode(err.code), err.message, retryable=err.retryable))
        else:
            future.set_result(envelope)

    async def _on_run_event(self, envelope: pb.Envelope, body: bytes) -> None:
        stream = self._streams.get(envelope.run_id)
        if stream is None:
            return  # a late event of a run already ended here
        event = envelope.run_event
        if event.WhichOneof("event") in TERMINAL_EVENTS:
            del self._streams[envelope.run_id]
            stream.end(event, body)  # never waits: nothing may keep a run from ending
            return
        if stream.cancelled:
            return  # its reader asked to stop; only the terminal event still matters
        if stream.full:
            self._reading_paused = True
            try:
                await stream.put(event, body)
            finally:
                self._reading_paused = False
                self._last_heard = self._loop.time()
        else:
            await stream.put(event, body)

    async def _on_error(self, envelope: pb.Envelope, body: bytes) -> None:
        if envelope.in_reply_to in self._pending:
            self._resolve(envelope)
            return
        stream = self._streams.pop(envelope.run_id, None)
        if stream is not None:
            stream.end(pb.RunEvent(error=envelope.error), body)
            return
        err = envelope.error
        level = self._log.info if err.code == pb.ERROR_CODE_SHUTTING_DOWN else self._log.warning
        level("peer reported error", code=ErrorCode(err.code).name, reason=err.message)
        self.close_error = IopError(ErrorCode(err.code), err.message, retryable=err.retryable)

    async def _on_heartbeat(self, envelope: pb.Envelope, body: bytes) -> None:
        # Any frame counts as a sign of life (the read loop noted the time); the interval tells
        # how long this peer may stay silent.
        self._peer_interval = envelope.heartbeat.interval.ToNanoseconds() / 1e9

    async def _on_run_request(self, envelope: pb.Envelope, body: bytes) -> None:
        message = envelope.run_request
        run_id = message.run_id or envelope.run_id
        if self._handler is None:
            await self._reject(envelope, ErrorCode.UNKNOWN_MESSAGE_TYPE, "run.request is not served on this connection")
        elif not run_id:
            await self._reject(envelope, ErrorCode.INVALID_ARGUMENT, "run.request needs a run_id")
        elif run_id in self._served:
            envelope.run_id = ""  # the answer must not end the live run that has this id
            await self._reject(envelope, ErrorCode.PROTOCOL_VIOLATION, f"run {run_id} is already running")
        else:
            message.run_id = run_id
            sink = EventSink(self, run_id)
            task = asyncio.create_task(self._serve(message, sink))
            self._served[run_id] = _Served(task, sink)

    async def _serve(self, request: pb.RunRequest, sink: EventSink) -> None:
        assert self._handler is not None
        try:
            await self._handler.run(request, sink)
            if not sink.finished:
                await sink.error(IopError(ErrorCode.INTERNAL, "run ended without complete or error"))
        except asyncio.CancelledError:
            await sink.error(IopError(ErrorCode.CANCELLED, sink.cancel_reason or "cancelled"))
        except IopError as exc:
            await sink.error(exc)
        except Exception:  # noqa: BLE001 - a handler's bug fails its run, not the connection
            self._log.exception("run handler failed", run_id=sink.run_id)
            await sink.error(IopError(ErrorCode.INTERNAL, "internal error"))
        finally:
            self._served.pop(sink.run_id, None)

    async def _on_cancel_request(self, envelope: pb.Envelope, body: bytes) -> None:
        message = envelope.cancel_request
        served = self._served.get(message.run_id or envelope.run_id)
        if served is not None:
            served.sink.cancel_reason = message.reason or "cancelled by client"
            served.task.cancel()

    async def _on_capability_request(self, envelope: pb.Envelope, body: bytes) -> None:
        if self._handler is None:
            await self._reject(envelope, ErrorCode.UNKNOWN_MESSAGE_TYPE, "capability.request is not served here")
            return
        # Answering may take a while (an adapter may ask its backend): not in the read loop.
        task = asyncio.create_task(self._answer_capabilities(envelope))
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _answer_capabilities(self, envelope: pb.Envelope) -> None:
        assert self._handler is not None
        try:
            response = await self._handler.capabilities()
        except Exception:  # noqa: BLE001 - answer with an error; the connection goes on
            self._log.exception("capabilities failed")
            if not self.closed:
                await self._reject(envelope, ErrorCode.INTERNAL, "capabilities failed")
            return
        if self.closed:
            return
        reply = pb.Envelope(in_reply_to=envelope.id, capability_response=from_typed(response, pb.CapabilityResponse))
        await self.send(reply, urgent=True)

    # -- liveness ----------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval
        beat = pb.Heartbeat()
        beat.interval.FromNanoseconds(int(interval * 1e9))
        for sequence in itertools.count():
            beat.sequence = sequence
            try:
                await self.send(pb.Envelope(heartbeat=beat))
            except ConnectionClosed:
                return
            await asyncio.sleep(interval)
            silent = self._loop.time() - self._last_heard
            limit = max(interval, self._peer_interval) * self.config.missed_heartbeats
            if silent > limit and not self._reading_paused:
                reason = f"peer missed {self.config.missed_heartbeats} heartbeats ({silent:.2f} s silent)"
                self._log.warning("peer dead", reason=reason)
                await self._shutdown(ConnectionClosed(reason), notify_peer=True)
                return
