"""The platform's limits as HTTP: a full queue is 429 with Retry-After, a passed deadline is 504,
a request head that takes too long closes its connection."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import Stack, running_stack, wait_for
from .openai_schema import validate

ONE_SLOT = [
    {
        "model": "mock-one",
        "adapter": "mock",
        "max_concurrency": 1,
        "queue_size": 0,
        "options": {"tokens": 40, "tokens_per_second": 20},  # 2 s a run
    }
]


SLOW_CLIENTS = {"header_timeout": 1.0, "body_timeout": 1.0}


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One node with one slot; the control-plane queues no run; the edge gives a request 1 s, its head and body 1 s."""
    with running_stack(
        tmp_path_factory.mktemp("limits") / "stack",
        {"node-a": ONE_SLOT},
        control_plane={"queue_size": 0},
        edge_settings={"request_timeout": 1.0, "http": {"host": "127.0.0.1", "port": 0, **SLOW_CLIENTS}},
    ) as stack:
        yield stack


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "mock-one", "messages": [{"role": "user", "content": "hello"}], **fields}


def _error(response: Any, status: int, code: str) -> dict[str, Any]:
    body = response.json()
    assert response.status_code == status, body
    validate("ErrorResponse", body)
    assert body["error"]["code"] == code, body
    return body["error"]  # type: ignore[no-any-return]


def test_a_full_queue_is_429_with_retry_after_and_a_passed_deadline_504(one_slot: Stack) -> None:
    holding: dict[str, Any] = {}

    def hold() -> None:  # the only slot, for 2 s: longer than the edge's 1 s
        with one_slot.http() as http:
            holding["response"] = http.post("/chat/completions", json=_chat())

    holder = threading.Thread(target=hold)
    started = time.monotonic()
    holder.start()
    wait_for(lambda: one_slot.running("mock-one"), 5, 0.01, "the holder's run on the node's only slot")
    with one_slot.http() as http:
        response = http.post("/chat/completions", json=_chat())
        error = _error(response, 429, "queue_full")
        assert "queue" in error["message"]
        assert int(response.headers["retry-after"]) >= 1
    holder.join(timeout=30)
    late = holding["response"]
    _error(late, 504, "timeout")  # the run outlived request_timeout: ended by its deadline
    assert time.monotonic() - started < 5


def _closed_after(sock: socket.socket, trickle: bytes) -> float:
    """Seconds until the edge closes ``sock``, sending ``trickle`` a byte every 0.1 s meanwhile."""
    started = time.monotonic()
    sock.settimeout(0.1)
    for byte in itertools.cycle(trickle or b"\0"):
        try:
            if trickle:
                sock.send(bytes([byte]))
            if sock.recv(1024) == b"":
                return time.monotonic() - started
        except TimeoutError:
            pass
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - started
        if time.monotonic() - started > 10:
            raise AssertionError("the edge kept a slow client's connection for 10 s")
    raise AssertionError("unreachable")


def test_a_request_head_slower_than_header_timeout_closes_its_connection(one_slot: Stack) -> None:
    before = one_slot.refused("header_timeout")
    address = ("127.0.0.1", one_slot.edge_port)
    with socket.create_connection(address) as silent, socket.create_connection(address) as trickler:
        head = b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"x-pad: " + b"a" * 200
        trickled = _closed_after(trickler, head)  # a byte every 0.1 s: the head never completes in 1 s
        assert 0.9 <= trickled < 3.0
        assert _closed_after(silent, b"") < 3.0  # connected and said nothing (opened before: already past 1 s)
        with one_slot.http() as http:  # everyone else is served meanwhile
            assert http.get(one_slot.base_url.removesuffix("/v1") + "/health").status_code == 200
    assert one_slot.refused("header_timeout") == before + 2


def test_the_head_timeout_applies_to_every_request_of_a_keep_alive_connection(one_slot: Stack) -> None:
    before = one_slot.refused("header_timeout")
    with socket.create_connection(("127.0.0.1", one_slot.edge_port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        sock.settimeout(5)
        answer = b""
        while not answer.endswith(b'{"status":"ok"}'):
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 OK"), answer
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: ")  # half of a second request's head
        closed = _closed_after(sock, b"")
    assert 0.9 <= closed < 3.0, closed  # http.header_timeout is 1 s
    assert one_slot.refused("header_timeout") == before + 1


def test_a_request_body_slower_than_body_timeout_is_408(one_slot: Stack) -> None:
    before = one_slot.refused("body_timeout")
    body = json.dumps(_chat()).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {one_slot.key}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", one_slot.edge_port)) as sock:
        sock.sendall(head.encode() + body[:10])  # the rest never comes
        started = time.monotonic()
        sock.settimeout(10)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            piece = sock.recv(65536)
            if not piece:
                break
            answer += piece
    waited = time.monotonic() - started
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), answer
    error = json.loads(rest.partition(b"\r\n\r\n")[2])
    validate("ErrorResponse", error)
    assert error["error"]["code"] == "timeout" and "body_timeout" in error["error"]["message"]
    assert 0.9 <= waited < 3.0
    assert one_slot.refused("body_timeout") == before + 1


def test_a_body_still_arriving_holds_its_keys_concurrency_slot(stack: Stack) -> None:
    secret = stack.new_key("one-at-a-time", max_concurrent=1)
    body = json.dumps({"model": "mock-small", "messages": [{"role": "user", "content": "hello"}]}).encode()
    with stack.http(secret) as http:
        wait_for(lambda: http.get("/models").status_code == 200, 10, 0.05, "the key loaded by the edge")
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {secret}\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", stack.edge_port)) as slow:
            slow.sendall(head.encode() + body[:10])  # the body's rest comes later

            # its handler has it (counted in flight, admitted in the same step) before a second is sent
            wait_for(lambda: stack.edge_metric("iop_edge_requests_in_flight") == 1, 10, 0.02, "the slow request in")
            error = _error(http.post("/chat/completions", content=body), 429, "rate_limit_exceeded")
            assert "max_concurrent" in error["message"]
            slow.sendall(body[10:])
            slow.settimeout(10)
            answer = slow.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 OK"), answer
        wait_for(lambda: http.post("/chat/completions", content=body).status_code == 200, 10, 0.05, "the slot freed")
