"""Anthropic's Messages API mapping (iop_wire.openai.messages_api), without sockets: requests in as chat
runs, every refused field named, Messages and stream events out, errors in Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event  # the SDK's stream accumulator (MessageStream's)
from anthropic.types import Message, RawMessageStreamEvent
from google.protobuf import json_format
from pydantic import TypeAdapter

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.openai.errors import ApiError
from iop_wire.openai.messages_api import (
    MAX_TOKENS,
    MessageStream,
    count_request,
    error_body,
    error_status,
    message_body,
    messages_request,
)
from iop_wire.openai.requests import parse_body
from iop_wire.openai.responses import Outcome, collect_delta

_BASE: dict[str, Any] = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
_TOOL = {"name": "get_weather", "description": "w", "input_schema": {"type": "object", "properties": {}}}
_EVENTS: TypeAdapter[RawMessageStreamEvent] = TypeAdapter(RawMessageStreamEvent)


def _refused(fields: dict[str, Any], *, without: str = "") -> ApiError:
    data = {**_BASE, **fields}
    data.pop(without, None)
    with pytest.raises(ApiError) as caught:
        messages_request(data, "r1")
    assert caught.value.status == 400 and error_body(caught.value)["error"]["type"] == "invalid_request_error"
    return caught.value


def test_a_request_becomes_a_chat_run() -> None:
    data = {
        **_BASE,
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "...", "signature": "s"},
                    {"type": "text", "text": "let me see"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": True},
                    {"type": "text", "text": "and tomorrow?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                ],
            },
        ],
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "tools": [_TOOL],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "u-7"},
        "stream": True,
        "service_tier": "auto",
        "thinking": {"type": "disabled"},
    }
    parsed = messages_request(data, "r1")
    run = parsed.request
    assert parsed.stream and run.stream and run.kind == pb.RUN_KIND_CHAT and run.model == "m"
    roles = [message.role for message in run.messages]
    assert roles == [pb.ROLE_SYSTEM, pb.ROLE_USER, pb.ROLE_ASSISTANT, pb.ROLE_TOOL, pb.ROLE_TOOL, pb.ROLE_USER]
    assistant = run.messages[2]
    assert [part.text for part in assistant.content] == ["let me see"]
    assert assistant.tool_calls[0].id == "toolu_1" and assistant.tool_calls[0].function.name == "get_weather"
    assert json.loads(assistant.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert (run.messages[3].tool_call_id, run.messages[3].content[0].text) == ("toolu_1", "sunny")
    assert run.messages[4].content[0].text == "Error: down"
    assert run.messages[5].content[0].text == "and tomorrow?"
    assert run.messages[5].content[1].image_url.url == "data:image/png;base64,AAAA"
    sampling = run.sampling
    assert (sampling.max_tokens, list(sampling.stop), sampling.top_k) == (10, ["END"], 40)
    assert sampling.temperature == 0.5 and sampling.top_p == pytest.approx(0.9)
    fields = json_format.MessageToDict(run.openai_fields)
    assert fields["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "w", "parameters": _TOOL["input_schema"]},
        }
    ]
    assert (fields["tool_choice"], fields["parallel_tool_calls"]) == ("required", False)
    assert run.metadata["user"] == "u-7"


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_tool_choice_in_chat_completions_terms(choice: dict[str, Any], expected: Any) -> None:
    run = messages_request({**_BASE, "tools": [_TOOL], "tool_choice": choice}, "r1").request
    assert json_format.MessageToDict(run.openai_fields)["tool_choice"] == expected


def test_structured_output_becomes_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fields = {"output_config": {"effort": "low", "format": {"type": "json_schema", "schema": schema}}}
    run = messages_request({**_BASE, **fields}, "r1").request
    wanted = json_format.MessageToDict(run.openai_fields)["response_format"]
    assert wanted == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def test_count_tokens_needs_no_max_tokens() -> None:
    data = {key: value for key, value in _BASE.items() if key != "max_tokens"}
    run = count_request({**data, "tools": [_TOOL]}, "r1")
    assert run.kind == pb.RUN_KIND_COUNT_TOKENS and not run.sampling.HasField("max_tokens")
    assert json_format.MessageToDict(run.openai_fields)["tools"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    "field",
    [("max_tokens", 10), ("stream", True), ("temperature", 0.5), ("stop_sequences", ["x"]), ("top_k", 5)],
    ids=lambda field: field[0],
)
def test_count_tokens_refuses_the_fields_about_generating(field: tuple[str, Any]) -> None:
    """Anthropic's count_tokens takes no max_tokens, stream or sampling fields: an extra input, as there."""
    data = {key: value for key, value in _BASE.items() if key != "max_tokens"}
    with pytest.raises(ApiError) as caught:
        count_request({**data, field[0]: field[1]}, "r1")
    assert caught.value.status == 400 and caught.value.message == f"{field[0]}: Extra inputs are not permitted"
    assert caught.value.param == field[0]


