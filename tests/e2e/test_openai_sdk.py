"""The official ``openai`` SDK against the edge, mock models: every body and chunk is a valid OpenAI schema."""

from __future__ import annotations

import base64
import struct
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from .conftest import Stack
from .openai_schema import COMPLETION_CHUNK, validate
from .sse import chunks, events

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


def _headers_ok(headers: Any) -> None:
    assert headers["x-request-id"]
    assert float(headers["x-iop-overhead-ms"]) >= 0


def test_chat_non_stream(stack: Stack) -> None:
    raw = stack.client().chat.completions.with_raw_response.create(model="mock-small", messages=HELLO)
    body = raw.http_response.json()
    validate("CreateChatCompletionResponse", body)
    _headers_ok(raw.headers)
    completion = raw.parse()
    assert completion.id == f"chatcmpl-{raw.headers['x-request-id']}"
    assert completion.model == "mock-small" and completion.object == "chat.completion"
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert len((choice.message.content or "").split()) == 8
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8


def test_chat_max_tokens_cuts_with_length(stack: Stack) -> None:
    raw = stack.client().chat.completions.with_raw_response.create(model="mock-small", messages=HELLO, max_tokens=3)
    validate("CreateChatCompletionResponse", raw.http_response.json())
    completion = raw.parse()
    assert completion.choices[0].finish_reason == "length"
    assert len((completion.choices[0].message.content or "").split()) == 3
    assert completion.usage is not None and completion.usage.completion_tokens == 3


def test_chat_stop_is_accepted(stack: Stack) -> None:
    # the mock adapter does not stop on sequences; the llama-cpp-python module checks the cut itself
    raw = stack.client().chat.completions.with_raw_response.create(
        model="mock-small", messages=HELLO, stop=["zzz", "\n\n"], max_completion_tokens=4
    )
    validate("CreateChatCompletionResponse", raw.http_response.json())
    assert raw.parse().choices[0].finish_reason == "length"


def test_chat_stream_with_the_sdk(stack: Stack) -> None:
    stream = stack.client().chat.completions.create(
        model="mock-small", messages=HELLO, stream=True, stream_options={"include_usage": True}
    )
    received = list(stream)
    assert received[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in received if chunk.choices)
    assert len(text.split()) == 8
    finishes = [chunk.choices[0].finish_reason for chunk in received if chunk.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert received[-1].choices == [] and received[-1].usage is not None
    assert received[-1].usage.completion_tokens == 8
    assert all(chunk.usage is None for chunk in received[:-1])
    assert len({chunk.id for chunk in received}) == 1


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream_raw_chunks_are_valid(stack: Stack, include_usage: bool) -> None:
    body: dict[str, Any] = {"model": "mock-small", "messages": HELLO, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with stack.http() as http, http.stream("POST", "/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        _headers_ok(response.headers)
        parsed = chunks(events(response), "CreateChatCompletionStreamResponse")
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in parsed)
    usage = [chunk for chunk in parsed if chunk.get("usage")]
    if include_usage:
        assert usage == [parsed[-1]] and parsed[-1]["choices"] == []
        assert parsed[-1]["usage"]["completion_tokens"] == 8
    else:
        assert usage == [] and all("usage" not in chunk for chunk in parsed)


def test_chat_stream_max_tokens(stack: Stack) -> None:
    body = {"model": "mock-small", "messages": HELLO, "stream": True, "max_tokens": 2}
    with stack.http() as http, http.stream("POST", "/chat/completions", json=body) as response:
        parsed = chunks(events(response), "CreateChatCompletionStreamResponse")
    assert sum(1 for chunk in parsed if chunk["choices"][0]["delta"].get("content")) == 2
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"


def test_models_list_and_retrieve(stack: Stack) -> None:
    client = stack.client()
    raw = client.models.with_raw_response.list()
    validate("ListModelsResponse", raw.http_response.json())
    assert {"mock-small", "mock-slow", "mock-ttft"} <= {model.id for model in raw.parse()}
    one = client.models.with_raw_response.retrieve("mock-small")
    validate("Model", one.http_response.json())
    assert one.parse().id == "mock-small" and one.parse().object == "model"


def test_embeddings_float(stack: Stack) -> None:
    raw = stack.client().embeddings.with_raw_response.create(
        model="mock-small", input=["one text", "another"], encoding_format="float"
    )
    validate("CreateEmbeddingResponse", raw.http_response.json())
    result = raw.parse()
    assert [item.index for item in result.data] == [0, 1]
    assert all(len(item.embedding) == 8 for item in result.data)
    assert result.usage.prompt_tokens == 3


def test_embeddings_base64_as_the_sdk_asks_by_default(stack: Stack) -> None:
    client = stack.client()
    decoded = client.embeddings.create(model="mock-small", input="one text").data[0].embedding
    raw = client.embeddings.with_raw_response.create(model="mock-small", input="one text", encoding_format="base64")
    body = raw.http_response.json()
    vector = base64.b64decode(body["data"][0]["embedding"])
    floats = list(struct.unpack(f"<{len(vector) // 4}f", vector))
    assert floats == pytest.approx(decoded)
    # the schema describes the float form: validate the body as OpenAI's float answer would be
    body["data"][0]["embedding"] = floats
    validate("CreateEmbeddingResponse", body)


def test_completions(stack: Stack) -> None:
    raw = stack.client().completions.with_raw_response.create(model="mock-small", prompt="once upon", max_tokens=5)
    validate("CreateCompletionResponse", raw.http_response.json())
    _headers_ok(raw.headers)
    completion = raw.parse()
    assert completion.object == "text_completion"
    assert len(completion.choices[0].text.split()) == 5 and completion.choices[0].finish_reason == "length"


def test_completions_stream(stack: Stack) -> None:
    stream = stack.client().completions.create(model="mock-small", prompt="once upon", stream=True)
    received = list(stream)
    assert len("".join(chunk.choices[0].text for chunk in received).split()) == 8
    body = {"model": "mock-small", "prompt": "once upon", "stream": True, "stream_options": {"include_usage": True}}
    with stack.http() as http, http.stream("POST", "/completions", json=body) as response:
        parsed = chunks(events(response), COMPLETION_CHUNK)
    assert parsed[-1]["usage"]["completion_tokens"] == 8


def test_sdk_error_is_typed(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        stack.client().chat.completions.create(model="no-such-model", messages=HELLO)
    assert caught.value.status_code == 404 and caught.value.code == "model_not_found"
    validate("ErrorResponse", caught.value.response.json())
