"""A small HTTP/1.1 client for the backends: one keep-alive connection pool per base URL.

The HTTP adapters ask little of HTTP: JSON requests, JSON answers, and streamed answers read
line by line (SSE, NDJSON). This client does that and nothing more, on an ``asyncio.Protocol``:
on a pooled connection a request goes out in one ``transport.write`` in the task that makes
it, with no await before it, and a response's bytes are parsed where they land. Against aiohttp
it takes about 0.1 ms off every request's time to first byte (README, "Design decisions").

What it speaks: HTTP/1.1 (and 1.0 answers), ``Content-Length``, chunked and close-delimited
bodies, 1xx interim answers skipped, keep-alive unless either side says ``close``, TLS for
``https://``. What it leaves out on purpose: redirects, cookies, proxies, compression (it never
sends ``Accept-Encoding``, so servers answer uncompressed).
"""

from __future__ import annotations

import asyncio
import ssl
import time
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Mapping

__all__ = ["BadResponse", "ConnectionLost", "HttpClient", "ReadTimeout", "Response"]

_MAX_HEAD = 64 * 1024  # bytes of status line and headers
_MAX_CHUNK_LINE = 4096  # bytes of one chunk-size line (with extensions) or trailer line
_HIGH_WATER = 1024 * 1024  # unread body bytes at which the socket stops being read
# Seconds an idle connection is kept for reuse: under the 5 s after which uvicorn (vLLM,
# llama-cpp-python) and llama.cpp's server close one, so the pool rarely races their close.
_KEEPALIVE = 4.0
_RACE = 0.1  # seconds after sending within which a silent close of a reused connection is a keep-alive race


class ConnectionLost(OSError):
    """The connection closed or failed before the response was complete."""


class BadResponse(ValueError):
    """The server's bytes are not HTTP/1.x as this client reads it."""


