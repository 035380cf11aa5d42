"""The Responses API mapping: a CreateResponse body onto the chat run (the shape nodes see), the
Response object, the event stream, and every bad input's 400 naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from e2e.openai_schema import validate
from e2e.test_responses_api import EVENT_SCHEMAS
from google.protobuf.json_format import MessageToDict

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.openai import responses_api as shape
from iop_wire.openai import responses_output
from iop_wire.openai.errors import ApiError
from iop_wire.openai.responses import Outcome, collect_delta

TOOL = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}


def _run(history: list[dict[str, Any]] | None = None, **fields: Any) -> pb.RunRequest:
    parsed = shape.parse_create({"model": "m", **fields})
    return shape.run_request(parsed, "run-1", history or [])


def _messages(run: pb.RunRequest) -> list[dict[str, Any]]:
    return [MessageToDict(message) for message in run.messages]


def test_text_input_is_one_user_message_after_the_instructions() -> None:
    run = _run(input="hello", instructions="Be brief.", max_output_tokens=5, temperature=0.2, top_p=0.9)
    assert run.kind == pb.RUN_KIND_CHAT and run.model == "m" and run.run_id == "run-1"
    assert _messages(run) == [
        {"role": "ROLE_SYSTEM", "content": [{"text": "Be brief."}]},
        {"role": "ROLE_USER", "content": [{"text": "hello"}]},
    ]
    assert run.sampling.max_tokens == 5 and run.sampling.temperature == pytest.approx(0.2)
    assert run.sampling.top_p == pytest.approx(0.9)


def test_items_become_chat_messages_with_tool_calls_and_results() -> None:
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "lookup", "arguments": '{"x":1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png", "detail": "low"}]},
    ]
    messages = _messages(_run(input=items))
    assert [message["role"] for message in messages] == [
        "ROLE_DEVELOPER",
        "ROLE_USER",
        "ROLE_ASSISTANT",
        "ROLE_TOOL",
        "ROLE_USER",
    ]
    calls = messages[2]["toolCalls"]  # the assistant's text and both calls: one chat message
    assert [call["id"] for call in calls] == ["call_1", "call_2"] and calls[1]["function"]["arguments"] == '{"x":1}'
    assert messages[3] == {"role": "ROLE_TOOL", "toolCallId": "call_1", "content": [{"text": "one"}]}
    assert messages[4]["content"] == [{"imageUrl": {"url": "https://x/y.png", "detail": "low"}}]


def test_tools_tool_choice_and_text_format_go_in_chat_completions_shape() -> None:
    text = {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}}
    run = _run(input="x", tools=[TOOL], tool_choice={"type": "function", "name": "lookup"}, text=text)
    fields = MessageToDict(run.openai_fields)
    assert fields["tools"] == [{"type": "function", "function": {"name": "lookup", "parameters": TOOL["parameters"]}}]
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert fields["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }
    assert MessageToDict(_run(input="x", text={"format": {"type": "json_object"}}).openai_fields) == {
        "response_format": {"type": "json_object"}
    }
    assert not _run(input="x", text={"format": {"type": "text"}}).HasField("openai_fields")


def test_history_comes_before_the_input_and_instructions_first() -> None:
    parsed = shape.parse_create({"model": "m", "input": "second"})
    history = shape.conversation([], shape.parse_create({"model": "m", "input": "first"}), {"output": []})
    run = shape.run_request(parsed, "r", history)
    assert [message.content[0].text for message in run.messages] == ["first", "second"]


def test_input_items_are_stored_with_ids_and_statuses() -> None:
    parsed = shape.parse_create(
        {"model": "m", "input": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "yo"}]}
    )
    assistant, user = parsed.input_items
    assert assistant["id"].startswith("msg_") and assistant["status"] == "completed"
    assert assistant["content"] == [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]
    assert user["content"] == [{"type": "input_text", "text": "yo"}]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"model": None}, "model", "model"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "robot"),
        ({"input": [{"role": "user"}]}, "input[0].content", "Missing"),
        ({"input": 5}, "input", "string or an array"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "reasoning"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "previous_response_id"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
            "input_file",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].image_url",
            "URL",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "Missing"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output", "string"),
        ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type", "web_search_preview"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type", "file_search"),
        ({"tools": [{"type": "function"}]}, "tools[0].name", "Missing"),
        ({"tools": "x"}, "tools", "array"),
        ({"tools": [{**TOOL, "name": "a b"}]}, "tools[0].name", "should be 1 to 64 letters"),
        ({"tools": [{**TOOL, "name": "x" * 65}]}, "tools[0].name", "should be 1 to 64 letters"),
        ({"tools": [TOOL, {**TOOL, "name": "f"}, TOOL]}, "tools[2].name", "earlier tool's name"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice", "nope"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "xml"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "Missing"),
        ({"background": True}, "background", "background"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort", "huge"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"truncation": "auto"}, "truncation", "auto"),
        ({"include": ["message.output_text.logprobs"]}, "include", "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs", "top_logprobs"),
        ({"max_output_tokens": 0}, "max_output_tokens", "minimum"),
        ({"max_output_tokens": "9"}, "max_output_tokens", "integer"),
        ({"temperature": 2.5}, "temperature", "maximum"),
        ({"top_p": -1}, "top_p", "minimum"),
        ({"store": "yes"}, "store", "boolean"),
        ({"stream": 1}, "stream", "boolean"),
        ({"instructions": 3}, "instructions", "string"),
        ({"previous_response_id": 3}, "previous_response_id", "string"),
        ({"metadata": {"k": 1}}, "metadata", "strings"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "16"),
        ({"max_output_tokens": 10**26}, "max_output_tokens", str(10**26)),
        ({"text": {"verbosity": "chatty"}}, "text.verbosity", "chatty"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}}},
            "text.format.strict",
            "boolean",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text.format.name", "a b"),
        ({"text": {"format": {"type": "json_schema", "name": "x" * 65, "schema": {}}}}, "text.format.name", "64"),
        ({"tools": [{**TOOL, "description": 7}]}, "tools[0].description", "string"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u", "detail": "max"}]}]},
            "input[0].content[0].detail",
            "max",
        ),
        ({"user": 5}, "user", "string"),
        (
            {
                "input": [
                    {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "id": "fc_1", "call_id": "c", "output": "x"},
                ]
            },
            "input[1].id",
            "fc_1",
        ),
        ({"seed": 1}, None, "seed"),
        ({"messages": []}, None, "messages"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(fields: dict[str, Any], param: str | None, words: str) -> None:
    with pytest.raises(ApiError) as caught:
        shape.parse_create({"model": "m", "input": "x", **fields})
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message
    assert caught.value.type == "invalid_request_error"
    assert "sampling" not in caught.value.message  # the client's terms, not the wire's


def test_the_checked_echoed_values_are_kept() -> None:
    text = {"format": {"type": "json_schema", "name": "Out_1-x", "schema": {}, "strict": False}, "verbosity": "low"}
    parsed = shape.parse_create(
        {"model": "m", "input": "x", "text": text, "user": "u1", "max_output_tokens": 2**31 - 1}
    )
    assert parsed.echo["text"] == text and parsed.user == "u1" and parsed.sampling.max_tokens == 2**31 - 1


def test_an_empty_input_without_history_is_a_400() -> None:
    with pytest.raises(ApiError) as caught:
        _run(input=[])
    assert caught.value.param == "input"


def test_platform_only_fields_are_accepted() -> None:
    fields = {"service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "u", "max_tool_calls": 3}
    parsed = shape.parse_create({"model": "m", "input": "x", "include": ["reasoning.encrypted_content"], **fields})
    assert parsed.openai_fields == {}


def _complete(reason: pb.FinishReason.ValueType = pb.FINISH_REASON_STOP) -> pb.RunComplete:
    return pb.RunComplete(finish_reason=reason, usage=pb.Usage(prompt_tokens=4, completion_tokens=2, cached_tokens=1))


def test_the_response_object_holds_text_calls_usage_and_the_echoed_fields() -> None:
    parsed = shape.parse_create({"model": "m", "input": "x", "tools": [TOOL], "metadata": {"a": "b"}})
    outcome = Outcome()
    collect_delta(outcome, pb.RunDelta(text="hi "))
    collect_delta(outcome, pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, id="call_9", function_name="lookup")]))
    collect_delta(outcome, pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, arguments="{}")]))
    body = responses_output.response_body(responses_output.skeleton("resp_1", "m", parsed), outcome, _complete())
    assert body["status"] == "completed" and body["completed_at"] and body["metadata"] == {"a": "b"}
    message, call = body["output"]
    assert message["content"][0]["text"] == "hi " and call["call_id"] == "call_9" and call["arguments"] == "{}"
    assert body["usage"] == {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 1, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 6,
    }
    assert body["tools"][0]["name"] == "lookup" and "output_text" not in body
    cut = responses_output.response_body(
        responses_output.skeleton("resp_2", "m", parsed), Outcome(text=["a"]), _complete(pb.FINISH_REASON_LENGTH)
    )
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete"


def _decoded(raw: bytes) -> list[dict[str, Any]]:
    events = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        events.append(event)
    return events


def test_the_event_stream_opens_and_closes_items_in_order() -> None:
    parsed = shape.parse_create({"model": "m", "input": "x"})
    stored: list[dict[str, Any]] = []
    events = responses_output.ResponseEvents(responses_output.skeleton("resp_1", "m", parsed), stored.append)
    raw = events.first() + events.delta(pb.RunDelta(text="a"))
    raw += events.delta(pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, id="call_1", function_name="f")]))
    raw += events.delta(pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, arguments='{"k"')]))
    raw += events.delta(pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, arguments=":1}")]))
    raw += events.last(_complete(pb.FINISH_REASON_TOOL_CALLS))
    decoded = _decoded(raw)
    assert [event["type"].removeprefix("response.") for event in decoded] == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    assert [event["sequence_number"] for event in decoded] == list(range(len(decoded)))
    assert decoded[8]["item"]["arguments"] == "" and decoded[11]["arguments"] == '{"k":1}'
    assert decoded[8]["output_index"] == 1 and decoded[-1]["response"]["output"][1]["status"] == "completed"
    assert stored == [decoded[-1]["response"]]


def test_interleaved_tool_calls_stay_open_to_the_end_every_event_valid() -> None:
    """Fragments of two calls interleaved (0, 1, 0, 1): no arguments delta after its item's done; the
    calls' done events come at the end in output order; every event valid against OpenAI's schema."""
    parsed = shape.parse_create({"model": "m", "input": "x"})
    events = responses_output.ResponseEvents(responses_output.skeleton("resp_1", "m", parsed))
    raw = events.first()
    for index, call_id in ((0, "call_a"), (1, "call_b")):
        raw += events.delta(pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=index, id=call_id, function_name="f")]))
    for piece in ('{"a"', '{"b"', ":1}", ":2}"):
        index = 0 if piece in ('{"a"', ":1}") else 1
        raw += events.delta(pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=index, arguments=piece)]))
    raw += events.last(_complete(pb.FINISH_REASON_TOOL_CALLS))
    decoded = _decoded(raw)
    for event in decoded:
        validate(EVENT_SCHEMAS[event["type"]], event)
    done_at = {}
    for position, event in enumerate(decoded):
        if event["type"] == "response.output_item.done":
            done_at[event["item"]["id"]] = position
        elif event["type"] == "response.function_call_arguments.delta":
            assert event["item_id"] not in done_at, "a delta after its item's done"
    finished = [event for event in decoded if event["type"] == "response.function_call_arguments.done"]
    assert [(event["output_index"], event["arguments"]) for event in finished] == [(0, '{"a":1}'), (1, '{"b":2}')]
    assert [item["status"] for item in decoded[-1]["response"]["output"]] == ["completed", "completed"]
    assert decoded[-1]["type"] == "response.completed" and decoded[-2]["type"] == "response.output_item.done"


def test_a_stream_the_client_left_is_stored_cancelled_with_its_output() -> None:
    parsed = shape.parse_create({"model": "m", "input": "x"})
    stored: list[dict[str, Any]] = []
    events = responses_output.ResponseEvents(responses_output.skeleton("resp_1", "m", parsed), stored.append)
    events.first()
    events.delta(pb.RunDelta(text="so far"))
    events.cancelled()
    events.cancelled()  # once only
    [body] = stored
    assert body["status"] == "cancelled" and body["output"][0]["content"][0]["text"] == "so far"
    validate("Response", body)


def test_a_failure_mid_stream_is_response_failed() -> None:
    parsed = shape.parse_create({"model": "m", "input": "x"})
    stored: list[dict[str, Any]] = []
    events = responses_output.ResponseEvents(responses_output.skeleton("resp_1", "m", parsed), stored.append)
    events.first()
    events.delta(pb.RunDelta(text="partial"))
    [failed] = _decoded(events.error(ApiError(502, "the node was lost")))
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "the node was lost"}
    assert failed["response"]["output"][0]["content"][0]["text"] == "partial" and stored[0]["status"] == "failed"


def test_a_client_leaving_during_the_final_write_does_not_store_the_response_again() -> None:
    """last() (or error()) made the final Response: a cancelled() after it stores nothing more."""
    parsed = shape.parse_create({"model": "m", "input": "x"})
    for end in ("last", "error"):
        stored: list[dict[str, Any]] = []
        events = responses_output.ResponseEvents(responses_output.skeleton("resp_1", "m", parsed), stored.append)
        events.first()
        events.delta(pb.RunDelta(text="all"))
        if end == "last":
            events.last(_complete())
        else:
            events.error(ApiError(502, "lost"))
        events.cancelled()
        assert [body["status"] for body in stored] == ["completed" if end == "last" else "failed"]


def test_a_function_call_cut_by_the_token_limit_is_incomplete() -> None:
    parsed = shape.parse_create({"model": "m", "input": "x", "tools": [TOOL]})
    start = pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, id="call_1", function_name="lookup")])
    cut = pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, arguments='{"q": "ab')])
    outcome = Outcome()
    collect_delta(outcome, start)
    collect_delta(outcome, cut)
    complete = _complete(pb.FINISH_REASON_LENGTH)
    body = responses_output.response_body(responses_output.skeleton("resp_1", "m", parsed), outcome, complete)
    assert body["status"] == "incomplete" and body["output"][-1]["status"] == "incomplete"
    events = responses_output.ResponseEvents(responses_output.skeleton("resp_2", "m", parsed))
    events.first()
    events.delta(start)
    events.delta(cut)
    [*_, done, last] = _decoded(events.last(complete))
    assert done["type"] == "response.output_item.done" and done["item"]["status"] == "incomplete"
    assert last["type"] == "response.incomplete" and last["response"]["output"][-1]["status"] == "incomplete"
    assert last["response"]["output"][-1]["arguments"] == '{"q": "ab'
    validate("Response", last["response"])
    done = responses_output.response_body(responses_output.skeleton("resp_3", "m", parsed), outcome, _complete())
    assert done["output"][-1]["status"] == "completed"


def test_many_small_deltas_are_joined_once() -> None:
    """Text and arguments kept as pieces: 100k one-character deltas take well under a second (a ``+=``
    per delta copied the whole text each time), and the result is the same."""
    parsed = shape.parse_create({"model": "m", "input": "x"})
    events = responses_output.ResponseEvents(responses_output.skeleton("resp_1", "m", parsed))
    outcome = Outcome()
    events.first()
    events.delta(pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, id="call_1", function_name="f")]))
    collect_delta(outcome, pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, id="call_1", function_name="f")]))
    for _ in range(100_000):
        delta = pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, arguments="x")])
        events.delta(delta)
        collect_delta(outcome, delta)
    [*_, last] = _decoded(events.last(_complete(pb.FINISH_REASON_TOOL_CALLS)))
    assert last["response"]["output"][0]["arguments"] == "x" * 100_000
    assert outcome.calls()[0]["function"]["arguments"] == "x" * 100_000


def test_tool_choice_auto_or_none_without_tools_is_not_sent() -> None:
    """OpenAI takes tool_choice without tools; vLLM refuses it: auto and none, which no tools mean anyway,
    are left out of the run (and still echoed)."""
    for choice in ("auto", "none"):
        parsed = shape.parse_create({"model": "m", "input": "x", "tool_choice": choice})
        assert "tool_choice" not in parsed.openai_fields and parsed.echo["tool_choice"] == choice
    with_tools = shape.parse_create({"model": "m", "input": "x", "tools": [TOOL], "tool_choice": "none"})
    assert with_tools.openai_fields["tool_choice"] == "none"


def test_echoed_values_in_400s_are_cut_and_top_logprobs_has_a_code() -> None:
    long = "x" * 10_000
    for fields in (
        {"include": [long]},
        {"input": [{"type": "function_call_output", "id": long, "call_id": "c", "output": "x"}] * 2},
    ):
        with pytest.raises(ApiError) as caught:
            shape.parse_create({"model": "m", "input": "x", **fields})
        assert caught.value.status == 400 and "x" * 61 + "..." in caught.value.message
        assert len(caught.value.message) < 200
    with pytest.raises(ApiError) as caught:
        shape.parse_create({"model": "m", "input": "x", "top_logprobs": 2})
    assert caught.value.code == "unsupported_parameter" and caught.value.param == "top_logprobs"
