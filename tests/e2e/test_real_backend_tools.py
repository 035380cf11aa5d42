"""Tool calls through IOP to a real backend: llama-cpp-python (tests/backends) started with its
function-calling chat format (``chatml-function-calling``) behind the vllm adapter, driven with the
official ``openai`` SDK; every body and chunk a valid OpenAI schema.

With ``tool_choice`` naming a function, llama-cpp-python constrains the output with a grammar made
from the function's parameters: even the tiny model's random weights then write arguments valid for
a schema of enums and booleans, and end there. Its text is random words: only shapes are asserted.
Skipped (failed with IOP_BACKENDS_REQUIRED=1) when tests/backends/install.sh has not run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from backends.fixtures import require
from backends.servers import llama_server
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from .conftest import Stack, running_stack
from .openai_schema import arguments_valid, validate
from .sse import chunks, events

MODEL = "tiny-functions"
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "hourly": {"type": "boolean"}},
    "required": ["unit", "hourly"],
}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}},
]
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "what is the weather in Paris?"}]
REQUEST: dict[str, Any] = {
    "model": MODEL,
    "messages": ASK,
    "tools": TOOLS,
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "max_tokens": 60,
    "temperature": 0,
    "seed": 1,
}


@pytest.fixture(scope="module")
def functions(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One node whose only route is llama-cpp-python with the function-calling chat format."""
    require("llama")
    workdir = tmp_path_factory.mktemp("llama-functions")
    format_args = ["--chat_format", "chatml-function-calling"]
    with llama_server(tiny_gguf, extra_args=format_args, workdir=workdir) as server:
        routes = [{"model": MODEL, "adapter": "vllm", "target": "tiny", "options": {"base_url": server.base_url}}]
        with running_stack(tmp_path_factory.mktemp("functions-stack"), {"node-functions": routes}) as stack:
            yield stack


def test_a_named_tool_is_called_streamed_and_not_alike(functions: Stack) -> None:
    with functions.http() as http:
        whole = http.post("/chat/completions", json=REQUEST)
        assert whole.status_code == 200, whole.text
        body = whole.json()
        validate("CreateChatCompletionResponse", body)
        with http.stream("POST", "/chat/completions", json={**REQUEST, "stream": True}) as response:
            assert response.status_code == 200
            parsed = chunks(events(response), "CreateChatCompletionStreamResponse")
    choice = body["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    arguments = arguments_valid(call["function"]["arguments"], PARAMETERS)

    fragments = [
        fragment
        for chunk in parsed
        if chunk["choices"]
        for fragment in chunk["choices"][0]["delta"].get("tool_calls") or []
    ]
    assert {fragment["index"] for fragment in fragments} == {0}
    named = [fragment for fragment in fragments if "id" in fragment or "name" in fragment.get("function", {})]
    assert named == fragments[:1], "the id and name once, in the first fragment, as OpenAI streams them"
    assert fragments[0]["function"]["name"] == "get_weather" and fragments[0]["id"]
    streamed = "".join(fragment["function"].get("arguments") or "" for fragment in fragments)
    assert arguments_valid(streamed, PARAMETERS) == arguments, "greedy and seeded: the same call either way"
    finishes = [chunk["choices"][0]["finish_reason"] for chunk in parsed if chunk["choices"]]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}


def test_the_sdk_reads_the_call_and_the_tool_result_is_answered_in_text(functions: Stack) -> None:
    client = functions.client()
    completion = client.chat.completions.create(**REQUEST)
    call = completion.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    arguments_valid(call.function.arguments, PARAMETERS)

    answered: list[ChatCompletionMessageParam] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21})},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=answered, tools=TOOLS, tool_choice="none", max_tokens=6
    )
    validate("CreateChatCompletionResponse", raw.http_response.json())
    choice = raw.parse().choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason == "length", "the tiny model never ends early"
