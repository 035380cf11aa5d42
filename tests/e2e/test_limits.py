"""The platform's limits as HTTP: a full queue is 429 with Retry-After, a passed deadline is 504."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import Stack, running_stack
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


@pytest.fixture
def one_slot(tmp_path: Path) -> Iterator[Stack]:
    """One node with one slot; the control-plane queues no run; the edge gives a request 1 s."""
    with running_stack(
        tmp_path / "stack",
        {"node-a": ONE_SLOT},
        control_plane={"queue_size": 0},
        edge_settings={"request_timeout": 1.0},
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
    time.sleep(0.5)  # the holder's run has the slot by now (it takes it within milliseconds)
    with one_slot.http() as http:
        response = http.post("/chat/completions", json=_chat())
        error = _error(response, 429, "queue_full")
        assert "queue" in error["message"]
        assert int(response.headers["retry-after"]) >= 1
    holder.join(timeout=30)
    late = holding["response"]
    _error(late, 504, "timeout")  # the run outlived request_timeout: ended by its deadline
    assert time.monotonic() - started < 5
