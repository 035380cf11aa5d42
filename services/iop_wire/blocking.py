"""A blocking client: one connection, one request at a time, no asyncio.

For a process that asks one thing and exits (``iop nodes ls``): it pays for every import, and the
:class:`~iop_wire.connection.Connection` that :func:`~iop_wire.endpoint.dial` opens brings asyncio,
structlog and prometheus_client, most of such a command's time. This client speaks the same
preface and envelopes over a plain blocking socket. It serves nothing (a request from the peer goes
unanswered); it beats only while it waits for an answer, once for each of the peer's heartbeats (the
peer drops a silent connection). Services use ``dial``.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections import deque
from itertools import count
from types import TracebackType

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import get_codec, preface_refusal
from iop_wire.errors import ConnectionClosed, IopError
from iop_wire.framing import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, encode_frame, preface
from iop_wire.messages import error_envelope

__all__ = ["BlockingClient"]

_READ_SIZE = 256 * 1024


class BlockingClient:
    """An open IOP connection, used from one thread: :meth:`connect`, :meth:`request`, :meth:`close`.

    ``with BlockingClient.connect(...) as client:`` closes it on the way out.
    """

    def __init__(self, sock: socket.socket, *, codec: str, max_frame_size: int) -> None:
        self._sock = sock
        self._codec = get_codec(codec)
        self._max_frame_size = max_frame_size
        self._decoder = FrameDecoder(max_frame_size)
        self._frames: deque[bytes] = deque()
        self._ids = count(1)
        self._beats = count()

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        *,
        context: ssl.SSLContext | None,
        server_hostname: str | None = None,
        codec: str = "proto",
        timeout: float = 10.0,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> BlockingClient:
        """Connect, complete TLS (with ``context``) and the preface within ``timeout`` seconds.

        Raises what :func:`~iop_wire.endpoint.dial` does: the listener's refusal as an IopError
        (:class:`~iop_wire.errors.ConnectionClosed` when it hung up or TLS failed), TimeoutError,
        or OSError when it cannot be reached."""
        deadline = time.monotonic() + timeout
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            if context is not None:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))  # the handshake shares the deadline
                sock = context.wrap_socket(sock, server_hostname=server_hostname or host)
            client = cls(sock, codec=codec, max_frame_size=max_frame_size)
            sock.sendall(preface(codec))
            refusal = preface_refusal(client._preface_answer(deadline), client._codec)
        except BaseException:
            sock.close()
            raise
        if refusal is not None:
            sock.close()
            raise refusal
        return client

    def request(self, envelope: pb.Envelope, timeout: float = 10.0) -> pb.Envelope:
        """Send ``envelope`` and return the envelope answering it; an Error answer is raised as IopError."""
        deadline = time.monotonic() + timeout
        self._send(envelope)
        while True:
            answer = self._codec.decode(self._next_frame(deadline))
            is_error = answer.WhichOneof("body") == "error"
            if answer.in_reply_to == envelope.id:
                if is_error:
                    raise IopError.from_message(answer.error)
                return answer
            if is_error and not answer.in_reply_to:  # the peer is closing the connection
                raise ConnectionClosed(answer.error.message, answer.error.code)
            if answer.WhichOneof("body") == "heartbeat":  # at the peer's interval: it expects as much of us
                beat = pb.Heartbeat(sequence=next(self._beats), interval=answer.heartbeat.interval)
                self._send(pb.Envelope(heartbeat=beat))

    def close(self, reason: str = "done") -> None:
        """Tell the peer we are going (as a Connection's graceful close does), then close the socket."""
        try:
            self._send(error_envelope(ConnectionClosed(reason, pb.ERROR_CODE_SHUTTING_DOWN)))
        except OSError:
            pass  # it is gone already
        finally:
            self._sock.close()

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def _send(self, envelope: pb.Envelope) -> None:
        envelope.id = envelope.id or str(next(self._ids))
        envelope.sent_at.FromNanoseconds(time.time_ns())
        self._sock.sendall(encode_frame(self._codec.encode(envelope), self._max_frame_size))

    def _preface_answer(self, deadline: float) -> bytes:
        """The listener's first frame; a TLS alert or a hang-up here means it refused us."""
        try:
            return self._next_frame(deadline)
        except ssl.SSLError as exc:
            raise ConnectionClosed(f"listener refused the connection: {exc.reason or exc}") from None
        except ConnectionError as exc:
            raise ConnectionClosed(f"listener refused the connection: {exc}") from None

    def _next_frame(self, deadline: float) -> bytes:
        while not self._frames:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no answer in time")
            self._sock.settimeout(remaining)
            data = self._sock.recv(_READ_SIZE)
            if not data:
                raise ConnectionClosed("peer closed the connection")
            self._frames.extend(self._decoder.feed(data))
        return self._frames.popleft()