@pytest.mark.parametrize(
    ("fields", "without", "named"),
    [
        ({}, "max_tokens", "max_tokens: Field required"),
        ({"max_tokens": 0}, "", "max_tokens: Input should be greater than or equal to 1"),
        ({"max_tokens": "10"}, "", "max_tokens: Input should be a valid integer"),
        ({"max_tokens": 10**12}, "", "max_tokens: Input should be less than or equal to 2147483647, got 1000000000000"),
        ({}, "model", "model: Field required"),
        ({}, "messages", "messages: Field required"),
        ({"messages": []}, "", "messages: Input should be a non-empty list"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "", "messages.0.role: Input should be"),
        ({"messages": [{"role": "user"}]}, "", "messages.0.content: Field required"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "", "messages.0.name: Extra inputs"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "", "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use"}]}]}, "", "messages.0.content.0.type"),
        ({"messages": [{"role": "assistant", "content": [{"type": "image"}]}]}, "", "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "", "messages.0.content.0.text"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
            "",
            "messages.0.content.0.source.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "",
            "messages.0.content.0.tool_use_id: Field required",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]},
            "",
            "messages.0.content.0.input",
        ),
        ({"system": 3}, "", "system: Input should be"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "", "tools.0.type"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "", "tools.0.type"),
        ({"tools": [{"name": "f"}]}, "", "tools.0.input_schema: Field required"),
        ({"tools": [{"input_schema": {}}]}, "", "tools.0.name: Field required"),
        ({"tools": [{**_TOOL, "name": ""}]}, "", 'tools.0.name: "" should be 1 to 128 letters'),
        ({"tools": [{**_TOOL, "name": "get weather"}]}, "", 'tools.0.name: "get weather" should be'),
        ({"tools": [{**_TOOL, "name": "x" * 129}]}, "", "tools.0.name: "),
        ({"tools": [_TOOL, {**_TOOL, "name": "f"}, _TOOL]}, "", 'tools.2.name: "get_weather" is an earlier tool'),
        ({"metadata": {"user_id": 7}}, "", "metadata.user_id: Input should be a valid string, got"),
        ({"tool_choice": {"type": "sometimes"}}, "", "tool_choice: Input should be"),
        ({"tool_choice": {"type": "any"}}, "", "tool_choice: tool_choice any needs tools"),
        ({"tools": [_TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "", "tool_choice.name"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "", "thinking: extended thinking"),
        ({"thinking": {"type": "adaptive"}}, "", "thinking: extended thinking"),
        ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "", "mcp_servers"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "", "stop_sequences: 5 stop sequences, over the 4"),
        ({"stop_sequences": "END"}, "", "stop_sequences: Input should be a list"),
        ({"temperature": 1.5}, "", "temperature: Input should be between 0 and 1"),
        ({"top_p": "high"}, "", "top_p: Input should be a valid number"),
        ({"top_k": -1}, "", "top_k: Input should be greater than or equal to 0"),
        ({"top_k": 2**31}, "", "top_k: Input should be less than or equal to 2147483647"),
        ({"stream": "yes"}, "", "stream: Input should be a valid boolean"),
        ({"metadata": "u"}, "", "metadata: Input should be an object"),
        ({"output_config": {"format": {"type": "json_object"}}}, "", "output_config.format"),
        ({"frequency_penalty": 1}, "", "frequency_penalty: Extra inputs are not permitted"),
    ],
    ids=lambda value: str(value)[:48],
)
def test_bad_input_is_a_400_naming_the_field(fields: dict[str, Any], without: str, named: str) -> None:
    error = _refused(fields, without=without)
    assert error.message.startswith(named), error.message
    assert error.param == named.split(":", maxsplit=1)[0]


def test_the_largest_max_tokens_and_tool_name_pass() -> None:
    tools = [{**_TOOL, "name": "a-Z_9" + "x" * 123}]
    run = messages_request({**_BASE, "max_tokens": MAX_TOKENS, "tools": tools, "metadata": {"user_id": None}}, "r1")
    assert run.request.sampling.max_tokens == 2**31 - 1 and not run.request.metadata


def test_an_unknown_field_with_a_huge_name_is_not_echoed_whole() -> None:
    error = _refused({"x" * 100_000: 1})
    assert error.message == "x" * 61 + "...: Extra inputs are not permitted"


