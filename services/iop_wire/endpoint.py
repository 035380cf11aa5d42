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
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import structlog

from iop_wire.codec import CODECS, Codec, get_codec
from iop_wire.connection import Connection, ConnectionConfig, Handler
from iop_wire.errors import ConnectionClosed, ErrorCode, FrameError, HandshakeError, IopError
from iop_wire.framing import HEADER_SIZE, encode_frame
from iop_wire.messages import error_envelope
from iop_wire.tls import PeerIdentity, Role, TlsConfig, client_context, peer_identity, server_context

__all__ = ["Listener", "ListenerConfig", "dial", "open_stream", "preface"]

_log = structlog.get_logger("iop.wire")
_PREFACE_PREFIX = b"IOP/1 "
_MAX_PREFACE = 64


def preface(codec: str) -> bytes:
    """The preface frame asking for (or accepting) ``codec``."""
    return bytes(encode_frame(_PREFACE_PREFIX + codec.encode()))


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    """Where and how a service listens."""

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
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    """Limits and timers of each accepted connection."""


class Listener:
    """Accepts IOP connections and serves each with the handler made for its peer."""

    def __init__(self, config: ListenerConfig, handler: Callable[[PeerIdentity], Handler | None]) -> None:
        self.config = config
        self.connections: set[Connection] = set()
        self._make_handler = handler
        self._ssl = server_context(config.tls) if config.tls.enabled else None
        self._server: asyncio.Server | None = None
        self._handshaking: set[asyncio.StreamWriter] = set()

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
        self._handshaking.add(writer)
        address = writer.get_extra_info("peername")
        log = _log.bind(remote=f"{address[0]}:{address[1]}" if address else "?")
        try:
            connection = await asyncio.wait_for(self._handshake(reader, writer, log), self.config.handshake_timeout)
        except (ssl.SSLError, ConnectionError, OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.warning("handshake failed", reason=_reason(exc))
            writer.transport.abort()
            return
        finally:
            self._handshaking.discard(writer)
        if connection is None:
            return
        self.connections.add(connection)
        try:
            await connection.wait_closed()
        finally:
            self.connections.discard(connection)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log: structlog.typing.FilteringBoundLogger
    ) -> Connection | None:
        if self._ssl is not None:
            await writer.start_tls(self._ssl)
        peer = peer_identity(writer.get_extra_info("ssl_object"))
        asked = await _read_preface(reader)
        codec = CODECS.get(asked or "")
        if asked not in self.config.codecs:
            accepted = ", ".join(self.config.codecs)
            error = HandshakeError(
                ErrorCode.CODEC_MISMATCH,
                f"codec mismatch: client asked for {asked or 'no valid preface'}, server accepts {accepted}",
            )
            await _refuse(writer, codec or CODECS["proto"], error, log)
            return None
        assert codec is not None
        allowed = self.config.allowed_roles
        if allowed is not None and peer.role not in allowed:
            names = ", ".join(sorted(allowed))
            error = HandshakeError(
                ErrorCode.PERMISSION_DENIED,
                f"role {peer.role or '(none)'} of {peer.name or 'anonymous'} may not connect here; allowed: {names}",
            )
            await _refuse(writer, codec, error, log)
            return None
        writer.write(preface(codec.name))
        label = f"{peer.name or 'anonymous'}/{codec.name}"
        return Connection(
            reader,
            writer,
            codec,
            peer=peer,
            handler=self._make_handler(peer),
            config=self.config.connection,
            label=label,
        ).start()


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
    log.warning("connection refused", reason=error.message, code=error.code.name)
    writer.write(encode_frame(codec.encode(error_envelope(error))))
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
        return HandshakeError(ErrorCode.PROTOCOL_VIOLATION, "listener answered the preface with a non-error")
    err = envelope.error
    return HandshakeError(ErrorCode(err.code), err.message, retryable=err.retryable)


async def dial(
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
) -> Connection:
    """Open an IOP connection to ``host:port``; ``handler`` serves what the peer asks of us."""
    reader, writer = await open_stream(
        host, port, tls=tls, codec=codec, server_hostname=server_hostname, timeout=timeout
    )
    peer = peer_identity(writer.get_extra_info("ssl_object"))
    if expect_roles is not None and peer.role not in expect_roles:
        writer.close()
        raise HandshakeError(
            ErrorCode.PERMISSION_DENIED, f"server {peer.name!r} has role {peer.role}, expected {sorted(expect_roles)}"
        )
    return Connection(
        reader, writer, get_codec(codec), peer=peer, handler=handler, config=config, label=f"{host}:{port}"
    ).start()
