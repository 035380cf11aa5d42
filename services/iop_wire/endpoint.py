"""Listening and dialing: TLS handshake, the connection preface, role checks.

The preface agrees on the codec before any envelope is sent. The dialer's first frame is the
ASCII text ``IOP/1 <codec>`` (``proto`` or ``json``). A listener that accepts that codec (and
the dialer's role) answers with the same frame, and both ends then exchange envelopes in that
codec. Otherwise it answers with one Error envelope, encoded in the codec the dialer asked for
when it knows it (protobuf binary if not), and closes the connection.

A listener binds one socket per address in ``hosts``, all on one port. After TLS and before it
answers the preface, it refuses a peer whose role it does not take, and asks its ``screen`` (a
control-plane's revoked certificates) about every verified peer. With ``certless`` it also
takes TLS peers without a certificate (machines joining): they are served by the handler made
for :data:`~iop_wire.tls.CERTLESS`, count against the per-address bounds, and are closed after
``certless_timeout``.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
import struct
import time
from collections import Counter
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import structlog

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import CODECS, Codec, get_codec, preface_refusal
from iop_wire.connection import Connection, ConnectionConfig, Handler
from iop_wire.errors import ConnectionClosed, FrameError, HandshakeError, IopError
from iop_wire.framing import HEADER_SIZE, PREFACE_PREFIX, encode_frame, preface
from iop_wire.logs import RateLimitedLog, library_logger
from iop_wire.messages import error_envelope
from iop_wire.metrics import HANDSHAKES, LIMIT_HITS
from iop_wire.tls import PeerIdentity, Role, TlsConfig, client_context, peer_identity, server_context

__all__ = ["HandlerFactory", "Listener", "ListenerConfig", "Screen", "dial", "open_stream", "preface"]

_log = library_logger("iop.wire")  # silent below WARNING until the application configures logging
_MAX_PREFACE = 64


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    """Where and how a service listens, and how much any peer may make it hold."""

    hosts: tuple[str, ...] = ("127.0.0.1",)
    """Addresses to bind, one socket each, all on ``port``."""
    port: int = 0
    """Port to bind; 0: the first address picks a free one, the others take the same (see :attr:`Listener.port`)."""
    tls: TlsConfig = field(default_factory=TlsConfig)
    """mTLS settings; with ``enabled`` every client must present a certificate from ``ca``."""
    codecs: tuple[str, ...] = ("proto", "json")
    """Codecs dialers may ask for."""
    allowed_roles: frozenset[Role] | None = None
    """Certificate roles accepted; None accepts any verified certificate."""
    certless: bool = False
    """Also take TLS peers that present no certificate (``ssl.CERT_OPTIONAL``), served by the handler made
    for :data:`~iop_wire.tls.CERTLESS`; a certificate that is presented is verified as always."""
    certless_timeout: float = 30.0
    """Seconds a certless peer's connection stays open, whatever it does."""
    max_certless: int = 32
    """Certless connections open at once, from all addresses: nobody vouched for them, so they may
    never take the room of peers with certificates (a joiner needs one for about a second)."""
    max_certless_per_address: int = 4
    """Certless connections open at once from one source address."""
    handshake_timeout: float = 10.0
    """Seconds a dialer has for the TLS handshake and the preface."""
    first_byte_timeout: float = 3.0
    """Seconds an accepted socket may stay silent before its first byte (a TLS hello comes at once)."""
    max_connections: int = 1024
    """Connections open at once (handshaking ones included); more are closed at accept."""
    max_connections_per_peer: int = 64
    """Connections open at once per certificate name (per address without TLS)."""
    max_handshakes: int = 64
    """TLS handshakes and prefaces under way at once; more are closed at accept."""
    max_handshakes_per_address: int = 16
    """Handshakes under way at once from one source IP address; more from it are closed at accept,
    so one address cannot fill ``max_handshakes`` and starve everyone else."""
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    """Limits and timers of each accepted connection."""

    @property
    def host(self) -> str:
        """The first address bound (the one to name in messages)."""
        return self.hosts[0]


HandlerFactory = Callable[[PeerIdentity], Handler | None]
Screen = Callable[[PeerIdentity], IopError | None]
"""Asked about every peer with a verified certificate after TLS: an error refuses it at the preface."""


