"""The node's HTTP/1.1 client against scripted servers on 127.0.0.1: framing, keep-alive, failures.

Each server here is a few lines of asyncio that write exact bytes, so every framing case
(chunked with extensions and trailers, split at any byte, close-delimited, 1xx) and every
failure (a stale keep-alive connection, a cut, a bad head) is produced on demand. What is
about parsing alone is tested without sockets in tests/unit/test_http_parsing.py.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from iop_node.adapters import httpclient
from iop_node.adapters.http11 import header_lines
from iop_node.adapters.httpclient import (
    ConnectError,
    ConnectionLost,
    HttpClient,
    NotSent,
    PoolTimeout,
    ProtocolError,
    ReadTimeout,
    ServerDisconnected,
)
from iop_wire.certs import Authority
from iop_wire.tls import Role

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
_TIMEOUTS = {"connect_timeout": 2.0, "head_timeout": 2.0}


class Server:
    """A TCP server on port 0 running ``handler`` per connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def start(self, tls: ssl.SSLContext | None = None) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=tls)
        port = self.server.sockets[0].getsockname()[1]
        return f"{'https' if tls else 'http'}://127.0.0.1:{port}"

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One request, head and Content-Length body, kept in ``requests``."""
        request = await _read_request(reader)
        self.requests.append(request)
        return request


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


def _replies(answer: bytes, *, hold: float = 0.0) -> Handler:
    """A server that reads one request, writes ``answer``, and closes after ``hold`` seconds."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(hold)

    return handler


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[Server, HttpClient]]]]:
    servers: list[Server] = []
    clients: list[HttpClient] = []

    async def start(handler: Handler, *, max_connections: int = 8) -> tuple[Server, HttpClient]:
        server = Server(handler)
        servers.append(server)
        client = HttpClient(await server.start(), max_connections=max_connections, headers={"X-Test": "1"})
        clients.append(client)
        return server, client

    yield start
    for client in clients:
        await client.aclose()
    for server in servers:
        assert server.server is not None
        server.server.close()


def _length(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def _chunked(*chunks: bytes, trailer: bytes = b"") -> bytes:
    out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    for chunk in chunks:
        out += b"%x\r\n%s\r\n" % (len(chunk), chunk)
    return out + b"0\r\n" + trailer + b"\r\n"


async def _get_all(client: HttpClient, method: str = "POST", body: bytes | None = b"{}") -> tuple[int, bytes]:
    response = await client.request(method, "/v1/x", body, **_TIMEOUTS)
    try:
        return response.status, await response.read(1 << 20)
    finally:
        response.release()


async def test_request_bytes_and_a_keep_alive_connection_reused(serve) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.read_request(reader)
            writer.write(_length(b'{"ok":true}'))

    server, client = await serve(handler)
    for _ in range(3):
        assert await _get_all(client) == (200, b'{"ok":true}')
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/x HTTP/1.1\r\n")
    for field in (b"Host: 127.0.0.1:", b"Content-Type: application/json", b"Content-Length: 2", b"X-Test: 1"):
        assert field in first
    assert b"accept-encoding" not in first.lower()  # answers come uncompressed
    assert first.endswith(b"\r\n\r\n{}")


async def test_chunked_body_split_at_every_byte_with_extensions_and_trailers(serve) -> None:  # type: ignore[no-untyped-def]
    stream = _chunked(b'data: {"a":1}\n\n', b"data: [DO", b"NE]\r\n\r\n", trailer=b"X-Trailer: yes\r\n")
    stream = stream.replace(b"\r\n9\r\n", b"\r\n9;ext=1\r\n")  # a chunk extension is ignored

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        for byte in stream:  # one byte per write: every boundary falls somewhere
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0)
        await server.read_request(reader)
        writer.write(_length(b"again"))

    server, client = await serve(handler)
    response = await client.request("POST", "/v1/x", b"{}", **_TIMEOUTS)
    lines = [line async for line in response.lines()]
    assert lines == [b'data: {"a":1}', b"data: [DONE]"]
    assert response.done
    response.release()
    assert await _get_all(client) == (200, b"again")  # the trailer was consumed: the connection is reusable
    assert server.connections == 1