def test_bad_json_is_an_invalid_request_error() -> None:
    with pytest.raises(ApiError) as caught:
        parse_body(b'{"model": ')
    body = error_body(caught.value, "r9")
    assert error_status(caught.value) == 400 and body["error"]["type"] == "invalid_request_error"
    assert body["type"] == "error" and body["request_id"] == "r9"


@pytest.mark.parametrize(
    ("status", "expected_status", "kind"),
    [
        (400, 400, "invalid_request_error"),
        (401, 401, "authentication_error"),
        (403, 403, "permission_error"),
        (404, 404, "not_found_error"),
        (408, 408, "invalid_request_error"),
        (413, 413, "request_too_large"),
        (429, 429, "rate_limit_error"),  # the key's limits (code rate_limit_exceeded)
        (500, 500, "api_error"),
        (502, 502, "api_error"),
        (503, 529, "overloaded_error"),
        (504, 504, "timeout_error"),
    ],
)
def test_errors_in_anthropics_types_and_statuses(status: int, expected_status: int, kind: str) -> None:
    error = ApiError(status, "why")
    assert error_status(error) == expected_status
    assert error_body(error, "r1") == {"type": "error", "error": {"type": kind, "message": "why"}, "request_id": "r1"}


def test_the_edges_own_overload_is_overloaded_not_a_rate_limit() -> None:
    error = ApiError(429, "this edge is serving 1 requests, its limit", code="too_many_requests", retry_after=1.0)
    assert error_status(error) == 529 and error_body(error)["error"]["type"] == "overloaded_error"
    assert error.headers() == {"retry-after": "1"}
    full = ApiError(429, "the queue for 'm' is full (256 waiting)", code="queue_full", retry_after=1.0)
    assert error_status(full) == 529 and error_body(full)["error"]["type"] == "overloaded_error"
    limited = ApiError(429, "key over its rpm", code="rate_limit_exceeded", retry_after=1.0)
    assert error_status(limited) == 429 and error_body(limited)["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800"}]}',
            "messages.0.content: it holds a lone surrogate",
        ),
        (b'{"model": "m", "max_tokens": NaN}', "max_tokens: nan is not a JSON number"),
        (b'{"metadata": ' + b'{"a": ' * 40 + b"1" + b"}" * 41, "metadata.a.a."),
    ],
    ids=["surrogate", "nan", "deep"],
)
def test_errors_of_the_shared_body_checks_use_anthropics_paths(body: bytes, expected: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_body(body)
    message = error_body(caught.value)["error"]["message"]
    assert message.startswith(expected) and "[" not in message and "Invalid value" not in message, message


def _tool_call_deltas() -> list[pb.RunDelta]:
    head = pb.ToolCallDelta(index=0, id="call_1", function_name="get_weather", arguments="")
    return [
        pb.RunDelta(text="Let me "),
        pb.RunDelta(text="check."),
        pb.RunDelta(tool_calls=[head]),
        pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, arguments='{"city"')]),
        pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, arguments=': "Paris"}')]),
    ]


def _complete(reason: pb.FinishReason.ValueType) -> pb.RunComplete:
    return pb.RunComplete(finish_reason=reason, usage=pb.Usage(prompt_tokens=12, completion_tokens=5, cached_tokens=2))


def test_a_whole_message() -> None:
    outcome = Outcome()
    for delta in _tool_call_deltas():
        collect_delta(outcome, delta)
    body = message_body("r1", "m", outcome, _complete(pb.FINISH_REASON_TOOL_CALLS))
    message = Message.model_validate(body)
    assert message.id == "msg_r1" and message.stop_reason == "tool_use" and message.stop_sequence is None
    assert body["content"] == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert body["usage"] == {
        "input_tokens": 10,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 2,
    }


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (pb.FINISH_REASON_STOP, "end_turn"),
        (pb.FINISH_REASON_UNSPECIFIED, "end_turn"),
        (pb.FINISH_REASON_LENGTH, "max_tokens"),
        (pb.FINISH_REASON_TOOL_CALLS, "tool_use"),
        (pb.FINISH_REASON_CONTENT_FILTER, "refusal"),
    ],
)
def test_stop_reasons(reason: pb.FinishReason.ValueType, expected: str) -> None:
    assert message_body("r1", "m", Outcome(), _complete(reason))["stop_reason"] == expected


def test_a_tool_call_cut_short_has_an_empty_input() -> None:
    outcome = Outcome()
    for delta in _tool_call_deltas()[:4]:
        collect_delta(outcome, delta)
    assert message_body("r1", "m", outcome, _complete(pb.FINISH_REASON_LENGTH))["content"][1]["input"] == {}


