"""OpenAI's Responses API on the real platform with the official ``openai`` SDK: text, streams (every
event validated against OpenAI's schema, in order), function tools, ``previous_response_id``,
retrieve, delete, input_items, another key's ids, and each error with its status and shape."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest
import yaml

from iop_edge.keys import revoke_key
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.openai import responses_api as shape
from iop_wire.openai import responses_output
from iop_wire.openai.errors import ApiError

from .conftest import Stack, _spawn, wait_for
from .openai_schema import validate

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.failed": "ResponseFailedEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
}
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 8,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def _ready_key(stack: Stack, name: str) -> str:
    secret = stack.new_key(name)
    with stack.http(secret) as http:
        wait_for(lambda: http.get("/models").status_code == 200, 5, 0.05, f"key {name} loaded by the edge")
    return secret


def _created(client: openai.OpenAI, **fields: Any) -> dict[str, Any]:
    """A non-streamed create's body as sent, validated as a Response."""
    raw = client.responses.with_raw_response.create(**fields)
    body: dict[str, Any] = raw.http_response.json()
    validate("Response", body)
    return body


def _events(stack: Stack, body: dict[str, Any], key: str | None = None) -> list[dict[str, Any]]:
    """A streamed create's events read as raw SSE: each ``event:`` name matches its ``data``, each a
    valid member of ResponseStreamEvent, sequence numbers counting from 0."""
    with stack.http(key) as http, http.stream("POST", "/responses", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        blocks = response.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        validate(EVENT_SCHEMAS[event["type"]], event)
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def test_text_in_text_out_and_retrieved_as_it_was_sent(stack: Stack) -> None:
    client = stack.client()
    raw = client.responses.with_raw_response.create(
        model="mock-small", input="tell me a story", instructions="Be brief.", temperature=0.5
    )
    body = raw.http_response.json()
    validate("Response", body)
    # One run underneath, as a chat completion's: the node recorded it, for the key, done.
    record = wait_for(lambda: stack.run("node-a", raw.headers["x-request-id"]), 5, 0.05, "the node's record")
    assert record["caller"] == "e2e" and record["status"] == "completed", record
    assert body["status"] == "completed" and body["id"].startswith("resp_") and "output_text" not in body
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert len(message["content"][0]["text"].split()) == 8 and message["content"][0]["annotations"] == []
    usage = body["usage"]
    assert usage["output_tokens"] == 8 and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert body["instructions"] == "Be brief." and body["temperature"] == 0.5 and body["store"] is True
    parsed = client.responses.retrieve(body["id"])
    assert parsed.output_text == message["content"][0]["text"]
    retrieved = client.responses.with_raw_response.retrieve(body["id"]).http_response.json()
    validate("Response", retrieved)
    assert retrieved == body


def test_a_stream_sends_the_event_sequence_and_is_stored(stack: Stack) -> None:
    events = _events(stack, {"model": "mock-small", "input": "stream to me"})
    assert [event["type"] for event in events] == TEXT_EVENTS
    text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert events[-4]["text"] == text and len(text.split()) == 8
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == text
    assert done["usage"]["output_tokens"] == 8
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    stored = wait_for(lambda: _retrieved(stack, done["id"]), 5, 0.05, "the streamed response stored")
    assert stored == done


def _retrieved(stack: Stack, response_id: str) -> dict[str, Any] | None:
    with stack.http() as http:
        response = http.get(f"/responses/{response_id}")
    return response.json() if response.status_code == 200 else None


def test_the_sdk_reads_the_stream(stack: Stack) -> None:
    client = stack.client()
    with client.responses.stream(model="mock-small", input="hello") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds == TEXT_EVENTS
    assert final.status == "completed" and len(final.output_text.split()) == 8


def test_a_function_tool_is_called_then_its_output_answered(stack: Stack) -> None:
    client = stack.client()
    body = _created(client, model="mock-small", input="weather in Paris?", tools=[WEATHER])
    [call] = body["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert isinstance(json.loads(call["arguments"])["city"], str)
    assert body["tools"][0]["name"] == "get_weather" and body["tool_choice"] == "auto"
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": '{"sky": "clear"}'}
    answer = _created(client, model="mock-small", previous_response_id=body["id"], input=[result], tools=[WEATHER])
    [message] = answer["output"]
    assert message["type"] == "message" and message["content"][0]["text"]
    assert answer["previous_response_id"] == body["id"]
    assert client.responses.retrieve(answer["id"]).output_text == message["content"][0]["text"]
    with stack.http() as http:
        listed = http.get(f"/responses/{answer['id']}/input_items").json()
    validate("ResponseItemList", listed)
    assert [(item["type"], item["call_id"]) for item in listed["data"]] == [("function_call_output", call["call_id"])]


def test_echoed_fields_are_valid_in_the_response(stack: Stack) -> None:
    body = _created(
        stack.client(),
        model="mock-small",
        input="hi",
        reasoning={"effort": "low"},
        metadata={"ticket": "42"},
        tool_choice="none",
        tools=[WEATHER],
        text={"format": {"type": "json_object"}, "verbosity": "low"},
        service_tier="auto",
        user="someone",
    )
    assert body["reasoning"]["effort"] == "low" and body["metadata"] == {"ticket": "42"}
    assert body["tool_choice"] == "none" and body["output"][0]["type"] == "message"  # none: no call
    assert isinstance(json.loads(body["output"][0]["content"][0]["text"]), dict)


def test_a_failure_mid_stream_is_a_valid_response_failed_event() -> None:
    """A run cannot be made to fail mid-stream on the mock: the event is built as the stream would build it."""
    parsed = shape.parse_create({"model": "m", "input": "x"})
    events = responses_output.ResponseEvents(responses_output.skeleton("resp_1", "m", parsed))
    events.first()
    events.delta(pb.RunDelta(text="partial"))
    block = events.error(ApiError(502, "the node was lost")).decode()
    event = json.loads(block.split("\n")[1].removeprefix("data: "))
    validate("ResponseFailedEvent", event)
    assert event["response"]["error"] == {"code": "server_error", "message": "the node was lost"}


def test_a_streamed_tool_call_sends_the_argument_events(stack: Stack) -> None:
    events = _events(stack, {"model": "mock-small", "input": "weather?", "tools": [WEATHER], "tool_choice": "required"})
    kinds = [event["type"] for event in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    arguments = "".join(event["delta"] for event in events if event["type"].endswith("arguments.delta"))
    assert events[-3]["arguments"] == arguments and json.loads(arguments)
    assert events[2]["item"]["status"] == "in_progress" and events[-2]["item"]["status"] == "completed"
    assert events[-1]["response"]["output"][0]["arguments"] == arguments


def test_previous_response_id_continues_the_conversation(stack: Stack) -> None:
    client = stack.client()
    first = client.responses.create(model="mock-small", input="one two three", instructions="Answer in French.")
    alone = client.responses.create(model="mock-small", input="four")
    after = client.responses.create(model="mock-small", input="four", previous_response_id=first.id)
    assert first.usage is not None and alone.usage is not None and after.usage is not None
    # The run saw the first turn (its input and answer) but not its instructions, as OpenAI does.
    instructions = 3  # "Answer in French."
    assert after.usage.input_tokens == alone.usage.input_tokens + first.usage.input_tokens - instructions + 8
    assert after.instructions is None and after.previous_response_id == first.id
    third = client.responses.create(model="mock-small", input="five", previous_response_id=after.id)
    assert third.usage is not None and third.usage.input_tokens > after.usage.input_tokens


def test_input_items_are_listed_and_paged(stack: Stack) -> None:
    client = stack.client()
    conversation = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]
    body = _created(client, model="mock-small", input=conversation)
    with stack.http() as http:
        listed = http.get(f"/responses/{body['id']}/input_items").json()
        validate("ResponseItemList", listed)
        assert [item["role"] for item in listed["data"]] == ["user", "assistant", "user", "system"]  # desc
        assert listed["has_more"] is False and listed["first_id"] == listed["data"][0]["id"]
        page = http.get(f"/responses/{body['id']}/input_items", params={"order": "asc", "limit": 2}).json()
        validate("ResponseItemList", page)
        assert [item["role"] for item in page["data"]] == ["system", "user"] and page["has_more"] is True
        rest = http.get(
            f"/responses/{body['id']}/input_items", params={"order": "asc", "after": page["last_id"]}
        ).json()
        assert [item["role"] for item in rest["data"]] == ["assistant", "user"] and rest["has_more"] is False
        bad = http.get(f"/responses/{body['id']}/input_items", params={"limit": 101})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    sdk = client.responses.input_items.list(body["id"], order="asc")
    assert [item.type for item in sdk.data] == ["message"] * 4


def test_delete_then_retrieve_is_a_404(stack: Stack) -> None:
    client = stack.client()
    response = client.responses.create(model="mock-small", input="short-lived")
    with stack.http() as http:
        for path in (f"/responses/{response.id}", f"/responses/{response.id}/input_items", "/responses/resp_none"):
            read = http.get(path)
            assert len(read.headers["x-request-id"]) == 24, (path, read.headers)  # as every route's answers
        deleted = http.delete(f"/responses/{response.id}")
        assert len(deleted.headers["x-request-id"]) == 24
        assert deleted.status_code == 200 and deleted.json() == {
            "id": response.id,
            "object": "response",
            "deleted": True,
        }
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(response.id)
    validate("ErrorResponse", caught.value.response.json())
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_store_false_keeps_nothing(stack: Stack) -> None:
    client = stack.client()
    raw = client.responses.with_raw_response.create(model="mock-small", input="forget me", store=False)
    response = raw.parse()
    assert raw.http_response.json()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="mock-small", input="and then?", previous_response_id=response.id)
    assert caught.value.code == "previous_response_not_found"


def test_another_keys_response_is_not_found(stack: Stack) -> None:
    mine = stack.client().responses.create(model="mock-small", input="mine alone")
    other = stack.client(_ready_key(stack, "responses-other"))
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(mine.id)
    with pytest.raises(openai.BadRequestError) as caught:
        other.responses.create(model="mock-small", input="continue", previous_response_id=mine.id)
    body = caught.value.response.json()
    validate("ErrorResponse", body)
    assert body["error"]["param"] == "previous_response_id" and body["error"]["code"] == "previous_response_not_found"
    assert stack.client().responses.retrieve(mine.id).id == mine.id  # still there for its owner


def test_max_output_tokens_makes_an_incomplete_response(stack: Stack) -> None:
    body = _created(stack.client(), model="mock-slow", input="go on", max_output_tokens=3)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 3 and body["max_output_tokens"] == 3
    events = _events(stack, {"model": "mock-slow", "input": "go on", "max_output_tokens": 2})
    assert events[-1]["type"] == "response.incomplete"


def test_a_json_schema_text_format_gives_json(stack: Stack) -> None:
    text = {
        "format": {
            "type": "json_schema",
            "name": "city",
            "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        }
    }
    body = _created(stack.client(), model="mock-small", input="a city", text=text)
    assert isinstance(json.loads(body["output"][0]["content"][0]["text"])["name"], str)
    assert body["text"]["format"]["name"] == "city"


@pytest.mark.parametrize(
    ("fields", "status", "param", "code"),
    [
        ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role", "invalid_value"),
        ({"model": "no-such-model"}, 404, None, "model_not_found"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type", "unsupported_parameter"),
        ({"background": True}, 400, "background", "unsupported_parameter"),
        ({"conversation": "conv_123"}, 400, "conversation", "unsupported_parameter"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type", "unsupported_parameter"),
        ({"max_output_tokens": 0}, 400, "max_output_tokens", "integer_below_min_value"),
        ({"temperature": 3}, 400, "temperature", "decimal_above_max_value"),
        ({"truncation": "auto"}, 400, "truncation", "unsupported_parameter"),
        ({"unknown_field": 1}, 400, None, None),
        ({"max_output_tokens": 10**26}, 400, "max_output_tokens", "integer_above_max_value"),
        ({"text": {"verbosity": "loud"}}, 400, "text.verbosity", "invalid_value"),
        ({"user": 5}, 400, "user", "invalid_type"),
    ],
    ids=["bad-role", "unknown-model", "hosted-tool", "background", "conversation", "item-reference",
         "max-output-tokens", "temperature", "truncation", "unknown-field", "huge-max-output-tokens",
         "verbosity", "user"],
)  # fmt: skip
def test_errors(stack: Stack, fields: dict[str, Any], status: int, param: str | None, code: str | None) -> None:
    with stack.http() as http:
        response = http.post("/responses", json={"model": "mock-small", "input": "hi", **fields})
    body = response.json()
    assert response.status_code == status, body
    validate("ErrorResponse", body)
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == code and (param is None or body["error"]["param"] == param), body
    if fields.get("model") == "no-such-model":
        assert "no-such-model" in body["error"]["message"]


def test_a_huge_max_tokens_names_the_clients_field_in_chat_too(stack: Stack) -> None:
    """Over the wire's int32: the client's field and value, not the node's terms (was: "sampling.max_tokens
    must be between 1 and 131072, got 2147483647", param max_tokens)."""
    messages = [{"role": "user", "content": "hi"}]
    with stack.http() as http:
        for field in ("max_tokens", "max_completion_tokens"):
            response = http.post("/chat/completions", json={"model": "mock-small", "messages": messages, field: 10**26})
            body = response.json()
            assert response.status_code == 400 and body["error"]["param"] == field, body
            assert str(10**26) in body["error"]["message"] and "sampling" not in body["error"]["message"]
            validate("ErrorResponse", body)


@pytest.mark.parametrize("limit", ["\u00b2", "0", "-1", "x", "101", "9" * 5000, "1.0", " 5"])
def test_a_bad_input_items_limit_is_a_400(stack: Stack, limit: str) -> None:
    """ "²" passes str.isdigit and fails int(): it was a plain-text 500, as 5,000 digits were."""
    stored = stack.client().responses.create(model="mock-small", input="page me")
    with stack.http() as http:
        response = http.get(f"/responses/{stored.id}/input_items", params={"limit": limit})
        assert response.status_code == 400, response.text
        body = response.json()
        validate("ErrorResponse", body)
        assert body["error"]["param"] == "limit" and body["error"]["code"] == "invalid_value"
        unknown = http.get(f"/responses/{stored.id}/input_items", params={"after": "msg_nope"})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "after"
        validate("ErrorResponse", unknown.json())
    with stack.http("sk-iop-not-a-key") as stranger:  # the key is checked before anything else
        assert stranger.get(f"/responses/{stored.id}/input_items", params={"limit": limit}).status_code == 401


def test_duplicate_input_item_ids_are_refused(stack: Stack) -> None:
    call = {"type": "function_call", "id": "fc_same", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    output = {"type": "function_call_output", "id": "fc_same", "call_id": "c1", "output": "sunny"}
    with pytest.raises(openai.BadRequestError) as caught:
        stack.client().responses.create(model="mock-small", input=[call, output])  # type: ignore[list-item]
    assert caught.value.param == "input[1].id" and "fc_same" in caught.value.message


def test_reading_stored_responses_counts_against_the_keys_rpm(stack: Stack) -> None:
    """A GET costs the edge's loop as a create does: it takes one of the key's requests per minute."""
    secret = _ready_key(stack, "responses-reader")
    client = stack.client(stack.new_key("responses-rpm", rpm=3))
    wait_for(lambda: _status(stack, client.api_key, "/models") == 200, 5, 0.05, "the rpm key loaded")
    stored = client.responses.create(model="mock-small", input="read me")  # 1 of 3 (/models is not counted)
    assert client.responses.retrieve(stored.id).id == stored.id
    assert client.responses.input_items.list(stored.id).data  # 3 of 3
    with pytest.raises(openai.RateLimitError) as caught:
        client.responses.delete(stored.id)
    validate("ErrorResponse", caught.value.response.json())
    assert caught.value.response.headers.get("retry-after")
    with pytest.raises(openai.NotFoundError):  # another key is not held back by this one's limit
        stack.client(secret).responses.retrieve(stored.id)


def _status(stack: Stack, key: str, path: str) -> int:
    with stack.http(key) as http:
        return http.get(path).status_code


def test_errors_through_the_sdk(stack: Stack) -> None:
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="mock-small", input="hi", tools=[{"type": "web_search"}])
    assert caught.value.param == "tools[0].type" and "web_search" in caught.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="no-such-model", input="hi")
    assert missing.value.code == "model_not_found"


def test_a_revoked_key_is_refused(stack: Stack) -> None:
    secret = _ready_key(stack, "responses-revoked")
    client = stack.client(secret)
    kept = client.responses.create(model="mock-small", input="before")
    assert revoke_key(stack.keys_path, "responses-revoked")
    with stack.http(secret) as http:
        wait_for(
            lambda: http.post("/responses", json={"model": "mock-small", "input": "hi"}).status_code == 401, 5, 0.1
        )
    with pytest.raises(openai.AuthenticationError) as caught:
        client.responses.retrieve(kept.id)
    validate("ErrorResponse", caught.value.response.json())


def test_a_client_leaving_a_stream_cancels_the_run(stack: Stack) -> None:
    secret = _ready_key(stack, "responses-leaves")
    body = {"model": "mock-slow", "input": "go", "stream": True}
    with stack.http(secret) as http, http.stream("POST", "/responses", json=body) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        first_lines = []
        for line in response.iter_lines():
            first_lines.append(line)
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.output_text.delta":
                break
        gone = time.time()
    record = wait_for(
        lambda: (r := stack.run("node-a", request_id)) is not None and r["status"] != "running" and r,
        5,
        0.1,
        "the node's record of the run to end",
    )
    assert record["status"] == "cancelled", record
    assert time.time() - gone < 5
    response_id = next(json.loads(line[6:])["response"]["id"] for line in first_lines if line.startswith("data: "))
    stored = wait_for(
        lambda: (
            _status(stack, secret, f"/responses/{response_id}") == 200
            and stack.client(secret).responses.retrieve(response_id)
        ),
        5,
        0.05,
        "the cancelled response stored",
    )
    assert stored.status == "cancelled" and stored.output  # the text streamed before the client left
    with stack.http(secret) as http:
        validate("Response", http.get(f"/responses/{response_id}").json())
        continued = http.post(
            "/responses", json={"model": "mock-small", "input": "and?", "previous_response_id": response_id}
        )
    assert continued.status_code == 400, continued.text  # its output may be cut mid-item: not replayed
    error = continued.json()["error"]
    assert error["param"] == "previous_response_id" and "status is cancelled" in error["message"]
    validate("ErrorResponse", continued.json())


def test_without_keys_responses_are_anonymous_and_kept_in_the_same_store(stack: Stack) -> None:
    """An edge with ``auth: none`` opens the store itself (the same key file here): its responses
    belong to ``anonymous``, which no key is."""
    config = yaml.safe_load((stack.root / "edge.yaml").read_text())
    config["http"]["port"] = 0
    config["auth"] = "none"
    (stack.root / "edge-open.yaml").write_text(yaml.safe_dump(config))
    edge = _spawn(stack.root, "edge-open", "edge", stack.root / "edge-open.yaml")
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{edge.wait_ready()['port']}/v1", api_key="unused", max_retries=0
        )
        first = client.responses.create(model="mock-small", input="one two")
        after = client.responses.create(model="mock-small", input="three", previous_response_id=first.id)
        assert after.previous_response_id == first.id and client.responses.retrieve(after.id).id == after.id
        client.close()
    finally:
        edge.stop()
    with pytest.raises(openai.NotFoundError):
        stack.client().responses.retrieve(first.id)
