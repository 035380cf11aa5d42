"""HTTP/1.1 for the node's client, sans-IO: request bytes out, response bytes in, no sockets.

``ResponseReader`` drives llhttp (``httptools.HttpResponseParser``, the parser under uvicorn)
with the bytes of one connection and keeps what the client needs of each response: status,
headers, body bytes, whether it ended and whether the connection may carry another request.
llhttp refuses what HTTP forbids (``Transfer-Encoding`` with ``Content-Length``, a status of
four digits, bad chunk framing); this module adds what a client must bound itself: the head's
size and header count, the HTTP version, status range, transfer codings it cannot decode, and
bytes after the response. ``LineSplitter`` cuts a body into lines (SSE, NDJSON) with a cap on
one line's length. Errors are ``ProtocolError``; the connection is then unusable.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import httptools

from iop_node.adapters.httperrors import ProtocolError

__all__ = ["DEFAULT_MAX_LINE", "MAX_HEAD", "MAX_HEADERS", "LineSplitter", "ResponseReader", "header_lines"]

MAX_HEAD = 64 * 1024
"""Bytes of a response's status line and headers (interim 1xx answers included)."""
MAX_HEADERS = 100
"""Header fields of a response, trailers and interim answers included."""
DEFAULT_MAX_LINE = 8 * 1024 * 1024
"""Bytes of one streamed line by default: a whole SSE event or NDJSON object must fit."""

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")  # visible latin-1, space and tab: no CR, LF, NUL


def header_lines(fields: Mapping[str, str]) -> bytes:
    """``fields`` as request header lines; ValueError for a name or value that would break the head."""
    out = []
    for name, value in fields.items():
        if not _TOKEN.fullmatch(name):
            raise ValueError(f"header name {name!r} is not an HTTP token")
        if not _VALUE.fullmatch(value):
            raise ValueError(f"header {name} has a control or non-latin-1 character (CR, LF, NUL, ...)")
        out.append(f"{name}: {value}\r\n")
    return "".join(out).encode("latin-1")


class _Stray(Exception):
    """Bytes came after the response: stops the parser; the response stands, the connection does not."""


class ResponseReader:
    """The response side of one connection: ``feed`` it the bytes received, ``reset`` it per request."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.reset()

    def reset(self) -> None:
        """Forget the last response: a new request went out."""
        self.status = 0
        self.headers: dict[str, str] = {}
        """Header names in lower case; repeated headers joined with ", "."""
        self.head_done = False
        """The final (non-1xx) response's head is in."""
        self.keep_alive = False
        self.until_close = False
        """The body has no length: it ends when the server closes."""
        self.chunks: list[bytes] = []
        """Body bytes received and not taken yet."""
        self.unread = 0
        self.complete = False
        """The whole response is in."""
        self.received = False
        """Any byte arrived since the request went out."""
        self.stray = False
        """Bytes came after the response: the connection cannot carry another request."""
        self.error: ProtocolError | None = None
        self._fields: list[tuple[bytes, bytes]] = []
        self._head_fed = 0  # bytes fed while the head was not complete (the body's too)
        self._field_bytes = 0
        self._field_count = 0
        self._interim = False

    @property
    def reusable(self) -> bool:
        """The response ended cleanly and both sides keep the connection open."""
        return self.complete and self.keep_alive and not self.stray and self.error is None

    def feed(self, data: bytes) -> None:
        """Parse ``data``; bytes that are not HTTP (or over a limit) set ``error``."""
        self.received = True
        if self.error is not None or self.stray:
            return
        if not self.head_done:
            self._head_fed += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.error = ProtocolError("the server switched protocols (HTTP 101)")
        except httptools.HttpParserError as exc:
            if not self.stray:
                refusal = exc.__context__
                self.error = refusal if isinstance(refusal, ProtocolError) else ProtocolError(f"not HTTP/1.1: {exc}")
        if not self.head_done and self._head_fed > MAX_HEAD and self.error is None:
            self.error = ProtocolError(f"response head over {MAX_HEAD} bytes")

    def feed_eof(self) -> None:
        """The server closed the connection: a body without a length ends here."""
        if self.head_done and self.until_close and self.error is None:
            self.complete = True

    def take(self) -> bytes:
        """The body bytes received since the last call (b"" if none)."""
        chunks = self.chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.unread = 0
        return data

    # -- llhttp callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            self.stray = True
            raise _Stray

    def on_header(self, name: bytes, value: bytes) -> None:
        self._field_count += 1
        self._field_bytes += len(name) + len(value)
        if self._field_count > MAX_HEADERS:
            raise ProtocolError(f"response with over {MAX_HEADERS} header fields")
        if self._field_bytes > MAX_HEAD:
            raise ProtocolError(f"response head over {MAX_HEAD} bytes")
        if not self.head_done:
            self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # interim answers: skipped, but counted
            self._interim = True
            self._field_count += 1
            self._fields = []
            return
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise ProtocolError(f"HTTP/{version} is not HTTP/1.x")
        if not 200 <= status <= 599:
            raise ProtocolError(f"status {status} is not a final HTTP status")
        headers = self.headers
        for raw_name, raw_value in self._fields:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1").strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self._fields = []
        coding = headers.get("transfer-encoding")
        if coding is not None and coding.lower() != "chunked":
            raise ProtocolError(f"Transfer-Encoding {coding[:80]!r} is not read here (only chunked)")
        self.until_close = coding is None and "content-length" not in headers and status not in (204, 304)
        self.status = status
        self.keep_alive = parser.should_keep_alive()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.unread += len(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
        else:
            self.complete = True


class LineSplitter:
    """A body's non-empty lines, stripped (SSE, NDJSON); ProtocolError for a line over ``limit`` bytes."""

    __slots__ = ("_limit", "_pending")

    def __init__(self, limit: int = DEFAULT_MAX_LINE) -> None:
        self._limit = limit
        self._pending = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The lines ``data`` completes; the rest is kept for the next call."""
        end = data.rfind(b"\n")
        if end < 0:
            self._hold(data)
            return []
        pending = self._pending
        if pending:
            pending += data[:end]
            text = bytes(pending)
            pending.clear()
        elif end == len(data) - 1:
            text = data  # the common case, whole lines: no copy (the empty last piece is dropped below)
        else:
            text = data[:end]
        if end + 1 < len(data):
            self._hold(data[end + 1 :])
        lines = text.split(b"\n")
        if len(text) > self._limit and max(map(len, lines)) > self._limit:
            raise self._too_long()
        return list(filter(None, map(bytes.strip, lines)))

    def finish(self) -> bytes:
        """What is left after the body's end: a last line without a newline, or b""."""
        line = bytes(self._pending).strip()
        self._pending.clear()
        return line

    def _hold(self, data: bytes) -> None:
        # an append, never a re-join: a long line costs its length, not its length squared
        self._pending += data
        if len(self._pending) > self._limit:
            raise self._too_long()

    def _too_long(self) -> ProtocolError:
        return ProtocolError(f"a line of the response is over {self._limit} bytes (max_line_bytes)")
