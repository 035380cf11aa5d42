"""Listening and dialing: TLS handshake, the connection preface, role checks.

The preface agrees on the codec before any envelope is sent. The dialer's first frame is the
ASCII text ``IOP/1 <codec>`` (``proto`` or ``json``). A listener that accepts that codec (and
the dialer's role) answers with the same frame, and both ends then exchange envelopes in that
codec. Otherwise it answers with one Error envelope, encoded in the codec the dialer asked for
when it knows it (protobuf binary if not), and closes the connection.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import Counter
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass, field
from types import TracebackType

import structlog

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import CODECS, Codec, get_codec
from iop_wire.connection import Connection, ConnectionConfig, Handler
from iop_wire.errors import ConnectionClosed, FrameError, HandshakeError, IopError
from iop_wire.framing import HEADER_SIZE, encode_frame
from iop_wire.logs import library_logger
from iop_wire.messages import error_envelope
from iop_wire.metrics import HANDSHAKES, LIMIT_HITS
from iop_wire.tls import PeerIdentity, Role, TlsConfig, client_context, peer_identity, server_context

__all__ = ["HandlerFactory", "Listener", "ListenerConfig", "dial", "open_stream", "preface"]

_log = library_logger("iop.wire")  # silent below WARNING until the application configures logging
_PREFACE_PREFIX = b"IOP/1 "
_MAX_PREFACE = 64


def preface(codec: str) -> bytes:
    """The preface frame asking for (or accepting) ``codec``."""
    return bytes(encode_frame(_PREFACE_PREFIX + codec.encode()))


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    """Where and how a service listens, and how much any peer may make it hold."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 0
    """Port to bind; 0 picks a free one (see :attr:`Listener.port`)."""
    tls: TlsConfig = field(default_factory=TlsConfig)
    """mTLS settings; with ``enabled`` every client must present a certificate from ``ca``."""
    codecs: tuple[str, ...] = ("proto", "json")
    """Codecs dialers may ask for."""
    allowed_roles: frozenset[Role] | None = None
    """Certificate roles accepted; None accepts any verified certificate."""
    handshake_timeout: float = 10.0
    """Seconds a dialer has for the TLS handshake and the preface."""
    max_connections: int = 1024
    """Connections open at once (handshaking ones included); more are closed at accept."""
    max_connections_per_peer: int = 64
    """Connections open at once per certificate name (per address without TLS)."""
    max_handshakes: int = 64
    """TLS handshakes and prefaces under way at once; more are closed at accept."""
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    """Limits and timers of each accepted connection."""


HandlerFactory = Callable[[PeerIdentity], Handler | None]


