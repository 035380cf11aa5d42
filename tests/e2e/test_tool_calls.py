"""Tool calls end to end with the official ``openai`` SDK against the edge (mock models): the call,
streamed and not, its arguments valid for the tool's schema, then the tool's result sent back and a
text answer; every body and chunk a valid OpenAI schema."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import (
    ChatCompletionMessageParam,
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolParam,
)

from .conftest import Stack
from .openai_schema import arguments_valid, validate
from .sse import chunks, events

PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 60},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": PARAMETERS},
    },
]
CHOICE: ChatCompletionNamedToolChoiceParam = {"type": "function", "function": {"name": "get_weather"}}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "what is the weather in Paris?"}]


def _called(stack: Stack, **fields: Any) -> dict[str, Any]:
    """The non-streamed answer's body to ASK with TOOLS, checked against OpenAI's schema and the SDK's reading."""
    raw = stack.client().chat.completions.with_raw_response.create(
        model="mock-small", messages=ASK, tools=TOOLS, **fields
    )
    body: dict[str, Any] = raw.http_response.json()
    validate("CreateChatCompletionResponse", body)
    parsed = raw.parse().choices[0]
    assert parsed.finish_reason == "tool_calls" and parsed.message.tool_calls is not None
    assert [call.id for call in parsed.message.tool_calls] == [
        call["id"] for call in body["choices"][0]["message"]["tool_calls"]
    ]
    return body


def _streamed(stack: Stack, **fields: Any) -> list[dict[str, Any]]:
    """The streamed answer's chunks to ASK with TOOLS, each checked against OpenAI's chunk schema."""
    body = {"model": "mock-small", "messages": ASK, "tools": TOOLS, "stream": True, **fields}
    with stack.http() as http, http.stream("POST", "/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        return chunks(events(response), "CreateChatCompletionStreamResponse")


def _accumulated(parsed: list[dict[str, Any]]) -> dict[str, Any]:
    """The tool call a stream's fragments add up to, as a non-streamed message shows it."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in parsed:
        for fragment in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk["choices"] else []:
            call = calls.setdefault(fragment["index"], {"function": {"arguments": ""}})
            if "id" in fragment:
                call["id"], call["type"] = fragment["id"], fragment["type"]
            function = fragment.get("function") or {}
            if "name" in function:
                call["function"]["name"] = function["name"]
            call["function"]["arguments"] += function.get("arguments") or ""
    assert list(calls) == [0], "one call, index 0"
    return calls[0]


def test_a_named_tool_is_called_and_its_result_answered_in_text(stack: Stack) -> None:
    body = _called(stack, tool_choice=CHOICE)
    message = body["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert set(arguments_valid(call["function"]["arguments"], PARAMETERS)) == set(PARAMETERS["properties"])
    assert message["content"] is None and message["role"] == "assistant"
    assert body["usage"]["completion_tokens"] > 0

    answered: list[ChatCompletionMessageParam] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"celsius": 21, "sky": "clear"})},
    ]
    raw = stack.client().chat.completions.with_raw_response.create(
        model="mock-small", messages=answered, tools=TOOLS, tool_choice=CHOICE
    )
    validate("CreateChatCompletionResponse", raw.http_response.json())
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert len((choice.message.content or "").split()) == 8


def test_without_tool_choice_the_first_tool_is_called(stack: Stack) -> None:
    (call,) = _called(stack)["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"]) == {}


def test_the_stream_adds_up_to_the_same_call_as_the_whole_answer(stack: Stack) -> None:
    whole = _called(stack, tool_choice=CHOICE)["choices"][0]["message"]["tool_calls"][0]
    parsed = _streamed(stack, tool_choice=CHOICE, stream_options={"include_usage": True})
    assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
    with_calls = [chunk for chunk in parsed if chunk["choices"] and chunk["choices"][0]["delta"].get("tool_calls")]
    first = with_calls[0]["choices"][0]["delta"]["tool_calls"][0]
    assert first["id"] == whole["id"] and first["function"]["name"] == "get_weather", "id and name come first"
    assert all("id" not in chunk["choices"][0]["delta"]["tool_calls"][0] for chunk in with_calls[1:])
    assert len(with_calls) > 2, "the arguments come in fragments"
    assert _accumulated(parsed) == whole
    finishes = [chunk["choices"][0]["finish_reason"] for chunk in parsed if chunk["choices"]]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"]["completion_tokens"] == len(with_calls) - 1


def test_the_sdk_reads_the_streamed_call_and_then_streams_the_answer(stack: Stack) -> None:
    client = stack.client()
    received = list(client.chat.completions.create(model="mock-small", messages=ASK, tools=TOOLS, stream=True))
    name, arguments, call_id = "", "", ""
    for chunk in received:
        for fragment in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            call_id = fragment.id or call_id
            name += fragment.function.name or "" if fragment.function else ""
            arguments += fragment.function.arguments or "" if fragment.function else ""
    assert name == "get_time" and json.loads(arguments) == {} and call_id.startswith("call_")
    assert received[-1].choices[0].finish_reason == "tool_calls"

    answered: list[ChatCompletionMessageParam] = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "12:00"},
    ]
    body = {"model": "mock-small", "messages": answered, "tools": TOOLS, "stream": True}
    with stack.http() as http, http.stream("POST", "/chat/completions", json=body) as response:
        parsed = chunks(events(response), "CreateChatCompletionStreamResponse")
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in parsed if chunk["choices"])
    assert len(text.split()) == 8 and parsed[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any(chunk["choices"][0]["delta"].get("tool_calls") for chunk in parsed if chunk["choices"])


def test_max_tokens_cuts_a_call_with_length(stack: Stack) -> None:
    raw = stack.client().chat.completions.with_raw_response.create(
        model="mock-small", messages=ASK, tools=TOOLS, tool_choice=CHOICE, max_tokens=2
    )
    body = raw.http_response.json()
    validate("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert (
        choice["finish_reason"] == "length" and len(choice["message"]["tool_calls"][0]["function"]["arguments"]) == 16
    )


def test_tool_choice_none_answers_in_text(stack: Stack) -> None:
    raw = stack.client().chat.completions.with_raw_response.create(
        model="mock-small", messages=ASK, tools=TOOLS, tool_choice="none"
    )
    validate("CreateChatCompletionResponse", raw.http_response.json())
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls and choice.message.content


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0]"),
    ],
    ids=["unknown-tool", "garbage-choice", "nameless-tool"],
)
def test_bad_tools_get_a_400_naming_the_field(stack: Stack, fields: dict[str, Any], param: str) -> None:
    body = {"model": "mock-small", "messages": ASK, "tools": TOOLS, **fields}
    with stack.http() as http:
        response = http.post("/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