class ReadTimeout(Exception):
    """No body bytes for the idle timeout while waiting for them, or the response's deadline passed."""


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: bytes received wait in a buffer for the response reading them."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self.error: BaseException | None = None
        self.received = 0
        """Bytes received since the current request was sent."""
        self.sent_at = 0.0
        self.idle_since = 0.0
        self.in_use = False
        """True from a request's send until its connection goes back to the pool."""
        self.waiting_since = 0.0
        """When ``more()`` began waiting (loop time); 0 while it is not waiting."""
        self.timed_out: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.in_use:  # bytes nobody asked for (a late 408, a body past its length): unusable
            self.abort()
            return
        self.buffer += data
        self.received += len(data)
        if len(self.buffer) > _HIGH_WATER and not self._paused and self.transport is not None:
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
        """Wait for more bytes; ConnectionLost if the connection ended, a timer's error if one fired."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        if self.closed:
            raise ConnectionLost(f"connection closed by the server{f': {self.error}' if self.error else ''}")
        if self.timed_out is not None:
            raise self.timed_out
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        self.waiting_since = loop.time()
        try:
            await waiter
        finally:
            self.waiting_since = 0.0

    def time_out(self, error: Exception) -> None:
        """Fail the current wait for bytes, and every later one, with ``error``."""
        self.timed_out = error
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.received = 0
        self.in_use = True
        self.timed_out = None
        self.sent_at = time.monotonic()
        self.transport.write(data)

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
    """A response whose head has arrived; read its body once, then release it."""

    def __init__(
        self, client: HttpClient, connection: _Connection, status: int, headers: dict[str, str], keep_alive: bool
    ) -> None:
        self.status = status
        self.headers = headers
        """Header names in lower case; repeated headers joined with ", "."""
        self._client = client
        self._connection: _Connection | None = connection
        self._keep_alive = keep_alive
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self._remaining = -1  # body bytes still to come when Content-Length framed; -1: not so framed
        self._chunk_left = 0  # bytes of the current chunk still to come (chunked)
        self._state = "size"  # chunked: size, data, data-end, trailer
        self._timer: _ReadTimer | None = None
        self.done = False
        """True once the whole body was read."""
        if not self._chunked:
            length = headers.get("content-length")
            if length is not None:
                if not (length.isascii() and length.isdigit()):
                    raise BadResponse(f"bad Content-Length {length!r}")
                self._remaining = int(length)
            elif status in (204, 304):
                self._remaining = 0
            else:
                self._keep_alive = False  # the body ends when the connection does
            self.done = self._remaining == 0

    def set_timeouts(self, idle: float, total: float, *, since: float) -> None:
        """Fail reading with ReadTimeout after ``idle`` seconds waiting for bytes, or ``total``
        seconds after ``since`` (loop time; when the request was made)."""
        if self._connection is not None and self._timer is None:
            self._timer = _ReadTimer(self._connection, idle, total, since)

    async def read(self, limit: int) -> bytes:
        """The whole body; BadResponse if it is over ``limit`` bytes."""
        parts = []
        size = 0
        async for data in self.iter_bytes():
            size += len(data)
            if size > limit:
                raise BadResponse(f"response body over {limit} bytes")
            parts.append(data)
        return b"".join(parts)

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunk framing removed)."""
        connection = self._reading()
        while not self.done:
            data = self._take(connection.buffer)
            if data:
                yield data
            elif not self.done:
                await self._more(connection)

    async def lines(self) -> AsyncGenerator[bytes, None]:
        """The body's non-empty lines, stripped, as they arrive (SSE, NDJSON)."""
        connection = self._reading()
        pending = b""
        while not self.done:
            data = self._take(connection.buffer)
            if not data:
                if not self.done:
                    await self._more(connection)
                continue
            *complete, pending = (pending + data).split(b"\n")
            for raw in complete:
                line = raw.strip()
                if line:
                    yield line
        pending = pending.strip()
        if pending:
            yield pending

    def _reading(self) -> _Connection:
        if self._connection is None:
            raise RuntimeError("the response was released")
        return self._connection

    async def _more(self, connection: _Connection) -> None:
        try:
            await connection.more()
        except ConnectionLost:
            if self._remaining < 0 and not self._chunked and connection.error is None:
                self.done = True  # a close-delimited body ends with the connection
                return
            raise

    def _take(self, buffer: bytearray) -> bytes:
        """Consume what ``buffer`` holds of the body; returns the body bytes found."""
        if self._chunked:
            return self._take_chunked(buffer)
        if self._remaining < 0:
            data = bytes(buffer)
        else:
            data = bytes(buffer[: self._remaining])
            self._remaining -= len(data)
            self.done = self._remaining == 0
        del buffer[: len(data)]
        return data

    def _take_chunked(self, buffer: bytearray) -> bytes:
        out = []
        while buffer and not self.done:
            if self._state == "data":
                data = bytes(buffer[: self._chunk_left])
                del buffer[: len(data)]
                self._chunk_left -= len(data)
                out.append(data)
                if self._chunk_left == 0:
                    self._state = "data-end"
            elif self._state == "data-end":
                if len(buffer) < 2:
                    break
                if buffer[:2] != b"\r\n":
                    raise BadResponse("chunk not followed by CRLF")
                del buffer[:2]
                self._state = "size"
            else:
                line = _take_line(buffer)
                if line is None:
                    break
                if self._state == "trailer":
                    self.done = not line  # trailer fields are read past; an empty line ends the body
                else:
                    self._chunk_left = _chunk_size(line)
                    self._state = "data" if self._chunk_left else "trailer"
        return b"".join(out)

    def release(self) -> None:
        """Give the connection back to the pool if its response was read to the end, else close it."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if self._timer is not None:
            self._timer.stop()
        if self.done and self._keep_alive and not connection.closed and not connection.buffer:
            self._client.put_back(connection)
        else:
            connection.abort()
        self._client.slot_free()

    def abort(self) -> None:
        """Drop the connection at once (the server sees it close)."""
        self.done = False
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
        """``tls`` verifies an https server (default: the system's CAs); headers go on every request."""
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
        self._head = "".join(f"{name}: {value}\r\n" for name, value in fields.items()).encode("latin-1")
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self.closed = False
        """True once ``aclose()`` was called: requests fail with ConnectionLost."""

    async def request(
        self, method: str, path: str, body: bytes | None = None, *, connect_timeout: float, head_timeout: float
    ) -> Response:
        """Send a request and return the response once its head is in.

        A reused connection that the server closes, without a byte of answer, within 0.1 s of
        the request (the server dropped it while idle as the request went out) is replaced by a
        new one, once. Any later close is the answer: the request may have been worked on.
        """
        if self.closed:
            raise ConnectionLost("the client is closed")
        request = self._encode(method, path, body)
        await self._slots.acquire()
        try:
            connection = self._reuse()
            if connection is not None:
                connection.send(request)
                try:
                    return await self._answer(connection, head_timeout)
                except ConnectionLost:
                    if connection.received or time.monotonic() - connection.sent_at > _RACE:
                        raise
            connection = await self._connect(connect_timeout)
            connection.send(request)
            return await self._answer(connection, head_timeout)
        except BaseException:
            self.slot_free()
            raise

    def _encode(self, method: str, path: str, body: bytes | None) -> bytes:
        head = f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1") + self._head
        if body is None:
            return head + b"\r\n"
        return b"%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (head, len(body), body)

    def _reuse(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since < _KEEPALIVE:
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
            raise OSError(f"connect timed out after {timeout:g} s") from None
        return connection

    async def _answer(self, connection: _Connection, timeout: float) -> Response:
        late = TimeoutError(f"no answer within {timeout:g} s")
        timer = asyncio.get_running_loop().call_later(timeout, connection.time_out, late)
        try:
            while True:
                status, headers, keep_alive = await _read_head(connection)
                if not 100 <= status < 200:
                    if connection.timed_out is late:
                        connection.timed_out = None  # it fired in the very pass the head came in
                    return Response(self, connection, status, headers, keep_alive)
        except BaseException:
            connection.abort()
            raise
        finally:
            timer.cancel()

    def put_back(self, connection: _Connection) -> None:
        if self.closed:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        connection.in_use = False
        self._idle.append(connection)

    def slot_free(self) -> None:
        self._slots.release()

    async def aclose(self) -> None:
        """Close the idle connections; responses still being read close theirs when released."""
        self.closed = True
        while self._idle:
            self._idle.pop().close()


async def _read_head(connection: _Connection) -> tuple[int, dict[str, str], bool]:
    """Status, headers and whether the connection stays open after this response."""
    buffer = connection.buffer
    while True:
        end = buffer.find(b"\r\n\r\n")
        if end >= 0:
            break
        if len(buffer) > _MAX_HEAD:
            raise BadResponse(f"response head over {_MAX_HEAD} bytes")
        await connection.more()
    lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    del buffer[: end + 4]
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isdigit():
        raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise BadResponse(f"bad header line {line[:80]!r}")
        key = name.lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    tokens = {token.strip().lower() for token in headers.get("connection", "").split(",")}
    keep_alive = "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens
    return int(code), headers, keep_alive


def _take_line(buffer: bytearray) -> bytes | None:
    """The line at the start of ``buffer`` without its CRLF (consumed), or None if it is not all in."""
    end = buffer.find(b"\r\n")
    if end < 0:
        if len(buffer) > _MAX_CHUNK_LINE:
            raise BadResponse(f"chunk-size or trailer line over {_MAX_CHUNK_LINE} bytes")
        return None
    line = bytes(buffer[:end])
    del buffer[: end + 2]
    return line


def _chunk_size(line: bytes) -> int:
    size = line.split(b";", 1)[0].strip()
    if not size or size.strip(b"0123456789abcdefABCDEF"):
        raise BadResponse(f"bad chunk size {size[:40]!r}")
    return int(size, 16)
