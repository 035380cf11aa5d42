"""Request heads are bounded: one too large (bytes or headers) is 431 and its connection closed,
and two clients sending 64 MB headers hold neither the edge's memory nor anyone else's request."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

from .conftest import Stack
from .openai_schema import validate

HEAD_LIMIT = 64 * 1024
"""``http.max_head_bytes``'s default."""
ATTACK_BYTES = 64 * 1024 * 1024


def _answer(sock: socket.socket) -> bytes:
    """Everything the edge sends until it closes the connection (10 s at most)."""
    sock.settimeout(10)
    answer = b""
    while piece := sock.recv(65536):
        answer += piece
    return answer


def _refusal(answer: bytes) -> dict[str, Any]:
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 431 Request Header Fields Too Large", answer[:200]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    validate("ErrorResponse", body)
    assert body["error"]["code"] == "request_header_fields_too_large", body
    return body["error"]  # type: ignore[no-any-return]


def test_a_head_over_max_head_bytes_is_431(stack: Stack) -> None:
    before = stack.refused("head_size")
    with socket.create_connection(("127.0.0.1", stack.edge_port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (HEAD_LIMIT + 1024))
        error = _refusal(_answer(sock))
    assert "http.max_head_bytes" in error["message"]
    assert stack.refused("head_size") == before + 1


def test_a_head_with_more_than_max_headers_is_431(stack: Stack) -> None:
    before = stack.refused("header_count")
    headers = b"".join(b"x-h%d: 1\r\n" % index for index in range(101))
    with socket.create_connection(("127.0.0.1", stack.edge_port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + headers + b"\r\n")
        error = _refusal(_answer(sock))
    assert "http.max_headers" in error["message"]
    assert stack.refused("header_count") == before + 1


def test_a_head_within_the_limits_is_served(stack: Stack) -> None:
    headers = b"".join(b"x-h%d: %s\r\n" % (index, b"a" * 500) for index in range(90))  # 45 KB, 92 headers
    with socket.create_connection(("127.0.0.1", stack.edge_port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + headers + b"\r\n")
        assert _answer(sock).startswith(b"HTTP/1.1 200 OK")


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _send_huge_header(port: int, sent: list[int]) -> None:
    """A 64 MB header, a megabyte at a time, until the edge closes the connection."""
    chunk = b"a" * (1024 * 1024)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        total = 0
        try:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
            while total < ATTACK_BYTES:
                sock.sendall(chunk)
                total += len(chunk)
        except OSError:  # closed by the edge: what should happen
            pass
        sent.append(total)


def test_two_64_mb_headers_hold_neither_memory_nor_other_requests(stack: Stack) -> None:
    assert stack.edge is not None
    pid = stack.edge.popen.pid
    rss_before = _rss_kb(pid)
    sent: list[int] = []
    attackers = [threading.Thread(target=_send_huge_header, args=(stack.edge_port, sent)) for _ in range(2)]
    for attacker in attackers:
        attacker.start()
    client = stack.client()
    latencies = []
    while any(attacker.is_alive() for attacker in attackers) or not latencies:
        started = time.monotonic()
        answer = client.chat.completions.create(model="mock-small", messages=[{"role": "user", "content": "hi"}])
        latencies.append(time.monotonic() - started)
        assert answer.choices[0].message.content
    for attacker in attackers:
        attacker.join(timeout=30)
    assert all(total < ATTACK_BYTES for total in sent), sent  # cut off, not read to the end
    assert max(latencies) < 2.0, latencies  # a mock answer takes ~40 ms; the attack does not hold it
    assert _rss_kb(pid) - rss_before < 20 * 1024  # KB: nothing near the 128 MB sent
