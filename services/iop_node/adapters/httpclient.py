"""A small HTTP/1.1 client for the backends: one keep-alive connection pool per base URL.

The HTTP adapters ask little of HTTP: JSON requests, JSON answers, and streamed answers read
line by line (SSE, NDJSON). This client does that and nothing more, on an ``asyncio.Protocol``:
on a pooled connection a request goes out in one ``transport.write`` in the task that makes
it, with no await before it, and a response's bytes are parsed by llhttp where they land
(``http11.ResponseReader``, sans-IO). Against aiohttp it takes about 0.1 ms off every
request's time to first byte (README, "Design decisions").

What it speaks: HTTP/1.1 (and 1.0 answers), ``Content-Length``, chunked and close-delimited
bodies, 1xx interim answers skipped, keep-alive unless either side says ``close``, TLS for
``https://``. What it leaves out on purpose: redirects, cookies, proxies, compression (it never
sends ``Accept-Encoding``, so servers answer uncompressed).

A request is written once. A pooled connection found closed (or holding unasked-for bytes)
before the write is replaced by a new one; once written, a request is never sent again: a
close without an answer is ``ServerDisconnected`` and the caller decides. Errors are the tree
in ``httperrors`` (re-exported here).
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import ssl
import time
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import cast

from iop_node.adapters.http11 import DEFAULT_MAX_LINE, LineSplitter, ResponseReader, header_lines
from iop_node.adapters.httperrors import (
    ClientClosed,
    ConnectError,
    ConnectionLost,
    ConnectTimeout,
    HttpError,
    NotSent,
    PoolTimeout,
    ProtocolError,
    ReadTimeout,
    ServerDisconnected,
)

__all__ = [
    "DEFAULT_MAX_LINE",
    "DEFAULT_POOL_TIMEOUT",
    "ClientClosed",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionLost",
    "HttpClient",
    "HttpError",
    "NotSent",
    "PoolTimeout",
    "ProtocolError",
    "ReadTimeout",
    "Response",
    "ServerDisconnected",
]

DEFAULT_POOL_TIMEOUT = 30.0
"""Seconds a request waits for a free connection slot by default."""
_HIGH_WATER = 1024 * 1024  # unread body bytes at which the socket stops being read
# Seconds an idle connection is kept for reuse: under the 5 s after which uvicorn (vLLM,
# llama-cpp-python) and llama.cpp's server close one, so the pool rarely races their close.
_KEEPALIVE = 4.0


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: its response reader, and the one task waiting on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = ResponseReader()
        self.closed = False
        self.error: BaseException | None = None
        """Why the connection closed, when it failed."""
        self.reused = False
        """The current request went out on a connection that had served another."""
        self.idle_since = 0.0
        self.in_use = False
        """True from a request's send until its connection goes back to the pool."""
        self.waiting_since = 0.0
        """When ``more()`` began waiting (loop time); 0 while it is not waiting."""
        self.timed_out: HttpError | None = None
        self.sent_at = 0.0
        """When the current request was written (perf_counter)."""
        self.answered_at = 0.0
        """When its response's last byte was read (perf_counter); 0 until then."""
        self._fd = -1
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have the Transport methods without subclassing asyncio.Transport.
        self.transport = cast("asyncio.Transport", transport)
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1

    def data_received(self, data: bytes) -> None:
        if not self.in_use:  # bytes nobody asked for (a late 408, a body past its length): unusable
            self.abort()
            return
        reader = self.reader
        reader.feed(data)
        if reader.complete and not self.answered_at:
            self.answered_at = time.perf_counter()
        if reader.error is not None:
            self.abort()
        elif reader.unread > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def more(self) -> None:
        """Wait for more of the response; its error if it failed; returns at once if it ended."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        reader = self.reader
        if reader.error is not None:
            raise reader.error
        if self.timed_out is not None:
            raise self.timed_out
        if self.closed:
            reader.feed_eof()
            if reader.complete:
                self.answered_at = self.answered_at or time.perf_counter()
                return
            raise self._lost()
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        self.waiting_since = loop.time()
        try:
            await waiter
        finally:
            self.waiting_since = 0.0

    def _lost(self) -> ConnectionLost:
        cause = f": {self.error}" if self.error else ""
        if not self.reader.received and self.reused:
            return ServerDisconnected(
                "the server closed a reused connection without answering (it may have read the request,"
                " so it was not sent again)"
            )
        if not self.reader.head_done:
            return ConnectionLost(f"connection closed by the server before the response head{cause}")
        return ConnectionLost(f"connection closed by the server mid-response{cause}")

    def time_out(self, error: HttpError) -> None:
        """Fail the current wait for bytes, and every later one, with ``error``."""
        self.timed_out = error
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def usable(self, now: float) -> bool:
        """Whether this idle connection can carry a request: open, young, and with nothing to read.

        Readable means the server closed it (EOF waiting) or sent bytes nobody asked for; the
        loop may not have seen either yet, so the socket is asked directly (~0.5 us).
        """
        if self.closed or now - self.idle_since >= _KEEPALIVE:
            return False
        if self._fd < 0:
            return True
        readable, _, _ = select.select([self._fd], [], [], 0)
        return not readable

    def send(self, data: bytes, *, reused: bool) -> None:
        assert self.transport is not None
        self.reader.reset()
        self.reused = reused
        self.in_use = True
        self.timed_out = None
        self.transport.write(data)
        self.sent_at, self.answered_at = time.perf_counter(), 0.0

    def recycle(self) -> None:
        """Ready to wait in the pool: the last response's leftovers dropped, reading on."""
        self.reader.chunks.clear()
        self.reader.unread = 0
        self.in_use = False
        self.idle_since = time.monotonic()
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _ReadTimer:
    """A response's idle and total timeouts: one timer that re-arms itself, not one per chunk.

    Idle time counts only while the reader waits for bytes (a reader held up by its own
    consumer is not the server's fault); the deadline holds whatever the reader is doing.
    Rescheduling an ``asyncio.timeout`` per chunk instead cost ~5 us of the relay's budget.
    """

    def __init__(self, connection: _Connection, idle: float, total: float, since: float) -> None:
        self._connection = connection
        self._idle = idle
        self._total = total
        self._deadline = since + total
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_at(min(self._loop.time() + idle, self._deadline), self._check)

    def _check(self) -> None:
        now = self._loop.time()
        waiting_since = self._connection.waiting_since
        if now >= self._deadline:
            self._connection.time_out(ReadTimeout(f"the response took over {self._total:g} s"))
        elif waiting_since and now - waiting_since >= self._idle:
            self._connection.time_out(ReadTimeout(f"stalled, no data for {self._idle:g} s"))
        else:
            self._handle = self._loop.call_at(min((waiting_since or now) + self._idle, self._deadline), self._check)

    def stop(self) -> None:
        self._handle.cancel()


