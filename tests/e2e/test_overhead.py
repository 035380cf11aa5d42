"""x-iop-overhead-ms is IOP's time only: a backend that takes a known time (the mock's first token
after 1 s) is not in it, for a whole answer or a stream."""

from __future__ import annotations

import time

import pytest

from .conftest import Stack

BACKEND_SECONDS = 1.0
"""mock-ttft's time to its first token."""


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_overhead_header_leaves_out_the_backends_time(stack: Stack, stream: bool) -> None:
    body = {"model": "mock-ttft", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    with stack.http() as http:
        started = time.monotonic()
        with http.stream("POST", "/chat/completions", json=body) as response:
            assert response.status_code == 200
            response.read()
        took = time.monotonic() - started
    overhead_ms = float(response.headers["x-iop-overhead-ms"])
    assert took >= BACKEND_SECONDS
    assert 0 < overhead_ms < BACKEND_SECONDS * 1000 / 4, overhead_ms  # IOP's few ms, far below the backend's 1 s
