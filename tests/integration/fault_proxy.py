"""A fault-injecting TCP proxy for tests: put it between a dialer and its peer, then break the link.

Listens on 127.0.0.1 port 0 and forwards each accepted connection to ``target``. The mode is
switched at runtime and applies to every connection, open or new:

- ``pass``: forward bytes as they come;
- ``delay``: add ``seconds`` to every chunk, both directions (order kept);
- ``stall``: stop reading both sockets (nothing is buffered here; the kernel's buffers fill),
  keep them open; new connections are accepted and stalled too;
- ``black-hole``: read and discard everything, send nothing, keep the sockets open; a connection
  that lost bytes this way is reset when the mode changes (its byte stream can never heal);
- ``reset``: abort every connection with an RST (SO_LINGER 0), and new ones as they are accepted.

A peer that closes its side closes the other side too (no half-close). Usage::

    async with FaultProxy("127.0.0.1", port) as proxy:
        ...dial 127.0.0.1:proxy.port...
        proxy.stall()
        proxy.pass_()
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
import struct
from types import TracebackType

__all__ = ["FaultProxy", "Mode"]


class Mode(enum.Enum):
    """What the proxy does with the bytes of every connection."""

    PASS = "pass"
    DELAY = "delay"
    STALL = "stall"
    BLACK_HOLE = "black-hole"
    RESET = "reset"


def _abort_with_rst(transport: asyncio.Transport) -> None:
    """Abort ``transport`` so that the peer gets an RST rather than a FIN."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _Half(asyncio.Protocol):
    """One socket of a proxied connection: what it reads goes to ``peer``; it writes its own queue."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self.peer: _Half | None = None
        self.transport: asyncio.Transport | None = None
        self._queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._writer = asyncio.get_running_loop().create_task(self._write_forever())
        self.link.made(self)

    def data_received(self, data: bytes) -> None:
        proxy = self.link.proxy
        if proxy.mode is Mode.BLACK_HOLE:
            self.link.damaged = True
            return
        if self.peer is not None:
            delay = proxy.delay_seconds if proxy.mode is Mode.DELAY else 0.0
            self.peer._queue.put_nowait((asyncio.get_running_loop().time() + delay, data))

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.close()

    def apply(self, mode: Mode) -> None:
        """Read or not, as ``mode`` and the link's state say."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if mode is Mode.STALL or not self.link.connected:
            transport.pause_reading()
        else:
            transport.resume_reading()

    def close(self, *, rst: bool) -> None:
        if self._writer is not None:
            self._writer.cancel()
        if self.transport is not None and not self.transport.is_closing():
            if rst:
                _abort_with_rst(self.transport)
            else:
                self.transport.close()

    async def _write_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await self._queue.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            await self.link.proxy.flowing.wait()  # stalled: hold what was already read
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(data)


class _Link:
    """One proxied connection: the accepted socket and the one dialed to the target."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.client = _Half(self)
        self.upstream = _Half(self)
        self.client.peer, self.upstream.peer = self.upstream, self.client
        self.connected = False
        self.damaged = False
        """Bytes were discarded in black-hole mode."""
        self.closed = False

    def made(self, half: _Half) -> None:
        if half is self.client:
            self.proxy.links.add(self)
            self.proxy.accepted += 1
            if self.proxy.mode is Mode.RESET:
                self.close(rst=True)
                return
            half.apply(self.proxy.mode)  # paused until the target answers
            dial = asyncio.get_running_loop().create_task(self._dial())
            self.proxy.dials.add(dial)
            dial.add_done_callback(self.proxy.dials.discard)
        elif self.closed:  # closed while dialing
            half.close(rst=True)
        else:
            self.connected = True
            self.apply(self.proxy.mode)

    async def _dial(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(lambda: self.upstream, self.proxy.target_host, self.proxy.target_port)
        except OSError:
            self.close(rst=True)

    def apply(self, mode: Mode) -> None:
        if mode is Mode.RESET or (self.damaged and mode is not Mode.BLACK_HOLE):
            self.close(rst=True)
            return
        self.client.apply(mode)
        self.upstream.apply(mode)

    def close(self, *, rst: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        self.proxy.links.discard(self)
        self.client.close(rst=rst)
        self.upstream.close(rst=rst)


class FaultProxy:
    """A TCP proxy to ``target_host:target_port`` whose faults are switched at runtime."""

    def __init__(self, target_host: str, target_port: int, *, host: str = "127.0.0.1") -> None:
        self.target_host, self.target_port, self.host = target_host, target_port, host
        self.mode = Mode.PASS
        self.delay_seconds = 0.0
        self.accepted = 0
        """Connections accepted so far."""
        self.links: set[_Link] = set()
        self.dials: set[asyncio.Task[None]] = set()
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The port it listens on."""
        assert self._server is not None, "not started"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> FaultProxy:
        self._server = await asyncio.get_running_loop().create_server(lambda: _Link(self).client, self.host, 0)
        return self

    async def close(self) -> None:
        """Stop listening and close every connection."""
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.close()
        for task in self.dials:
            task.cancel()
        await asyncio.gather(*self.dials, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()

    def set_mode(self, mode: Mode, delay: float = 0.0) -> None:
        """Switch every connection, open or new, to ``mode``."""
        self.mode, self.delay_seconds = mode, delay
        if mode is Mode.STALL:
            self.flowing.clear()
        else:
            self.flowing.set()
        for link in list(self.links):
            link.apply(mode)

    def pass_(self) -> None:
        """Forward bytes as they come (and reset connections a black hole damaged)."""
        self.set_mode(Mode.PASS)

    def delay(self, seconds: float) -> None:
        """Add ``seconds`` to every chunk, both directions."""
        self.set_mode(Mode.DELAY, seconds)

    def stall(self) -> None:
        """Stop reading both sides of every connection; keep them open."""
        self.set_mode(Mode.STALL)

    def black_hole(self) -> None:
        """Read and discard everything, send nothing; keep the sockets open."""
        self.set_mode(Mode.BLACK_HOLE)

    def reset(self) -> None:
        """Abort every connection with an RST, and each new one as it is accepted, until the mode changes."""
        self.set_mode(Mode.RESET)