class Response:
    """A response whose head has arrived. Read its body once; ``async with`` releases it."""

    def __init__(self, client: HttpClient, connection: _Connection) -> None:
        reader = connection.reader
        self.status = reader.status
        self.headers = reader.headers
        """Header names in lower case; repeated headers joined with ", "."""
        self._client = client
        self._connection: _Connection | None = connection
        self._reader = reader
        self._timer: _ReadTimer | None = None

    @property
    def done(self) -> bool:
        """True once the whole body was read."""
        return self._reader.complete and not self._reader.chunks

    @property
    def server_seconds(self) -> float | None:
        """The server's time as this client saw it: from the request written to the response's last
        byte read; None before that byte, or once released."""
        connection = self._connection
        if connection is None or not connection.answered_at:
            return None
        return connection.answered_at - connection.sent_at

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self) -> None:
        # a response dropped unreleased must not keep its pool slot forever
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self.release()

    def set_timeouts(self, idle: float, total: float, *, since: float) -> None:
        """Fail reading with ReadTimeout after ``idle`` seconds waiting for bytes, or ``total``
        seconds after ``since`` (loop time; when the request was made)."""
        if self._connection is not None and self._timer is None:
            self._timer = _ReadTimer(self._connection, idle, total, since)

    async def read(self, limit: int) -> bytes:
        """The whole body; ProtocolError if it is over ``limit`` bytes."""
        parts = []
        size = 0
        async for data in self.iter_bytes():
            size += len(data)
            if size > limit:
                raise ProtocolError(f"response body over {limit} bytes")
            parts.append(data)
        return b"".join(parts)

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunk framing removed)."""
        connection = self._reading()
        reader = self._reader
        while True:
            data = reader.take()
            if data:
                yield data
            elif reader.complete:
                return
            else:
                await connection.more()

    async def lines(self, max_line: int = DEFAULT_MAX_LINE) -> AsyncGenerator[bytes, None]:
        """The body's non-empty lines, stripped, as they arrive (SSE, NDJSON); ProtocolError for a
        line over ``max_line`` bytes."""
        connection = self._reading()
        reader = self._reader
        splitter = LineSplitter(max_line)
        while True:
            data = reader.take()
            if data:
                for line in splitter.feed(data):
                    yield line
            elif reader.complete:
                break
            else:
                await connection.more()
        last = splitter.finish()
        if last:
            yield last

    def _reading(self) -> _Connection:
        if self._connection is None:
            raise RuntimeError("the response was released")
        return self._connection

    def release(self) -> None:
        """Give the connection back to the pool if its response ended cleanly, else close it."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if self._timer is not None:
            self._timer.stop()
        if self._reader.reusable and not connection.closed:
            self._client.put_back(connection)
        else:
            connection.abort()
        self._client.slot_free()

    def abort(self) -> None:
        """Drop the connection at once (the server sees it close)."""
        connection = self._connection
        if connection is not None:
            connection.abort()
        self.release()


