"""The edge's HTTP protocol (iop_edge.head).

An answer leaves the edge in one write: its head waits for its body (within the loop turn), so a
client is woken once, not by a head whose body the edge has yet to write (on a busy host that gap
was IOP's time outside x-iop-overhead-ms). A stream's head still leaves at once.

A head over its bound is refused as OpenAI-style JSON even when it arrives whole in one read (it
was parsed before it was counted, and a URL past 64 KiB got uvicorn's plain-text 400).

The edge's own uvicorn protocol on real TCP (127.0.0.1, port 0); the test's subclass records what
the protocol writes to its transport."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvicorn

from iop_edge.head import HeadLimits, head_protocol
from iop_edge.metrics import EdgeMetrics
from iop_edge.refusals import Refusals

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
REQUEST = b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n"


class _Recorder:
    """A transport that passes everything on and keeps what was written, one entry per write."""

    def __init__(self, transport: asyncio.Transport, writes: list[bytes]) -> None:
        self._transport = transport
        self.writes = writes

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self._transport.write(data)

    def writelines(self, chunks: Iterable[bytes]) -> None:  # one write of all the chunks (writev)
        chunks = [bytes(chunk) for chunk in chunks]
        self.writes.append(b"".join(chunks))
        self._transport.writelines(chunks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


@asynccontextmanager
async def _edge_protocol(
    app: App, writes: list[bytes], max_bytes: int = 65536, metrics: EdgeMetrics | None = None
) -> AsyncIterator[int]:
    """A uvicorn server on the edge's protocol serving ``app``: its port."""
    limits = HeadLimits(timeout=5.0, max_bytes=max_bytes, max_headers=100)
    base = head_protocol(limits, Refusals(metrics or EdgeMetrics()))

    class Recording(base):  # type: ignore[valid-type,misc]
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(_Recorder(transport, writes))

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)  # a connection waits in the backlog until the server accepts it
    config = uvicorn.Config(app, http=Recording, loop="none", lifespan="off", log_config=None, access_log=False)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await serving


async def _exchange(port: int, until: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    answer = await asyncio.wait_for(reader.readuntil(until), 10)
    writer.close()
    return answer


async def test_a_whole_answer_leaves_in_one_write() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"hello"})

    writes: list[bytes] = []
    async with _edge_protocol(app, writes) as port:
        answer = await _exchange(port, b"hello")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\nhello"), answer
    assert writes == [answer], writes


async def test_a_streams_head_leaves_before_its_first_chunk() -> None:
    head_read = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await head_read.wait()  # the first chunk comes only once the client has the head
        await send({"type": "http.response.body", "body": b"tok", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    writes: list[bytes] = []
    async with _edge_protocol(app, writes) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        head_read.set()
        rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
        writer.close()
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in head, head
    assert rest == b"3\r\ntok\r\n0\r\n\r\n", rest
    assert writes[0] == head, writes


async def _whole_head(port: int, head: bytes) -> bytes:
    """``head`` sent in one write; everything the edge answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


def _error(answer: bytes, status_line: bytes) -> dict[str, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == status_line, answer[:200]
    assert b"content-type: application/json" in head and answer.count(b"HTTP/1.1") == 1, answer[:300]
    return json.loads(body)["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("max_bytes", "status_line", "code", "said", "limit"),
    [
        (
            65536,
            b"HTTP/1.1 431 Request Header Fields Too Large",
            "request_header_fields_too_large",
            "http.max_head_bytes",
            "head_size",
        ),
        (200_000, b"HTTP/1.1 414 URI Too Long", "uri_too_long", "URL is 70012 bytes, over 65535", "url_size"),
    ],
)
async def test_a_head_or_url_over_its_bound_in_one_read_is_refused_as_json(
    max_bytes: int, status_line: bytes, code: str, said: str, limit: str
) -> None:
    """A whole head in one read was parsed before it was counted, so the 431 never came; a URL past
    65,535 bytes then failed httptools' URL parser and uvicorn answered "Invalid HTTP request
    received." as text/plain (found attacking the console with a 70 KB ?model=)."""
    called: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        called.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    writes: list[bytes] = []
    metrics = EdgeMetrics()
    async with _edge_protocol(app, writes, max_bytes, metrics) as port:
        head = b"GET /runs?model=" + b"a" * 70_000 + b" HTTP/1.1\r\nhost: x\r\n\r\n"
        error = _error(await _whole_head(port, head), status_line)
        assert error["code"] == code and said in error["message"], error
        served = await _whole_head(
            port, b"GET /runs?model=" + b"a" * 60_000 + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        )
        assert served.startswith(b"HTTP/1.1 200") and served.endswith(b"ok"), served[:200]
    assert called == ["/runs"]  # only the request within the bounds reached the application
    assert metrics.registry.get_sample_value("iop_edge_refused_total", {"limit": limit}) == 1


async def test_too_many_headers_in_one_read_are_refused_once() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise AssertionError("a refused head reached the application")

    async with _edge_protocol(app, []) as port:
        headers = b"".join(b"x-h%d: 1\r\n" % index for index in range(150))
        error = _error(
            await _whole_head(port, b"GET / HTTP/1.1\r\nhost: x\r\n" + headers + b"\r\n"),
            b"HTTP/1.1 431 Request Header Fields Too Large",
        )
        assert "http.max_headers" in error["message"]
