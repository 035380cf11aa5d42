"""An answer leaves the edge in one write: its head waits for its body (within the loop turn), so a
client is woken once, not by a head whose body the edge has yet to write (on a busy host that gap
was IOP's time outside x-iop-overhead-ms). A stream's head still leaves at once.

The edge's own uvicorn protocol on real TCP (127.0.0.1, port 0); the test's subclass records what
the protocol writes to its transport."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

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
async def _edge_protocol(app: App, writes: list[bytes]) -> AsyncIterator[int]:
    """A uvicorn server on the edge's protocol serving ``app``: its port."""
    base = head_protocol(HeadLimits(timeout=5.0, max_bytes=65536, max_headers=100), Refusals(EdgeMetrics()))

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