async def test_close_delimited_body_and_http_1_0_are_not_reused(serve) -> None:  # type: ignore[no-untyped-def]
    server, client = await serve(_replies(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nline one\nline two"))
    assert await _get_all(client) == (200, b"line one\nline two")
    assert await _get_all(client) == (200, b"line one\nline two")
    assert server.connections == 2


async def test_connection_close_header_is_honoured(serve) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(_length(b"bye", b"Connection: close\r\n"))
        await writer.drain()
        await asyncio.sleep(0.2)  # the client must not wait for this close to finish the body

    server, client = await serve(handler)
    assert await _get_all(client) == (200, b"bye")
    assert await _get_all(client) == (200, b"bye")
    assert server.connections == 2


async def test_interim_1xx_answers_are_skipped_and_204_has_no_body(serve) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + _length(b"ok"))
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await server.read_request(reader)
        writer.write(_length(b"third"))

    server, client = await serve(handler)
    assert await _get_all(client) == (200, b"ok")
    assert await _get_all(client, "GET", None) == (204, b"")
    assert await _get_all(client) == (200, b"third")
    assert server.connections == 1
    assert server.requests[1].startswith(b"GET /v1/x HTTP/1.1\r\n")
    assert b"content-length" not in server.requests[1].lower()


async def test_repeated_headers_are_joined_and_names_lower_cased(serve) -> None:  # type: ignore[no-untyped-def]
    _, client = await serve(_replies(b"HTTP/1.1 404 Not Found\r\nX-A: 1\r\nx-a:  2 \r\nContent-Length: 0\r\n\r\n"))
    response = await client.request("GET", "/", **_TIMEOUTS)
    assert (response.status, response.headers["x-a"]) == (404, "1, 2")
    response.release()


async def test_a_post_is_sent_once_when_a_reused_connection_closes_right_after_it(serve) -> None:  # type: ignore[no-untyped-def]
    """The server reads the second POST and drops the connection at once (within 0.1 s): it may have
    acted on it, so the client fails it (retryable, for the caller to decide) instead of sending it again."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(_length(b"ok"))
        await server.read_request(reader)  # read, and closed unanswered

    server, client = await serve(handler)
    assert await _get_all(client) == (200, b"ok")
    with pytest.raises(ServerDisconnected, match="not sent again"):
        await client.request("POST", "/v1/x", b"{}", **_TIMEOUTS)
    await asyncio.sleep(0.2)  # a resend would have reached the server by now
    assert len(server.requests) == 2  # two POSTs, two requests seen (it was three)
    assert server.connections == 1


async def test_a_pooled_connection_found_closed_before_the_write_is_replaced() -> None:
    """The server closes the idle connection; the loop has not seen the FIN yet when the next
    request is made (it is held up), so the client asks the socket before writing on it."""
    listener = socket.create_server(("127.0.0.1", 0))
    requests: list[bytes] = []
    closed = threading.Event()

    def serve_two() -> None:
        for index in range(2):
            connection, _ = listener.accept()
            with connection:
                requests.append(connection.recv(65536))
                connection.sendall(_length(b"ok"))
                if index == 0:
                    time.sleep(0.05)
                    connection.shutdown(socket.SHUT_RDWR)
                    closed.set()
                else:
                    time.sleep(0.2)

    thread = threading.Thread(target=serve_two, daemon=True)
    thread.start()
    client = HttpClient(f"http://127.0.0.1:{listener.getsockname()[1]}", max_connections=1)
    assert await _get_all(client) == (200, b"ok")
    closed.wait(2)  # blocks the loop on purpose: the FIN is on the socket, not yet seen by the transport
    time.sleep(0.05)  # noqa: ASYNC251 - the same: the loop must not run before the next request
    assert await _get_all(client) == (200, b"ok")
    assert len(requests) == 2  # each request went out once, the second on a new connection
    await client.aclose()
    thread.join()
    listener.close()


async def test_bytes_arriving_on_an_idle_connection_retire_it(serve) -> None:  # type: ignore[no-untyped-def]
    """A server that writes after its answer (here a late 408) must not answer the next request."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(_length(b"first"))
        await writer.drain()
        if server.connections == 1:
            await asyncio.sleep(0.05)
            writer.write(_length(b"stray", b"Connection: close\r\n").replace(b"200 OK", b"408 Request Timeout"))
            await asyncio.sleep(1)

    server, client = await serve(handler)
    assert await _get_all(client) == (200, b"first")
    await asyncio.sleep(0.2)  # the stray answer lands while the connection is in the pool
    assert await _get_all(client) == (200, b"first")
    assert server.connections == 2


async def test_a_reused_connection_dropped_late_is_not_sent_again(serve) -> None:  # type: ignore[no-untyped-def]
    """A close 0.3 s after the request may follow work on it: that POST must not be repeated."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(_length(b"ok"))
        await server.read_request(reader)
        await asyncio.sleep(0.3)  # works on it for a while, then dies without answering

    server, client = await serve(handler)
    assert await _get_all(client) == (200, b"ok")
    with pytest.raises(ServerDisconnected):
        await client.request("POST", "/generate", b"{}", **_TIMEOUTS)
    assert len(server.requests) == 2
    assert server.connections == 1


async def test_idle_time_counts_only_while_waiting_and_the_deadline_always(serve) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        if server.connections == 2:  # a trickle: never idle for long, never done
            for _ in range(100):
                await asyncio.sleep(0.05)
                writer.write(b"1\r\n.\r\n")
        await asyncio.sleep(5)

    server, client = await serve(handler)
    loop = asyncio.get_running_loop()
    response = await client.request("POST", "/", b"{}", **_TIMEOUTS)
    response.set_timeouts(0.2, 30, since=loop.time())
    chunks = response.iter_bytes()
    assert await anext(chunks) == b"first"
    await asyncio.sleep(0.5)  # busy elsewhere (a slow client) for longer than the idle timeout
    waiting = loop.time()
    with pytest.raises(ReadTimeout, match=r"stalled, no data for 0\.2 s"):
        await anext(chunks)  # the timeout is the server's silence while this waits, not before
    assert loop.time() - waiting >= 0.15
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]  # no task cancel to take back
    response.release()

    response = await client.request("POST", "/", b"{}", **_TIMEOUTS)
    response.set_timeouts(2, 0.4, since=loop.time())
    with pytest.raises(ReadTimeout, match=r"the response took over 0\.4 s"):
        await response.read(1 << 20)
    response.release()


async def test_a_head_landing_as_its_timeout_fires_is_taken_and_the_body_reads() -> None:
    """The head timer and the head's bytes come due in the same loop pass: the head wins.

    The server is a thread, so its bytes arrive while this loop is held up.
    """
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_one() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            time.sleep(0.1)
            connection.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            time.sleep(0.4)
            connection.sendall(b"6\r\nsecond\r\n0\r\n\r\n")
            time.sleep(0.2)

    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    client = HttpClient(f"http://127.0.0.1:{listener.getsockname()[1]}", max_connections=1)
    asyncio.get_running_loop().call_later(0.05, time.sleep, 0.3)  # the loop is stuck while both come due
    response = await client.request("POST", "/", b"{}", connect_timeout=2.0, head_timeout=0.2)
    assert response.status == 200
    assert await response.read(100) == b"firstsecond"  # no stale head timeout on the body's reads
    response.release()
    await client.aclose()
    thread.join()
    listener.close()


async def test_a_new_connection_closed_before_any_answer_is_an_error_not_a_retry(serve) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)  # and close without a word

    server, client = await serve(handler)
    with pytest.raises(ConnectionLost, match="closed by the server"):
        await client.request("POST", "/", b"{}", **_TIMEOUTS)
    assert server.connections == 1


async def test_a_connection_cut_mid_body_is_connection_lost(serve) -> None:  # type: ignore[no-untyped-def]
    _, client = await serve(_replies(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"))
    response = await client.request("POST", "/", b"{}", **_TIMEOUTS)
    received: list[bytes] = []
    with pytest.raises(ConnectionLost):
        await _collect(response.iter_bytes(), received)
    assert received == [b"hello"]
    response.release()


async def _collect(items: AsyncIterator[bytes], into: list[bytes]) -> None:
    async for item in items:
        into.append(item)  # noqa: PERF401 - what arrived before the failure is the point


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not HTTP/1.1"),
        (b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n", "status"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"x" * (70 * 1024), "response head over"),
        (b"HTTP/1.1 200 OK\r\n" + b"X-Flood: y\r\n" * 10_000 + b"\r\n", "over 100 header fields"),
    ],
)
async def test_a_bad_head_is_a_protocol_error(serve, answer: bytes, message: str) -> None:  # type: ignore[no-untyped-def]
    _, client = await serve(_replies(answer, hold=1))
    with pytest.raises(ProtocolError, match=message):
        await client.request("POST", "/", b"{}", **_TIMEOUTS)


async def test_chunked_with_content_length_is_refused_and_the_connection_not_reused(serve) -> None:  # type: ignore[no-untyped-def]
    smuggled = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(smuggled if server.connections == 1 else _length(b"clean"))
        await server.read_request(reader)

    server, client = await serve(handler)
    with pytest.raises(ProtocolError, match="Content-Length"):
        await _get_all(client)
    assert await _get_all(client) == (200, b"clean")
    assert server.connections == 2


async def test_a_64_mib_line_fails_fast_with_a_clear_error(serve) -> None:  # type: ignore[no-untyped-def]
    size = 64 * 1024 * 1024

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (size + 1))
        piece = b"x" * (1024 * 1024)
        for _ in range(64):
            writer.write(piece)
            await writer.drain()
        writer.write(b"\n")
        await writer.drain()

    server, client = await serve(handler)
    started = time.process_time()
    async with await client.request("POST", "/", b"{}", **_TIMEOUTS) as response:
        with pytest.raises(ProtocolError, match=r"a line of the response is over 1048576 bytes"):
            async for _ in response.lines(max_line=1024 * 1024):
                pass
    assert time.process_time() - started < 1.0  # 8.4 s of CPU before the cap


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"zz\r\nhello\r\n", "chunk size"),
        (b"5\r\nhelloXX", "after chunk"),
        (b"1" * 5000, "overflow"),
    ],
)
async def test_a_bad_chunked_body_is_a_protocol_error(serve, body: bytes, message: str) -> None:  # type: ignore[no-untyped-def]
    _, client = await serve(_replies(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body, hold=1))
    response = await client.request("POST", "/", b"{}", **_TIMEOUTS)
    with pytest.raises(ProtocolError, match=message):
        await response.read(1 << 20)
    response.release()


async def test_body_over_the_limit_is_refused(serve) -> None:  # type: ignore[no-untyped-def]
    _, client = await serve(_replies(_length(b"x" * 2000), hold=1))
    response = await client.request("POST", "/", b"{}", **_TIMEOUTS)
    with pytest.raises(ProtocolError, match="over 1000 bytes"):
        await response.read(1000)
    response.release()


async def test_head_timeout_and_connection_refused(serve) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        await asyncio.sleep(5)

    server, client = await serve(handler)
    with pytest.raises(ReadTimeout, match=r"no response within 0\.1 s"):
        await client.request("POST", "/", b"{}", connect_timeout=1.0, head_timeout=0.1)
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    closed = HttpClient(f"http://127.0.0.1:{port}", max_connections=1)
    with pytest.raises(ConnectError) as caught:
        await closed.request("GET", "/", **_TIMEOUTS)
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)


async def test_releasing_an_unfinished_response_closes_its_connection(serve) -> None:  # type: ignore[no-untyped-def]
    seen_eof = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        if not await reader.read(1):
            seen_eof.set()

    server, client = await serve(handler)
    response = await client.request("POST", "/", b"{}", **_TIMEOUTS)
    assert [data async for data in _first(response.iter_bytes())] == [b"first"]
    response.release()
    await asyncio.wait_for(seen_eof.wait(), 2)


async def _first(items: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    async for item in items:
        yield item
        return


async def test_connections_are_limited_and_the_slot_comes_back(serve) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.read_request(reader)
            writer.write(_length(b"ok"))

    server, client = await serve(handler, max_connections=1)
    held = await client.request("POST", "/", b"{}", **_TIMEOUTS)
    waiting = asyncio.create_task(_get_all(client))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    assert await held.read(100) == b"ok"
    held.release()
    assert await asyncio.wait_for(waiting, 2) == (200, b"ok")
    assert server.connections == 1


async def test_a_slow_reader_stops_the_socket_being_read(serve) -> None:  # type: ignore[no-untyped-def]
    size = 16 * 1024 * 1024
    sent = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()
        sent.set()

    server, client = await serve(handler)
    response = await client.request("POST", "/", b"{}", **_TIMEOUTS)
    await asyncio.sleep(0.3)  # the server writes as fast as it can; nobody reads
    connection = response._connection
    assert connection is not None
    assert connection.reader.unread < httpclient._HIGH_WATER + 1024 * 1024
    assert not sent.is_set()  # TCP pushed back on the server
    assert len(await response.read(size)) == size
    await asyncio.wait_for(sent.wait(), 5)
    response.release()


async def test_https_with_a_private_ca(tmp_path: Path) -> None:
    authority = Authority()
    cert, key = authority.issue("backend", Role.NODE).write(tmp_path, "backend")
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(_length(b"secure"))
        await writer.drain()

    server = Server(handler)
    url = await server.start(server_tls)
    trusting = ssl.create_default_context(cafile=authority.write(tmp_path))
    client = HttpClient(url, max_connections=1, tls=trusting)
    assert await _get_all(client) == (200, b"secure")
    await client.aclose()
    stranger = HttpClient(url, max_connections=1)  # the system's CAs do not know this one
    with pytest.raises(ConnectError, match="certificate verify failed") as caught:
        await stranger.request("GET", "/", **_TIMEOUTS)
    assert isinstance(caught.value.__cause__, ssl.SSLCertVerificationError)
    assert server.server is not None
    server.server.close()


def _answers_all(server_box: list[Server]) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server_box[0].read_request(reader)
            writer.write(_length(b"ok"))

    return handler


async def test_waiting_for_a_slot_times_out_and_the_slot_comes_back(serve) -> None:  # type: ignore[no-untyped-def]
    box: list[Server] = []
    server, client = await serve(_answers_all(box), max_connections=1)
    box.append(server)
    held = await client.request("POST", "/", b"{}", **_TIMEOUTS)
    started = time.monotonic()
    with pytest.raises(PoolTimeout, match=r"no free connection .* within 0\.1 s"):
        await client.request("POST", "/", b"{}", pool_timeout=0.1, **_TIMEOUTS)
    assert 0.09 < time.monotonic() - started < 1.0
    held.release()
    assert await _get_all(client) == (200, b"ok")
    assert len(server.requests) == 2  # the timed-out request was never sent


async def test_async_with_releases_the_slot_on_exit_on_error_and_on_cancel(serve) -> None:  # type: ignore[no-untyped-def]
    box: list[Server] = []
    server, client = await serve(_answers_all(box), max_connections=1)
    box.append(server)

    async with await client.request("POST", "/", b"{}", **_TIMEOUTS) as response:
        assert await response.read(100) == b"ok"
    with pytest.raises(ZeroDivisionError):
        async with await client.request("POST", "/", b"{}", **_TIMEOUTS):
            _ = 1 / 0
    entered = asyncio.Event()

    async def held_until_cancelled() -> None:
        async with await client.request("POST", "/", b"{}", **_TIMEOUTS):
            entered.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(held_until_cancelled())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.wait_for(_get_all(client), 2) == (200, b"ok")  # each exit gave the one slot back


async def test_a_response_dropped_unreleased_gives_its_slot_back(serve) -> None:  # type: ignore[no-untyped-def]
    box: list[Server] = []
    server, client = await serve(_answers_all(box), max_connections=1)
    box.append(server)
    response = await client.request("POST", "/", b"{}", **_TIMEOUTS)
    del response
    gc.collect()
    assert await asyncio.wait_for(_get_all(client), 2) == (200, b"ok")


async def test_per_request_header_lines_and_only_if(serve) -> None:  # type: ignore[no-untyped-def]
    box: list[Server] = []
    server, client = await serve(_answers_all(box))
    box.append(server)
    head = header_lines({"Authorization": "Bearer key-B"})
    async with await client.request("POST", "/", b"{}", head=head, **_TIMEOUTS) as response:
        await response.read(100)
    assert b"\r\nAuthorization: Bearer key-B\r\n" in server.requests[0]
    with pytest.raises(NotSent):
        await client.request("GET", "/v1/models", only_if=lambda: False, **_TIMEOUTS)
    assert await _get_all(client) == (200, b"ok")
    assert len(server.requests) == 2 and server.connections == 1  # nothing sent; the connection kept


def test_headers_that_would_break_the_head_are_refused() -> None:
    with pytest.raises(ValueError, match="control or non-latin-1"):
        HttpClient("http://127.0.0.1:1", max_connections=1, headers={"Authorization": "Bearer a\r\nX: 1"})