def _parse(stream: bytes) -> list[dict[str, Any]]:
    events = []
    for chunk in stream.decode().split("\n\n")[:-1]:
        head, data = chunk.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        events.append(payload)
    return events


def test_stream_events_open_and_close_a_block_per_text_run_and_tool_call() -> None:
    chunks = MessageStream("r1", "m")
    raw = chunks.first() + b"".join(chunks.delta(delta) for delta in _tool_call_deltas())
    raw += chunks.last(_complete(pb.FINISH_REASON_TOOL_CALLS))
    events = _parse(raw)
    for event in events:
        if event["type"] != "ping":
            _EVENTS.validate_python(event)
    shown = [(event["type"], event.get("index")) for event in events]
    assert shown == [
        ("message_start", None),
        ("ping", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert events[0]["message"]["usage"]["input_tokens"] == 0  # known once the run ends: in message_delta
    assert events[6]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert "".join(event["delta"]["partial_json"] for event in events[7:9]) == '{"city": "Paris"}'
    assert events[10]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert (events[10]["usage"]["input_tokens"], events[10]["usage"]["output_tokens"]) == (10, 5)


def _interleaved() -> list[pb.RunDelta]:
    """Two tool calls whose fragments alternate (0, 1, 0, 1), after some text, as parallel calls may come."""
    first = pb.ToolCallDelta(index=0, id="call_a", function_name="get_weather", arguments='{"city"')
    second = pb.ToolCallDelta(index=1, id="call_b", function_name="get_time", arguments='{"zone"')
    return [
        pb.RunDelta(text="Checking."),
        pb.RunDelta(tool_calls=[first]),
        pb.RunDelta(tool_calls=[second]),
        pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, arguments=': "Paris"}')]),
        pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=1, arguments=': "UTC"}')]),
    ]


_BOTH = [
    {"type": "text", "text": "Checking."},
    {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}},
    {"type": "tool_use", "id": "call_b", "name": "get_time", "input": {"zone": "UTC"}},
]


def test_interleaved_tool_calls_stream_into_their_own_blocks() -> None:
    chunks = MessageStream("r1", "m")
    raw = chunks.first() + b"".join(chunks.delta(delta) for delta in _interleaved())
    events = _parse(raw + chunks.last(_complete(pb.FINISH_REASON_TOOL_CALLS)))
    shown = [(event["type"], event.get("index")) for event in events if event["type"] != "ping"]
    assert shown == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 1),
        ("content_block_delta", 2),
        ("content_block_stop", 1),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for event in events:
        if event["type"] != "ping":
            snapshot = accumulate_event(
                event=_EVENTS.validate_python(event), current_snapshot=snapshot, json_bufs=json_bufs
            )
    assert snapshot is not None and snapshot.stop_reason == "tool_use"
    assert [block.model_dump(exclude={"parsed_output"}, exclude_none=True) for block in snapshot.content] == _BOTH


def test_interleaved_tool_calls_in_a_whole_message() -> None:
    outcome = Outcome()
    for delta in _interleaved():
        collect_delta(outcome, delta)
    body = message_body("r1", "m", outcome, _complete(pb.FINISH_REASON_TOOL_CALLS))
    Message.model_validate(body)
    assert body["content"] == _BOTH


def test_text_after_a_tool_call_is_a_new_block_and_all_close_in_order() -> None:
    chunks = MessageStream("r1", "m")
    head = pb.ToolCallDelta(index=0, id="call_a", function_name="f", arguments="{}")
    raw = chunks.delta(pb.RunDelta(tool_calls=[head])) + chunks.delta(pb.RunDelta(text="done"))
    events = _parse(raw + chunks.last(_complete(pb.FINISH_REASON_STOP)))
    shown = [(event["type"], event.get("index")) for event in events]
    assert shown[:4] == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
    ]
    assert shown[4:6] == [("content_block_stop", 0), ("content_block_stop", 1)]


def test_an_error_after_the_start_is_an_error_event() -> None:
    chunks = MessageStream("r1", "m")
    events = _parse(chunks.first() + chunks.delta(pb.RunDelta(text="a")) + chunks.error(ApiError(503, "gone")))
    assert events[-1] == {"type": "error", "error": {"type": "overloaded_error", "message": "gone"}}


def test_tool_choice_without_tools_is_left_out_and_system_messages_are_kept() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    run = messages_request({**_BASE, "messages": messages, "tool_choice": {"type": "auto"}}, "r1").request
    assert not run.HasField("openai_fields")
    assert [message.role for message in run.messages] == [pb.ROLE_SYSTEM, pb.ROLE_USER]