class Listener:
    """Accepts IOP connections and serves each with the handler made for its peer.

    ``async with Listener(config, handler) as listener:`` starts it and closes it (and every
    connection, gracefully) on the way out.
    """

    def __init__(self, config: ListenerConfig, handler: Handler | HandlerFactory | None = None) -> None:
        self.config = config
        self.connections: set[Connection] = set()
        self._make_handler: HandlerFactory = (lambda _: handler) if isinstance(handler, Handler | None) else handler
        self._ssl = server_context(config.tls) if config.tls.enabled else None
        self._server: asyncio.Server | None = None
        self._handshaking: set[asyncio.StreamWriter] = set()
        self._per_peer: Counter[str] = Counter()

    @property
    def port(self) -> int:
        """The bound port."""
        assert self._server is not None, "listener not started"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> Listener:
        """Bind and start accepting; returns self."""
        loop = asyncio.get_running_loop()
        pause = self._ssl is not None

        def protocol() -> asyncio.StreamReaderProtocol:
            return _AcceptProtocol(asyncio.StreamReader(), self._accept, pause=pause)

        self._server = await loop.create_server(protocol, self.config.host, self.config.port)
        return self

    async def __aenter__(self) -> Listener:
        return await self.start()

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()

    def stop_accepting(self) -> None:
        """Stop taking new connections; the open ones go on."""
        if self._server is not None:
            self._server.close()

    async def close(self, reason: str = "server shutting down") -> None:
        """Stop accepting and close every connection gracefully."""
        self.stop_accepting()
        for writer in list(self._handshaking):
            writer.transport.abort()
        await asyncio.gather(*(c.close(reason) for c in list(self.connections)), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address = writer.get_extra_info("peername")
        remote = f"{address[0]}:{address[1]}" if address else "?"
        log = _log.bind(remote=remote)
        if not self._admit(writer, log):
            return
        self._handshaking.add(writer)
        HANDSHAKES.inc()
        try:
            accepted = await asyncio.wait_for(self._handshake(reader, writer, log), self.config.handshake_timeout)
        except (ssl.SSLError, ConnectionError, OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            if isinstance(exc, TimeoutError):
                LIMIT_HITS.labels("handshake_timeout").inc()
            log.warning("handshake failed", reason=_reason(exc))
            writer.transport.abort()
            return
        finally:
            self._handshaking.discard(writer)
            HANDSHAKES.dec()
        if accepted is None:
            return
        connection, key = accepted
        self.connections.add(connection)
        try:
            await connection.wait_closed()
        finally:
            self.connections.discard(connection)
            self._per_peer[key] -= 1
            if self._per_peer[key] <= 0:
                del self._per_peer[key]

    def _admit(self, writer: asyncio.StreamWriter, log: structlog.typing.FilteringBoundLogger) -> bool:
        """Close a new connection at once when the listener is full or too many handshakes run."""
        limit = None
        if len(self.connections) + len(self._handshaking) >= self.config.max_connections:
            limit, value = "connections", self.config.max_connections
        elif len(self._handshaking) >= self.config.max_handshakes:
            limit, value = "handshakes", self.config.max_handshakes
        if limit is None:
            return True
        LIMIT_HITS.labels(limit).inc()
        log.warning("connection refused", reason=f"{limit} limit reached", limit=value)
        writer.transport.abort()
        return False

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log: structlog.typing.FilteringBoundLogger
    ) -> tuple[Connection, str] | None:
        if self._ssl is not None:
            await writer.start_tls(self._ssl)
        peer = peer_identity(writer.get_extra_info("ssl_object"))
        asked = await _read_preface(reader)
        codec = CODECS.get(asked or "")
        if asked not in self.config.codecs:
            accepted = ", ".join(self.config.codecs)
            error = HandshakeError(
                pb.ERROR_CODE_CODEC_MISMATCH,
                f"codec mismatch: client asked for {asked or 'no valid preface'}, server accepts {accepted}",
            )
            await _refuse(writer, codec or CODECS["proto"], error, log)
            return None
        assert codec is not None
        allowed = self.config.allowed_roles
        if allowed is not None and peer.role not in allowed:
            names = ", ".join(sorted(allowed))
            error = HandshakeError(
                pb.ERROR_CODE_PERMISSION_DENIED,
                f"role {peer.role or '(none)'} of {peer.name or 'anonymous'} may not connect here; allowed: {names}",
            )
            await _refuse(writer, codec, error, log)
            return None
        address = writer.get_extra_info("peername")
        key = peer.name if peer.name else f"address {address[0] if address else '?'}"
        if self._per_peer[key] >= self.config.max_connections_per_peer:
            LIMIT_HITS.labels("connections_per_peer").inc()
            error = HandshakeError(
                pb.ERROR_CODE_RESOURCE_EXHAUSTED,
                f"{key} already has {self.config.max_connections_per_peer} connections open here",
                retryable=True,
            )
            await _refuse(writer, codec, error, log)
            return None
        self._per_peer[key] += 1
        writer.write(preface(codec.name))
        label = f"{peer.name or 'anonymous'}/{codec.name}"
        connection = Connection(
            reader,
            writer,
            codec,
            peer=peer,
            handler=self._make_handler(peer),
            config=self.config.connection,
            label=label,
            side="accepted",
        )
        return connection.start(), key


class _AcceptProtocol(asyncio.StreamReaderProtocol):
    """A stream protocol that reads nothing until TLS starts.

    The TLS handshake runs in the accept callback (``StreamWriter.start_tls``) so that its
    failures reach our log with their reason; reading is paused until then, or the client's
    first TLS record would land in the plaintext stream buffer.
    """

    def __init__(self, reader: asyncio.StreamReader, accept: Callable[..., object], *, pause: bool) -> None:
        super().__init__(reader, accept)  # type: ignore[arg-type]
        self._pause = pause

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._pause:
            transport.pause_reading()  # type: ignore[attr-defined]
        super().connection_made(transport)


async def _read_preface(reader: asyncio.StreamReader) -> str | None:
    """The codec a dialer's preface asks for, or None if the first frame is no preface."""
    size = int.from_bytes(await reader.readexactly(HEADER_SIZE), "big")
    if not 0 < size <= _MAX_PREFACE:
        return None
    body = await reader.readexactly(size)
    if not body.startswith(_PREFACE_PREFIX):
        return None
    return body[len(_PREFACE_PREFIX) :].decode("ascii", "replace")


async def _refuse(
    writer: asyncio.StreamWriter, codec: Codec, error: IopError, log: structlog.typing.FilteringBoundLogger
) -> None:
    log.warning("connection refused", reason=error.message, code=error.name)
    envelope = error_envelope(error)
    envelope.id = "0"  # every envelope has an id and a time, a refusal too
    envelope.sent_at.FromNanoseconds(time.time_ns())
    writer.write(encode_frame(codec.encode(envelope)))
    try:
        await writer.drain()
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 2.0)
    except (ConnectionError, OSError, ssl.SSLError, TimeoutError):
        writer.transport.abort()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"{exc.reason}: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, TimeoutError):
        return "handshake timed out"
    if isinstance(exc, asyncio.IncompleteReadError):
        return "peer closed the connection during the preface"
    return str(exc) or type(exc).__name__


