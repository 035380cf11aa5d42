"""The same OpenAI calls against a real backend: llama-cpp-python (tests/backends) behind the vllm adapter.

The tiny model's text is random words: these tests assert protocol, shapes and limits, not text.
Skipped (failed with IOP_BACKENDS_REQUIRED=1) when tests/backends/install.sh has not run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from backends.servers import BackendServer
from openai.types.chat import ChatCompletionMessageParam

from .conftest import Stack, running_stack
from .openai_schema import COMPLETION_CHUNK, validate
from .sse import chunks, events

MODEL = "tiny"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def llama(llama_embedding_backend: BackendServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One node whose only route is llama-cpp-python (started with embeddings on: chat works too)."""
    options = {"base_url": llama_embedding_backend.base_url, "health_interval": 0.2}
    routes = [{"model": MODEL, "adapter": "vllm", "options": options}]
    with running_stack(tmp_path_factory.mktemp("llama-stack"), {"node-llama": routes}) as stack:
        yield stack


def test_chat_non_stream(llama: Stack) -> None:
    raw = llama.client().chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=6)
    validate("CreateChatCompletionResponse", raw.http_response.json())
    completion = raw.parse()
    assert completion.choices[0].finish_reason == "length" and completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens == 6


def test_chat_stream_with_usage(llama: Stack) -> None:
    body = {
        "model": MODEL,
        "messages": HELLO,
        "stream": True,
        "max_tokens": 5,
        "stream_options": {"include_usage": True},
    }
    with llama.http() as http, http.stream("POST", "/chat/completions", json=body) as response:
        assert response.status_code == 200
        parsed = chunks(events(response), "CreateChatCompletionStreamResponse")
    assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [chunk["choices"][0]["finish_reason"] for chunk in parsed[:-1]][-1] == "length"
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"]["completion_tokens"] == 5

    sdk = list(llama.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in sdk if chunk.choices)


def test_stop_cuts_the_text_before_the_sequence(llama: Stack) -> None:
    client = llama.client()
    ask = {"model": MODEL, "messages": HELLO, "max_tokens": 16, "temperature": 0, "seed": 7}
    full = client.chat.completions.create(**ask).choices[0].message.content  # type: ignore[call-overload]
    assert full and len(full) > 8
    stop = next(full[i : i + 3] for i in range(len(full) // 2, len(full) - 3) if full.find(full[i : i + 3]) == i)
    raw = client.chat.completions.with_raw_response.create(**ask, stop=[stop])  # type: ignore[call-overload]
    validate("CreateChatCompletionResponse", raw.http_response.json())
    cut = raw.parse().choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full[: full.find(stop)]


def test_completions(llama: Stack) -> None:
    raw = llama.client().completions.with_raw_response.create(model=MODEL, prompt="once upon", max_tokens=4)
    validate("CreateCompletionResponse", raw.http_response.json())
    assert raw.parse().choices[0].finish_reason == "length"
    body = {"model": MODEL, "prompt": "once upon", "max_tokens": 4, "stream": True}
    with llama.http() as http, http.stream("POST", "/completions", json=body) as response:
        parsed = chunks(events(response), COMPLETION_CHUNK)
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"


def test_embeddings(llama: Stack) -> None:
    raw = llama.client().embeddings.with_raw_response.create(
        model=MODEL, input=["one", "two words"], encoding_format="float"
    )
    validate("CreateEmbeddingResponse", raw.http_response.json())
    assert [len(item.embedding) for item in raw.parse().data] == [64, 64]


def test_models(llama: Stack) -> None:
    client = llama.client()
    raw = client.models.with_raw_response.list()
    validate("ListModelsResponse", raw.http_response.json())
    assert [model.id for model in raw.parse()] == [MODEL]
    validate("Model", client.models.with_raw_response.retrieve(MODEL).http_response.json())