class Listener:
    """Accepts IOP connections and serves each with the handler made for its peer.

    ``async with Listener(config, handler) as listener:`` starts it and closes it (and every
    connection, gracefully) on the way out.
    """

    def __init__(
        self, config: ListenerConfig, handler: Handler | HandlerFactory | None = None, *, screen: Screen | None = None
    ) -> None:
        self.config = config
        self.connections: set[Connection] = set()
        self._make_handler: HandlerFactory = (lambda _: handler) if isinstance(handler, Handler | None) else handler
        self._screen = screen
        self._ssl = server_context(config.tls, certless=config.certless) if config.tls.enabled else None
        self._sockets: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        """One per accepted socket: its handshake, then its connection's life."""
        self._handshaking: set[asyncio.Task[None]] = set()
        """The tasks among those still in their TLS handshake or preface."""
        self._unstarted: set[socket.socket] = set()
        """Accepted sockets whose task has not run yet: closed here if it is cancelled first."""
        self._per_peer: Counter[str] = Counter()
        self._certless = 0
        """Certless connections open (counted once their preface is answered)."""
        self._handshakes_from: Counter[str] = Counter()
        """Handshakes under way, by source IP address."""
        self._log_limiter = RateLimitedLog()

    @property
    def port(self) -> int:
        """The bound port (the same on every address)."""
        assert self._sockets, "listener not started"
        port: int = self._sockets[0].getsockname()[1]
        return port

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Every bound (host, port)."""
        return [(str(name[0]), int(name[1])) for name in (listening.getsockname() for listening in self._sockets)]

    async def start(self) -> Listener:
        """Bind every host and start accepting; returns self. OSError (port in use, unknown host) if
        one cannot be bound (then none is)."""
        port = self.config.port
        try:
            for host in self.config.hosts:
                listening = await _bind(host, port)
                self._sockets.append(listening)
                port = listening.getsockname()[1]  # port 0: the others take the port the first got
        except BaseException:
            for listening in self._sockets:
                listening.close()
            self._sockets.clear()
            raise
        self._accepting = [
            asyncio.create_task(self._accept_loop(listening), name="iop-accept") for listening in self._sockets
        ]
        return self

    async def __aenter__(self) -> Listener:
        return await self.start()

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()

    def stop_accepting(self) -> None:
        """Stop taking new connections; the open ones go on."""
        for task in self._accepting:
            task.cancel()
        for listening in self._sockets:
            listening.close()

    async def close(self, reason: str = "server shutting down") -> None:
        """Stop accepting and close every connection gracefully."""
        self.stop_accepting()
        for task in list(self._handshaking):  # cut off: nothing there to close gracefully
            task.cancel()
        await asyncio.gather(*(c.close(reason) for c in list(self.connections)), return_exceptions=True)
        await asyncio.gather(*self._accepting, *self._tasks, return_exceptions=True)

    async def _accept_loop(self, listening: socket.socket) -> None:
        """Accept sockets; each gets its TLS handshake and preface in a task of its own."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await _accepted(listening)
            except OSError as exc:  # out of descriptors, or the socket closed under us
                if listening.fileno() == -1:
                    return
                _log.warning("accept failed", reason=str(exc))
                await asyncio.sleep(0.1)
                continue
            host = str(address[0]) if address else "?"
            remote = f"{host}:{address[1]}" if address else "?"
            if not self._admit(host, remote):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset, not FIN
                conn.close()
                continue
            self._unstarted.add(conn)
            task = loop.create_task(self._accept(conn, host, _log.bind(remote=remote)))
            task.add_done_callback(functools.partial(self._close_if_never_started, conn))
            self._tasks.add(task)
            self._handshaking.add(task)  # counted from now: the next accept sees it
            self._handshakes_from[host] += 1
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(self._handshaking.discard)

    def _close_if_never_started(self, conn: socket.socket, _: asyncio.Task[None]) -> None:
        # A task cancelled before its first step (the listener closing) never runs a line of _accept.
        if conn in self._unstarted:
            self._unstarted.discard(conn)
            conn.close()

    async def _accept(self, conn: socket.socket, host: str, log: structlog.typing.FilteringBoundLogger) -> None:
        self._unstarted.discard(conn)
        accepted = await self._accept_handshake(conn, host, log)
        if accepted is None:
            return
        connection, key = accepted
        self.connections.add(connection)
        certless = connection.peer.certless
        self._certless += certless
        try:
            if certless:
                await _close_after(connection, self.config.certless_timeout)
            await connection.wait_closed()
        finally:
            self._certless -= certless
            self.connections.discard(connection)
            self._per_peer[key] -= 1
            if self._per_peer[key] <= 0:
                del self._per_peer[key]

    async def _accept_handshake(
        self, conn: socket.socket, host: str, log: structlog.typing.FilteringBoundLogger
    ) -> tuple[Connection, str] | None:
        """The first byte, TLS and the preface, within their timeouts; None when refused or failed."""
        HANDSHAKES.inc()
        writer = None
        try:
            async with asyncio.timeout(self.config.handshake_timeout):
                await _first_byte(conn, self.config.first_byte_timeout)
                reader, writer = await self._open(conn)
                return await self._handshake(reader, writer, log)
        except (ssl.SSLError, ConnectionError, OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            if isinstance(exc, _SilentSocket):
                LIMIT_HITS.labels("first_byte_timeout").inc()
            elif isinstance(exc, TimeoutError):
                LIMIT_HITS.labels("handshake_timeout").inc()
            # A peer can fail handshakes in a loop: logged at most once a second, with the count.
            self._log_limiter.warning("handshake failed", log, "handshake failed", reason=_reason(exc))
            _drop(conn, writer)
            return None
        except asyncio.CancelledError:
            _drop(conn, writer)
            raise
        finally:
            HANDSHAKES.dec()
            self._handshaking.discard(asyncio.current_task())
            self._handshakes_from[host] -= 1
            if self._handshakes_from[host] <= 0:
                del self._handshakes_from[host]

    async def _open(self, conn: socket.socket) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The accepted socket as a stream pair, TLS done: a failed handshake raises here, to be logged."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(reader)
        timeout = self.config.handshake_timeout if self._ssl is not None else None
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol, conn, ssl=self._ssl, ssl_handshake_timeout=timeout
        )
        return reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    def _admit(self, host: str, remote: str) -> bool:
        """Refuse a new connection at once when the listener is full or too many handshakes run
        (from its address, or in all)."""
        limit = None
        if len(self.connections) + len(self._handshaking) >= self.config.max_connections:
            limit, value = "connections", self.config.max_connections
        elif self._handshakes_from[host] >= self.config.max_handshakes_per_address:
            limit, value = "handshakes_per_address", self.config.max_handshakes_per_address
        elif len(self._handshaking) >= self.config.max_handshakes:
            limit, value = "handshakes", self.config.max_handshakes
        if limit is None:
            return True
        LIMIT_HITS.labels(limit).inc()
        reason = f"{limit.replace('_', ' ')} limit reached"
        self._log_limiter.warning(limit, _log, "connection refused", reason=reason, limit=value, remote=remote)
        return False

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log: structlog.typing.FilteringBoundLogger
    ) -> tuple[Connection, str] | None:
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
        if (refusal := self._refusal(peer)) is not None:
            await _refuse(writer, codec, refusal, log)
            return None
        address = writer.get_extra_info("peername")
        key = peer.name if peer.name else f"address {address[0] if address else '?'}"
        if (full := self._full(peer, key)) is not None:
            await _refuse(writer, codec, full, log)
            return None
        self._per_peer[key] += 1
        writer.write(preface(codec.name))
        label = f"{peer.name or ('certless' if peer.certless else 'anonymous')}/{codec.name}"
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

    def _full(self, peer: PeerIdentity, key: str) -> HandshakeError | None:
        """RESOURCE_EXHAUSTED when ``peer`` (``key``: its name, or address) has all the connections it
        may hold here: per peer, and for a certless one also per address and in all; None when not."""
        config = self.config
        if peer.certless:
            limit = min(config.max_certless_per_address, config.max_connections_per_peer)
            what = f"{key} already has {{}} certless connections open here"
            if self._per_peer[key] < limit and self._certless >= config.max_certless:
                limit, what = config.max_certless, "{} certless connections are open here (machines joining)"
                LIMIT_HITS.labels("certless_connections").inc()
                return HandshakeError(pb.ERROR_CODE_RESOURCE_EXHAUSTED, what.format(limit), retryable=True)
        else:
            limit, what = config.max_connections_per_peer, f"{key} already has {{}} connections open here"
        if self._per_peer[key] < limit:
            return None
        LIMIT_HITS.labels("connections_per_peer").inc()
        return HandshakeError(pb.ERROR_CODE_RESOURCE_EXHAUSTED, what.format(limit), retryable=True)

    def _refusal(self, peer: PeerIdentity) -> IopError | None:
        """Why ``peer`` may not connect here (its role, or the screen's verdict); None when it may."""
        if peer.certless:
            if self.config.certless:
                return None
            # Only a listener taking certless peers lets TLS through without a certificate.
            return HandshakeError(pb.ERROR_CODE_PERMISSION_DENIED, "a client certificate is required here")
        allowed = self.config.allowed_roles
        if allowed is not None and peer.role not in allowed:
            names = ", ".join(sorted(allowed))
            return HandshakeError(
                pb.ERROR_CODE_PERMISSION_DENIED,
                f"role {peer.role or '(none)'} of {peer.name or 'anonymous'} may not connect here; allowed: {names}",
            )
        if self._screen is not None and peer.serial:
            return self._screen(peer)
        return None


