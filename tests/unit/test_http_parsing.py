"""The HTTP client's response parsing, sans-IO: bytes fed to ``http11.ResponseReader`` and
``LineSplitter`` with no socket, every framing case and every refusal the client relies on."""

from __future__ import annotations

import time

import pytest

from iop_node.adapters.http11 import MAX_HEAD, MAX_HEADERS, LineSplitter, ResponseReader, header_lines
from iop_node.adapters.httperrors import ProtocolError


def _read(*pieces: bytes) -> ResponseReader:
    reader = ResponseReader()
    for piece in pieces:
        reader.feed(piece)
    return reader


def _body(reader: ResponseReader) -> bytes:
    return reader.take()


def test_content_length_body_and_keep_alive() -> None:
    reader = _read(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: text/plain\r\n\r\nhello")
    assert (reader.status, reader.headers["content-type"], _body(reader)) == (200, "text/plain", b"hello")
    assert reader.complete and reader.reusable


def test_chunked_body_split_at_every_byte_with_extensions_and_trailers() -> None:
    stream = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-T: y\r\n\r\n"
    )
    reader = _read(*(bytes([byte]) for byte in stream))
    assert _body(reader) == b"hello world"
    assert reader.complete and reader.reusable
    assert "x-t" not in reader.headers  # a trailer is not a header


def test_repeated_headers_are_joined_names_lower_cased_values_stripped() -> None:
    reader = _read(b"HTTP/1.1 404 Not Found\r\nX-A: 1\r\nx-a:  2 \r\nContent-Length: 0\r\n\r\n")
    assert (reader.status, reader.headers["x-a"]) == (404, "1, 2")


