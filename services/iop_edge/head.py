"""uvicorn's httptools protocol with bounds on a request's head: its time, its size, its header count.

uvicorn closes an idle keep-alive connection, but puts no bound on a request's head: a client
that sends its headers a byte at a time holds its connection (one of ``http.max_connections``)
for as long as it likes, and one that sends a 64 MB header has the parser hold it all (two of
them froze the edge for 10 s and tripled its memory). Here, for every request of a connection:

- the head must be complete within ``http.header_timeout`` seconds of the connection's opening
  (first request) or of the request's first byte (later ones); past it the connection is closed;
- a head over ``http.max_head_bytes`` (counted as it arrives, so at most one read more is ever
  held, and measured again once parsed: a whole head in one read is parsed before it is counted)
  or with more than ``http.max_headers`` headers is answered 431 and the connection closed; a URL
  over 65,535 bytes (httptools' URL parser holds offsets in 16 bits: uvicorn answered it with a
  plain-text 400) is answered 414, also as OpenAI-style JSON.

Each is counted in ``iop_edge_refused_total{limit=header_timeout|head_size|header_count|url_size}`` and
logged (at most once a second per limit).

It also stamps each request's first byte (``ARRIVED``, where ``x-iop-overhead-ms`` starts) and
sends each response's head with its body's first bytes, in one write (``_HeadWithBody``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from iop_edge.refusals import Refusals
from iop_wire.openai.errors import ApiError

__all__ = ["ARRIVED", "HeadLimits", "head_protocol"]

MAX_URL_BYTES = 65_535
"""The longest URL httptools' parser takes (its offsets are 16-bit)."""
ARRIVED = "iop.arrived"
"""ASGI scope key: when the request's first byte was read (perf_counter), the start of x-iop-overhead-ms."""


@dataclass(frozen=True, slots=True)
class HeadLimits:
    """The bounds on every request head (``http.header_timeout``, ``http.max_head_bytes``, ``http.max_headers``)."""

    timeout: float
    max_bytes: int
    max_headers: int


def head_protocol(limits: HeadLimits, refusals: Refusals) -> type[asyncio.Protocol]:
    """An httptools protocol class whose requests' heads are bounded by ``limits``."""

    class HeadLimitProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = True
        """Between a request's first byte (or the connection's opening) and its headers' end."""
        _head_bytes = 0
        """Bytes received while in the head (the read that ends it included: at most one read more)."""
        _header_count = 0
        _head_size = 0
        """The parsed head's bytes: its URL, and each header's name and value with 4 for ": " and CRLF."""
        _refused = False
        """The head went over a bound: the rest of what the connection sends is ignored; it closes."""
        _refusal: tuple[str, str, int] | None = None
        """Found inside the parser (limit, why, status): answered once the read that found it is parsed."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)  # the parser holds an incomplete head: checked right after
            self._check_head()

        def _check_head(self) -> None:
            if self._refusal is not None:  # set by on_header or on_headers_complete
                refusal, self._refusal = self._refusal, None
                self._refuse(*refusal)
            elif not self._refused and self._in_head and self._head_bytes > limits.max_bytes:
                self._refused = True
                self._refuse("head_size", f"over {limits.max_bytes} bytes (http.max_head_bytes)")

        def on_message_begin(self) -> None:
            if self._refused:
                return
            super().on_message_begin()
            self.scope[ARRIVED] = time.perf_counter()  # type: ignore[literal-required]  # an extension key
            self._in_head, self._header_count, self._head_size = True, 0, 0
            if self._head_timer is None:
                self._arm()

        def on_url(self, url: bytes) -> None:
            self._head_size += len(url)
            if not self._refused:
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            self._head_size += len(name) + len(value) + 4
            if self._header_count > limits.max_headers and not self._refused:
                self._refused = True
                self._refusal = ("header_count", f"more than {limits.max_headers} headers (http.max_headers)", 431)
            if not self._refused:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            self._in_head, self._head_bytes = False, 0
            if not self._refused and self._head_size > limits.max_bytes:  # it came whole in one read
                self._refused = True
                self._refusal = ("head_size", f"over {limits.max_bytes} bytes (http.max_head_bytes)", 431)
            elif not self._refused and len(self.url) > MAX_URL_BYTES:  # only with max_head_bytes raised past it
                self._refused = True
                self._refusal = ("url_size", f"URL is {len(self.url)} bytes, over {MAX_URL_BYTES}", 414)
            if not self._refused:
                super().on_headers_complete()
                cycle = self.cycle
                if cycle is not None and cycle.scope is self.scope:
                    cycle.transport = _HeadWithBody(self.transport, self.loop)

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._refused:
                super().on_message_complete()
            self._in_head, self._head_bytes = True, 0  # the next request's head may follow at once

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _refuse(self, limit: str, why: str, status: int = 431) -> None:
            """Answer 431 (414 for a URL) and close: the request never reaches the application."""
            self._disarm()
            said = f"request head too large: {status}, connection closed"
            refusals.refused(limit, said, client=_client(self.client))
            if status == 414:
                error = ApiError(414, f"the request's {why}", code="uri_too_long")
                status_line = b"HTTP/1.1 414 URI Too Long"
            else:
                error = ApiError(431, f"the request's head is {why}", code="request_header_fields_too_large")
                status_line = b"HTTP/1.1 431 Request Header Fields Too Large"
            content = error.content()
            head = (
                status_line + b"\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: " + str(len(content)).encode() + b"\r\n\r\n"
            )
            self.transport.write(head + content)
            self.transport.close()

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(limits.timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            refusals.refused(
                "header_timeout",
                "request head too slow: connection closed",
                client=_client(self.client),
                timeout=limits.timeout,
            )
            self.transport.close()

    return HeadLimitProtocol


class _HeadWithBody(asyncio.Transport):
    """A response's way out: its head is held until its body's first bytes (or this loop turn's
    end) and leaves with them in one write.

    uvicorn writes a head and a body apart: two segments, and the client is woken by the first;
    on a busy host it then runs (it was waiting) and the edge waits for a core to write the rest.
    Stamped in the edge back to back at load 4-9 on 2 cores (``edge_bench.py``'s workload), the
    time from x-iop-overhead-ms's stamp to the body's write fell from 0.535 to 0.168 ms (median)
    with one write: time the client waited that the header could not see.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None
        self._flush_later: asyncio.Handle | None = None
        """Set by the first write: the head's flush at the turn's end."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        # The first write is the head (or a 100 Continue): its body follows in this turn, a
        # stream's first chunk may not (then the head leaves alone as the turn ends).
        if self._flush_later is None:
            self._head = bytes(data)
            self._flush_later = self._loop.call_soon(self._flush)
        elif self._head is not None:
            head, self._head = self._head, None
            self._flush_later.cancel()
            self._transport.writelines((head, data))  # one write (uvloop: writev), the body not copied
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)


def _client(address: Any) -> str:
    return f"{address[0]}:{address[1]}" if address else "unknown"
