"""A node killed (SIGKILL) under a run: before its first token the run is retried elsewhere and
succeeds; mid-stream the stream ends with an SSE error event (the SDK raises APIError), not a cut."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from .conftest import Stack, wait_for
from .openai_schema import validate

GO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "go"}]


def test_node_killed_before_the_first_token_is_retried(two_nodes: Stack) -> None:
    client = two_nodes.client()
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(client.chat.completions.with_raw_response.create, model="mock-ttft", messages=GO)
        doomed = wait_for(lambda: two_nodes.running("mock-ttft"), 5, 0.01, "the run to start on a node")
        two_nodes.nodes[doomed].kill()
        raw = asked.result(timeout=30)
    validate("CreateChatCompletionResponse", raw.http_response.json())
    completion = raw.parse()
    assert len((completion.choices[0].message.content or "").split()) == 5
    survivor = next(node_id for node_id in two_nodes.nodes if node_id != doomed)
    record = two_nodes.run(survivor, raw.headers["x-request-id"])
    assert record is not None and record["status"] == "completed"
    assert not record["run_id"].endswith(".1"), "the run on the survivor is a second attempt"


def _stream_until_killed(stack: Stack, response: Any) -> list[dict[str, Any]]:
    """Every chunk of ``response``; the node serving it is killed after the third."""
    payloads = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payloads.append(line.removeprefix("data: "))
        if len(payloads) == 3:
            stack.nodes[wait_for(lambda: stack.running("mock-slow"), 5, 0.01)].kill()
    assert "[DONE]" not in payloads, "an error must not look like a finished stream"
    return [json.loads(payload) for payload in payloads]


def test_node_killed_mid_stream_ends_with_an_error_event(two_nodes: Stack) -> None:
    body = {"model": "mock-slow", "messages": GO, "stream": True}
    with two_nodes.http() as http, http.stream("POST", "/chat/completions", json=body) as response:
        assert response.status_code == 200
        received = _stream_until_killed(two_nodes, response)
    *chunks, last = received
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    validate("ErrorResponse", last)
    assert last["error"]["type"] == "server_error" and last["error"]["code"] == "node_lost"

    # the SDK turns that event into APIError (the run goes to the node left)
    stream = two_nodes.client().chat.completions.create(model="mock-slow", messages=GO, stream=True)
    with pytest.raises(openai.APIError) as caught:  # noqa: PT012 - the error comes while iterating
        for index, _ in enumerate(stream):
            if index == 2:
                two_nodes.nodes[wait_for(lambda: two_nodes.running("mock-slow"), 5, 0.01)].kill()
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "node_lost"
