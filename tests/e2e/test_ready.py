"""``/ready`` tells whether the edge can serve: its control-plane connections, the models served,
and its connections to the worker (files and batches), which the stack fixture waits for."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx

from .conftest import MOCK_ROUTES, Stack, running_stack, wait_for


def _ready(stack: Stack) -> dict[str, object]:
    response = httpx.get(stack.base_url.removesuffix("/v1") + "/ready", timeout=5)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_ready_counts_the_worker_connections_and_the_stack_waits_for_them(tmp_path: Path) -> None:
    with running_stack(tmp_path / "stack", {"node-a": MOCK_ROUTES}, worker={}) as stack:
        assert _ready(stack)["worker_connections"] == 1  # the fixture waited for it
        assert stack.client().files.list().data == []  # so the first file request is served, never 503
        assert stack.worker is not None
        stack.worker.stop()
        wait_for(
            lambda: _ready(stack)["worker_connections"] == 0, 5, 0.05, "the worker counted out"
        )  # still ready: chat is served


def test_ready_without_a_worker_reports_none(stack: Stack) -> None:
    assert _ready(stack)["worker_connections"] is None