def test_interim_answers_are_skipped() -> None:
    reader = _read(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
    assert not reader.head_done
    reader.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert (reader.status, _body(reader), reader.complete) == (200, b"ok", True)
    assert "link" not in reader.headers


def test_204_has_no_body_and_a_close_delimited_body_ends_with_the_connection() -> None:
    assert _read(b"HTTP/1.1 204 No Content\r\n\r\n").complete
    reader = _read(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nline one\nline")
    assert not reader.complete and not reader.keep_alive
    reader.feed(b" two")
    reader.feed_eof()
    assert reader.complete and _body(reader) == b"line one\nline two"
    assert not reader.reusable


def test_an_unfinished_body_is_not_complete_at_eof() -> None:
    reader = _read(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
    reader.feed_eof()
    assert not reader.complete  # the connection's close is an error, not the body's end


@pytest.mark.parametrize(
    ("head", "connection_stays"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n", True),
    ],
)
def test_keep_alive_follows_version_and_connection_header(head: bytes, connection_stays: bool) -> None:
    assert _read(head).reusable is connection_stays


def test_bytes_after_the_response_leave_it_whole_and_the_connection_unusable() -> None:
    reader = _read(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 408 Request Timeout\r\n\r\n")
    assert reader.complete and _body(reader) == b"ok" and reader.error is None
    assert reader.stray and not reader.reusable


def test_reset_starts_the_next_response_on_the_same_connection() -> None:
    reader = _read(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nX-First: 1\r\n\r\none")
    reader.take()
    reader.reset()
    reader.feed(b"HTTP/1.1 201 Created\r\nContent-Length: 3\r\n\r\ntwo")
    assert (reader.status, _body(reader), reader.complete) == (201, b"two", True)
    assert "x-first" not in reader.headers


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        # Transfer-Encoding with Content-Length, in both orders: a request-smuggling shape
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            "Content-Length",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            "Content-Length",
        ),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: xchunkedx\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "Transfer-Encoding"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", "only chunked"),
        (b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n", "status"),
        (b"HTTP/1.1 099 OK\r\nContent-Length: 0\r\n\r\n", "status 99"),
        (b"HTTP/1.1 600 OK\r\nContent-Length: 0\r\n\r\n", "status 600"),
        (b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n", "HTTP/2.0"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n", "status 101"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not HTTP/1.1"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "not HTTP/1.1"),
        (b"HTTP/1.1 200 OK\r\nX: a\nY: b\r\n\r\n", "not HTTP/1.1"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Content-Length"),
        ("HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"), "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nx", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX", "after chunk"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 5000, "overflow"),
    ],
)
def test_what_is_not_http_or_not_safe_is_refused(answer: bytes, message: str) -> None:
    reader = _read(answer)
    assert isinstance(reader.error, ProtocolError)
    assert message in str(reader.error)
    assert not reader.reusable


def test_ten_thousand_headers_in_one_read_are_refused() -> None:
    started = time.process_time()
    reader = _read(b"HTTP/1.1 200 OK\r\n" + b"X-Flood: y\r\n" * 10_000 + b"Content-Length: 0\r\n\r\n")
    assert reader.error is not None and f"over {MAX_HEADERS} header fields" in str(reader.error)
    assert not reader.head_done
    assert time.process_time() - started < 0.5


def test_a_head_over_the_limit_is_refused_across_reads() -> None:
    reader = _read(b"HTTP/1.1 200 OK\r\nX-Big: ")
    for _ in range(MAX_HEAD // 4096 + 1):
        reader.feed(b"x" * 4096)  # one header value that never ends
    assert reader.error is not None and f"head over {MAX_HEAD} bytes" in str(reader.error)


def test_a_large_body_with_its_head_in_one_read_is_not_a_large_head() -> None:
    body = b"x" * (2 * MAX_HEAD)
    reader = _read(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert reader.error is None and reader.complete and _body(reader) == body


def test_nothing_more_is_parsed_after_an_error() -> None:
    reader = _read(b"HTTP/1.1 2000 OK\r\n")
    error = reader.error
    reader.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert reader.error is error and not reader.head_done


# -- lines -----------------------------------------------------------------------------------


def test_lines_across_pieces_with_crlf_and_blank_lines() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b'data: {"a":1}\r\n\r\ndata: [DO') == [b'data: {"a":1}']
    assert splitter.feed(b"NE]") == []
    assert splitter.feed(b"\n\nnext") == [b"data: [DONE]"]
    assert splitter.finish() == b"next"


def test_whole_lines_in_one_piece() -> None:
    assert LineSplitter().feed(b"one\n\ntwo\n") == [b"one", b"two"]


def test_a_64_mib_line_fails_fast_at_the_cap() -> None:
    splitter = LineSplitter(8 * 1024 * 1024)
    piece = b"x" * 65536
    started = time.process_time()
    with pytest.raises(ProtocolError, match=r"over 8388608 bytes \(max_line_bytes\)"):  # noqa: PT012 - fed until it fails
        for _ in range(64 * 1024 * 1024 // len(piece)):
            splitter.feed(piece)
    assert time.process_time() - started < 0.5  # linear in the cap, not quadratic in the line


def test_a_long_line_inside_one_piece_is_refused_and_short_ones_pass() -> None:
    with pytest.raises(ProtocolError, match="over 1024 bytes"):
        LineSplitter(1024).feed(b"short\n" + b"y" * 2000 + b"\nend\n")
    assert LineSplitter(1024).feed(b"a" * 1000 + b"\n" + b"b" * 1000 + b"\n") == [b"a" * 1000, b"b" * 1000]


# -- request head ----------------------------------------------------------------------------


def test_header_lines_refuse_what_would_break_the_head() -> None:
    assert header_lines({"Authorization": "Bearer k-1"}) == b"Authorization: Bearer k-1\r\n"
    for value in ("a\r\nX-Injected: 1", "a\nb", "nul\x00", "caf\u00e9 \u20ac"):
        with pytest.raises(ValueError, match="control or non-latin-1"):
            header_lines({"Authorization": value})
    with pytest.raises(ValueError, match="not an HTTP token"):
        header_lines({"Bad Name": "x"})