async def open_stream(
    host: str,
    port: int,
    *,
    tls: TlsConfig = TlsConfig(),
    codec: str = "proto",
    server_hostname: str | None = None,
    timeout: float = 10.0,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect, complete TLS and the preface, and return the raw stream pair."""
    get_codec(codec)
    context = client_context(tls) if tls.enabled else None
    hostname = (server_hostname or host) if context else None

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(host, port, ssl=context, server_hostname=hostname)
        try:
            writer.write(preface(codec))
            answer = await _read_answer(reader, codec)
        except BaseException:  # a timeout or an unreadable answer: do not leak the socket
            writer.transport.abort()
            raise
        if answer is not None:
            writer.close()
            raise answer
        return reader, writer

    return await asyncio.wait_for(connect(), timeout)


async def _read_answer(reader: asyncio.StreamReader, codec: str) -> IopError | None:
    """None when the listener accepted the preface, else the error it sent."""
    try:
        size = int.from_bytes(await reader.readexactly(HEADER_SIZE), "big")
        if not 0 < size <= 1024 * 1024:
            raise FrameError(f"preface answer of {size} bytes")
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        return ConnectionClosed("listener closed the connection during the preface")
    except (ssl.SSLError, ConnectionError) as exc:
        return ConnectionClosed(f"listener refused the connection: {_reason(exc)}")
    if body == _PREFACE_PREFIX + codec.encode():
        return None
    envelope = get_codec(codec).decode(body)
    if envelope.WhichOneof("body") != "error":
        return HandshakeError(pb.ERROR_CODE_PROTOCOL_VIOLATION, "listener answered the preface with a non-error")
    err = envelope.error
    return HandshakeError(err.code, err.message, retryable=err.retryable)


class dial:  # noqa: N801 - used like a function: ``await dial(...)`` or ``async with dial(...) as c``
    """Open an IOP connection to ``host:port``; ``handler`` serves what the peer asks of us.

    ``connection = await dial(...)`` returns it open; ``async with dial(...) as connection:``
    also closes it (gracefully) on the way out.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        tls: TlsConfig = TlsConfig(),
        codec: str = "proto",
        handler: Handler | None = None,
        config: ConnectionConfig = ConnectionConfig(),
        server_hostname: str | None = None,
        expect_roles: Collection[Role] | None = None,
        timeout: float = 10.0,
    ) -> None:
        self._args = (host, port, tls, codec, handler, config, server_hostname, expect_roles, timeout)
        self._connection: Connection | None = None

    def __await__(self) -> Generator[object, None, Connection]:
        return self._open().__await__()

    async def __aenter__(self) -> Connection:
        self._connection = await self._open()
        return self._connection

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def _open(self) -> Connection:
        host, port, tls, codec, handler, config, server_hostname, expect_roles, timeout = self._args
        reader, writer = await open_stream(
            host, port, tls=tls, codec=codec, server_hostname=server_hostname, timeout=timeout
        )
        peer = peer_identity(writer.get_extra_info("ssl_object"))
        if expect_roles is not None and peer.role not in expect_roles:
            writer.close()
            raise HandshakeError(
                pb.ERROR_CODE_PERMISSION_DENIED,
                f"server {peer.name!r} has role {peer.role}, expected {sorted(expect_roles)}",
            )
        return Connection(
            reader, writer, get_codec(codec), peer=peer, handler=handler, config=config, label=f"{host}:{port}"
        ).start()