async def _bind(host: str, port: int) -> socket.socket:
    """A listening, non-blocking socket on ``host:port``."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    listening = socket.socket(family, kind, proto)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(address)
        listening.listen(min(socket.SOMAXCONN, 4096))
        listening.setblocking(False)  # noqa: FBT003 - the socket API takes it positionally
    except BaseException:
        listening.close()
        raise
    return listening


async def _close_after(connection: Connection, seconds: float) -> None:
    """Close ``connection`` once ``seconds`` have passed (unless it closed before)."""
    try:
        await asyncio.wait_for(connection.wait_closing(), seconds)
    except TimeoutError:
        await connection.close(f"a connection without a certificate is closed after {seconds:g} s")


def _drop(conn: socket.socket, writer: asyncio.StreamWriter | None) -> None:
    """Cut a connection whose handshake did not finish (no goodbye: there is no one to say it to)."""
    if writer is not None:
        writer.transport.abort()
    else:
        conn.close()


class _SilentSocket(TimeoutError):
    """The accepted socket sent nothing within ``first_byte_timeout``."""


async def _first_byte(conn: socket.socket, timeout: float) -> None:
    """Wait until ``conn`` has something to read (or is closed); _SilentSocket after ``timeout``.

    Before any TLS state is allocated: a socket that never says hello costs a descriptor for
    ``timeout`` seconds, not a handshake slot for ``handshake_timeout``.
    """
    try:
        await asyncio.wait_for(_readable(conn), timeout)
    except TimeoutError:
        raise _SilentSocket(f"no first byte within {timeout:g} s") from None


async def _accepted(listening: socket.socket) -> tuple[socket.socket, Any]:
    """The next connection on ``listening``, non-blocking. Unlike loop.sock_accept, a cancel cannot
    lose one: the accept happens in this task's own step, never in a callback whose result it drops."""
    while True:
        try:
            conn, address = listening.accept()
        except (BlockingIOError, InterruptedError):
            await _readable(listening)
            continue
        conn.setblocking(False)  # noqa: FBT003 - the socket API takes it positionally
        return conn, address


