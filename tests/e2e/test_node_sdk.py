"""A streaming chat and a streamed response with the npm ``openai`` package (pinned in tests/ts/package.json), run
by Node (``npm_stream.mjs``)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .conftest import Stack
from .openai_schema import validate

HERE = Path(__file__).parent
PACKAGE = HERE.parent / "ts" / "node_modules" / "openai" / "package.json"


def _streamed(stack: Stack, api: str) -> list[dict[str, Any]]:
    """What npm_stream.mjs (Node, the npm package) printed for one stream of mock-small through ``api``
    (chat, responses): a JSON line per chunk or event, checked to end with ``{"done": true}`` (left out)."""
    node = shutil.which("node")
    if node is None or not PACKAGE.exists():
        pytest.fail("node and tests/ts/node_modules/openai are needed: run `just ts-install`")
    result = subprocess.run(
        [node, str(HERE / "npm_stream.mjs"), api, stack.base_url, stack.key, "mock-small"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    *received, end = [json.loads(line) for line in result.stdout.splitlines()]
    assert end == {"done": True}
    return received


def test_streaming_chat_with_the_npm_openai_package(stack: Stack) -> None:
    received = _streamed(stack, "chat")
    for chunk in received:
        validate("CreateChatCompletionStreamResponse", chunk)
    assert received[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in received if chunk["choices"])
    assert len(text.split()) == 8
    assert received[-1]["choices"] == [] and received[-1]["usage"]["completion_tokens"] == 8


def test_streaming_a_response_with_the_npm_openai_package(stack: Stack) -> None:
    received = _streamed(stack, "responses")
    for event in received:
        validate("ResponseStreamEvent", event)
    kinds = [event["type"] for event in received]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event["sequence_number"] for event in received] == list(range(len(received)))
    text = "".join(event["delta"] for event in received if event["type"] == "response.output_text.delta")
    assert len(text.split()) == 8
    assert received[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert received[-1]["response"]["usage"]["output_tokens"] == 8