class HttpClient:
    """Requests to one base URL over a pool of at most ``max_connections`` keep-alive connections."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int,
        headers: Mapping[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls`` verifies an https server (default: the system's CAs); headers go on every request
        (ValueError for one that cannot be sent, e.g. with CR or LF)."""
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self._prefix = url.path.rstrip("/")
        self._ssl = (tls or ssl.create_default_context()) if url.scheme == "https" else None
        host = f"[{self.host}]" if ":" in self.host else self.host
        default_port = self.port == (443 if url.scheme == "https" else 80)
        fields = {"Host": host if default_port else f"{host}:{self.port}", "User-Agent": "iop-node", "Accept": "*/*"}
        fields.update(headers or {})
        self._head = header_lines(fields)
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self.closed = False
        """True once ``aclose()`` was called: requests fail with ClientClosed."""

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        connect_timeout: float,
        head_timeout: float,
        pool_timeout: float = DEFAULT_POOL_TIMEOUT,
        head: bytes = b"",
        only_if: Callable[[], bool] | None = None,
    ) -> Response:
        """Send a request once; the response once its head is in (use it with ``async with``).

        ``head`` is more header lines for this request alone (``http11.header_lines``).
        ``only_if`` is asked when the connection is ready, just before the write: false raises
        NotSent and nothing is written.
        """
        if self.closed:
            raise ClientClosed("the client is closed")
        data = self._encode(method, path, body, head)
        await self._acquire(pool_timeout)
        try:
            connection = self._reuse()
            reused = connection is not None
            if connection is None:
                connection = await self._connect(connect_timeout)
            if only_if is not None and not only_if():
                self.put_back(connection)
                raise NotSent(f"{method} {path} was not sent: its condition no longer held")
            connection.send(data, reused=reused)
            return await self._answer(connection, head_timeout)
        except BaseException:
            self.slot_free()
            raise

    def _encode(self, method: str, path: str, body: bytes | None, head: bytes) -> bytes:
        start = f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1")
        if body is None:
            return b"%s%s%s\r\n" % (start, self._head, head)
        return b"%s%s%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            start,
            self._head,
            head,
            len(body),
            body,
        )

    async def _acquire(self, timeout: float) -> None:
        if not self._slots.locked():
            await self._slots.acquire()  # returns without suspending
            return
        try:
            async with asyncio.timeout(timeout):
                await self._slots.acquire()
        except TimeoutError:
            raise PoolTimeout(f"no free connection to {self.host}:{self.port} within {timeout:g} s") from None

    def _reuse(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.usable(now):
                return connection
            connection.abort()
        return None

    async def _connect(self, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(
                    _Connection, self.host, self.port, ssl=self._ssl, server_hostname=self.host if self._ssl else None
                )
        except TimeoutError:
            raise ConnectTimeout(f"connect timed out after {timeout:g} s") from None
        except OSError as exc:  # refused, unreachable, unresolvable, TLS handshake or verification
            raise ConnectError(str(exc) or type(exc).__name__) from exc
        return connection

    async def _answer(self, connection: _Connection, timeout: float) -> Response:
        late = ReadTimeout(f"no response within {timeout:g} s")
        timer = asyncio.get_running_loop().call_later(timeout, connection.time_out, late)
        try:
            reader = connection.reader
            while not reader.head_done:
                await connection.more()
            if connection.timed_out is late:
                connection.timed_out = None  # it fired in the very pass the head came in
            return Response(self, connection)
        except BaseException:
            connection.abort()
            raise
        finally:
            timer.cancel()

    def put_back(self, connection: _Connection) -> None:
        """Return a connection whose response ended cleanly to the pool."""
        if self.closed:
            connection.close()
            return
        connection.recycle()
        self._idle.append(connection)

    def slot_free(self) -> None:
        self._slots.release()

    async def aclose(self) -> None:
        """Close the idle connections; responses still being read close theirs when released."""
        self.closed = True
        while self._idle:
            self._idle.pop().close()