async def _readable(sock: socket.socket) -> None:
    """Return once ``sock`` has something to read (a connection to accept, or is closed)."""
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not readable.done():
            readable.set_result(None)

    fd = sock.fileno()
    loop.add_reader(fd, ready)
    try:
        await readable
    finally:
        loop.remove_reader(fd)


async def _read_preface(reader: asyncio.StreamReader) -> str | None:
    """The codec a dialer's preface asks for, or None if the first frame is no preface."""
    size = int.from_bytes(await reader.readexactly(HEADER_SIZE), "big")
    if not 0 < size <= _MAX_PREFACE:
        return None
    body = await reader.readexactly(size)
    if not body.startswith(PREFACE_PREFIX):
        return None
    return body[len(PREFACE_PREFIX) :].decode("ascii", "replace")


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
    if isinstance(exc, _SilentSocket):
        return str(exc)
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
    context: ssl.SSLContext | None = None,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect, complete TLS and the preface, and return the raw stream pair.

    ``context`` replaces the one ``tls`` would build (a machine joining has no certificate yet:
    see :func:`iop_wire.tls.certless_context`)."""
    get_codec(codec)
    context = context or (client_context(tls) if tls.enabled else None)
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
    return preface_refusal(body, get_codec(codec))


class dial:  # noqa: N801 - used like a function: ``await dial(...)`` or ``async with dial(...) as c``
    """Open an IOP connection to ``host:port``; ``handler`` serves what the peer asks of us.

    ``connection = await dial(...)`` returns it open; ``async with dial(...) as connection:``
    also closes it (gracefully) on the way out. ``context`` replaces the TLS context ``tls`` would
    build (:func:`iop_wire.tls.certless_context` for a machine joining).
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
        context: ssl.SSLContext | None = None,
    ) -> None:
        self._args = (host, port, tls, codec, handler, config, server_hostname, expect_roles, timeout, context)
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
        host, port, tls, codec, handler, config, server_hostname, expect_roles, timeout, context = self._args
        reader, writer = await open_stream(
            host, port, tls=tls, codec=codec, server_hostname=server_hostname, timeout=timeout, context=context
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
