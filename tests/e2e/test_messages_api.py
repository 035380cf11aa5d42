"""The official ``anthropic`` SDK against the edge's Messages API (``/v1/messages``), mock models: text,
streams, tools, count_tokens and errors, each body checked with the SDK's own types."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx2 as httpx
import pytest
from anthropic.types import Message, MessageParam, MessageTokensCount, RawMessageStreamEvent, ToolParam
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]  # no stubs installed
from pydantic import TypeAdapter

from iop_edge.keys import revoke_key

from .conftest import Stack, running_stack, wait_for

HELLO: list[MessageParam] = [{"role": "user", "content": "hello there"}]
WEATHER: ToolParam = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
    },
}
TIME: ToolParam = {
    "name": "get_time",
    "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}
EVENTS: TypeAdapter[RawMessageStreamEvent] = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture
def client(stack: Stack) -> Iterator[anthropic.Anthropic]:
    """The SDK pointed at the edge's root (it posts to /v1/messages), with the stack's key, no retries."""
    with anthropic.Anthropic(base_url=_root(stack), api_key=stack.key, max_retries=0, timeout=30.0) as sdk:
        yield sdk


def _root(stack: Stack) -> str:
    return stack.base_url.removesuffix("/v1")


def _raw_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of an Anthropic stream; each data's ``type`` is its event's name."""
    lines = [line for line in response.iter_lines() if line]
    pairs = list(zip(lines[::2], lines[1::2], strict=True))
    parsed = []
    for head, data in pairs:
        assert head.startswith("event: ") and data.startswith("data: "), (head, data)
        name, payload = head.removeprefix("event: "), json.loads(data.removeprefix("data: "))
        assert payload["type"] == name
        parsed.append((name, payload))
    return parsed


def _blocks(message: Message) -> list[dict[str, Any]]:
    """The content blocks as JSON (the stream helper's blocks add a ``parsed_output``: left out)."""
    return [block.model_dump(exclude={"parsed_output"}) for block in message.content]


# -- text ---------------------------------------------------------------------------------------


def test_create_text_and_its_usage(stack: Stack, client: anthropic.Anthropic) -> None:
    raw = client.messages.with_raw_response.create(
        model="mock-small",
        max_tokens=100,
        system="be brief",
        messages=HELLO,
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40},  # SDK 2.x dropped them; older ones send them
    )
    message = Message.model_validate(raw.http_response.json())
    assert raw.request_id == raw.headers["x-request-id"] and message.id == f"msg_{raw.request_id}"
    assert (message.type, message.role, message.model) == ("message", "assistant", "mock-small")
    assert len(message.content) == 1 and message.content[0].type == "text"
    assert len(message.content[0].text.split()) == 8
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    # the mock counts a word a token of "system: be brief\nuser: hello there": the chat completion says the same
    chat = stack.client().chat.completions.create(
        model="mock-small",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 6
    assert (message.usage.input_tokens, message.usage.output_tokens) == (6, 8)
    assert (message.usage.cache_read_input_tokens, message.usage.cache_creation_input_tokens) == (0, 0)


def test_max_tokens_cuts_with_max_tokens(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="mock-small", max_tokens=3, messages=HELLO, stop_sequences=["zzz"])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    assert len(message.content[0].text.split()) == 3  # type: ignore[union-attr]


def test_stream_events_in_order_and_the_same_message(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="mock-small", max_tokens=100, messages=HELLO)
    with client.messages.create(model="mock-small", max_tokens=100, messages=HELLO, stream=True) as stream:
        received = list(stream)
    kinds = [event.type for event in received]
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 8,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = received[0]
    assert start.type == "message_start" and start.message.stop_reason is None and start.message.content == []
    with client.messages.stream(model="mock-small", max_tokens=100, messages=HELLO) as helper:
        text = "".join(helper.text_stream)
        final = helper.get_final_message()
    assert _blocks(final) == _blocks(whole) and text == whole.content[0].text  # type: ignore[union-attr]
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == ("end_turn", 3, 8)


def test_raw_stream_with_x_api_key_has_ping_and_valid_events(stack: Stack) -> None:
    body = {"model": "mock-small", "max_tokens": 2, "messages": HELLO, "stream": True}
    headers = {"x-api-key": stack.key, "anthropic-version": "2023-06-01"}
    with (
        httpx.Client(base_url=_root(stack), timeout=30) as http,
        http.stream("POST", "/v1/messages", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["request-id"] == response.headers["x-request-id"]
        parsed = _raw_events(response)
    names = [name for name, _ in parsed]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    for name, payload in parsed:
        if name != "ping":
            EVENTS.validate_python(payload)
    delta = dict(parsed)["message_delta"]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert (delta["usage"]["input_tokens"], delta["usage"]["output_tokens"]) == (3, 2)


def test_bearer_auth_and_no_anthropic_version(stack: Stack) -> None:
    with httpx.Client(base_url=_root(stack), timeout=30) as http:
        response = http.post(
            "/v1/messages",
            json={"model": "mock-small", "max_tokens": 5, "messages": HELLO},
            headers={"authorization": f"Bearer {stack.key}"},
        )
    assert response.status_code == 200, response.text
    assert Message.model_validate(response.json()).usage.output_tokens == 5


# -- tools --------------------------------------------------------------------------------------


def test_tool_use_then_tool_result(client: anthropic.Anthropic) -> None:
    asked: list[MessageParam] = [{"role": "user", "content": "weather in Paris?"}]
    first = client.messages.create(model="mock-small", max_tokens=200, messages=asked, tools=[WEATHER])
    assert first.stop_reason == "tool_use" and [block.type for block in first.content] == ["tool_use"]
    call = first.content[0]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    Draft202012Validator(WEATHER["input_schema"]).validate(call.input)
    answered: list[MessageParam] = [
        *asked,
        first.to_param(),
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]},
    ]
    second = client.messages.create(model="mock-small", max_tokens=200, messages=answered, tools=[WEATHER])
    assert second.stop_reason == "end_turn" and [block.type for block in second.content] == ["text"]
    assert len(second.content[0].text.split()) == 8  # type: ignore[union-attr]


def test_tool_choice_names_the_tool(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="mock-small",
        max_tokens=200,
        messages=HELLO,
        tools=[WEATHER, TIME],
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
    )
    assert message.content[0].type == "tool_use" and message.content[0].name == "get_time"
    Draft202012Validator(TIME["input_schema"]).validate(message.content[0].input)


def test_streamed_tool_use_joins_to_the_same_input(client: anthropic.Anthropic) -> None:
    options: dict[str, Any] = {"model": "mock-small", "max_tokens": 200, "messages": HELLO, "tools": [WEATHER]}
    whole = client.messages.create(**options)
    with client.messages.create(**options, stream=True) as stream:
        received = list(stream)
    starts = [event for event in received if event.type == "content_block_start"]
    assert len(starts) == 1 and starts[0].content_block.type == "tool_use"
    assert starts[0].content_block.input == {} and starts[0].content_block.name == "get_weather"
    fragments = [
        event.delta.partial_json
        for event in received
        if event.type == "content_block_delta" and event.delta.type == "input_json_delta"
    ]
    assert len(fragments) > 1 and json.loads("".join(fragments)) == whole.content[0].input
    ending = [event for event in received if event.type == "message_delta"]
    assert ending[0].delta.stop_reason == "tool_use" and ending[0].usage.output_tokens == len(fragments)
    with client.messages.stream(**options) as helper:
        final = helper.get_final_message()
    assert _blocks(final) == _blocks(whole) and final.usage == whole.usage


# -- count_tokens -------------------------------------------------------------------------------


def test_count_tokens_equals_the_input_tokens_of_the_same_request(client: anthropic.Anthropic) -> None:
    options: dict[str, Any] = {"model": "mock-small", "system": "be brief", "messages": HELLO, "tools": [WEATHER]}
    raw = client.messages.with_raw_response.count_tokens(**options)
    counted = MessageTokensCount.model_validate(raw.http_response.json())
    assert raw.request_id
    used = client.messages.create(**options, max_tokens=200).usage.input_tokens
    assert counted.input_tokens == used and used > 6  # the tools' definition counts too


# -- errors -------------------------------------------------------------------------------------


def _refused(caught: pytest.ExceptionInfo[anthropic.APIStatusError], kind: str, *words: str) -> None:
    """Anthropic's error shape, type ``kind``, its message naming ``words``, the request id in header and body."""
    error = caught.value
    body = error.response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind == error.type
    assert all(word in body["error"]["message"] for word in words), body
    assert error.request_id and body["request_id"] == error.request_id


def test_missing_max_tokens(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.post("/v1/messages", body={"model": "mock-small", "messages": HELLO}, cast_to=Message)
    _refused(caught, "invalid_request_error", "max_tokens")


def test_bad_role(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="mock-small", max_tokens=5, messages=[{"role": "robot", "content": "x"}])  # type: ignore[misc, list-item]
    _refused(caught, "invalid_request_error", "messages.0.role")


def test_unknown_model(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=5, messages=HELLO)
    _refused(caught, "not_found_error", "no-such-model")


def test_a_server_tool_is_refused_naming_it(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="mock-small",
            max_tokens=5,
            messages=HELLO,
            tools=[{"type": "web_search_20250305", "name": "web_search"}],
        )
    _refused(caught, "invalid_request_error", "tools.0.type")


def test_a_stream_refused_before_its_first_token_has_its_status(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=5, messages=HELLO, stream=True)
    _refused(caught, "not_found_error", "no-such-model")


_ONE = {"model": "mock-small", "max_tokens": 5, "messages": HELLO}


@pytest.mark.parametrize(
    ("content", "headers", "expected"),
    [
        (b'{"model": "mock-small", ', {}, (400, "invalid_request_error", "JSON")),
        (
            {**_ONE, "thinking": {"type": "enabled", "budget_tokens": 1024}},
            {},
            (400, "invalid_request_error", "thinking"),
        ),
        ({**_ONE, "stop_sequences": list("12345")}, {}, (400, "invalid_request_error", "stop_sequences")),
        (_ONE, {"x-api-key": ""}, (401, "authentication_error", "API key")),
        ({**_ONE, "max_tokens": 10**12}, {}, (400, "invalid_request_error", "max_tokens: Input should be less")),
        ({**_ONE, "tools": [{**TIME, "name": ""}]}, {}, (400, "invalid_request_error", 'tools.0.name: "" should be')),
        ({**_ONE, "tools": [TIME, TIME]}, {}, (400, "invalid_request_error", 'tools.1.name: "get_time" is an')),
        ({**_ONE, "metadata": {"user_id": 7}}, {}, (400, "invalid_request_error", "metadata.user_id: Input")),
        (
            b'{"model": "mock-small", "max_tokens": 5, "messages": [{"role": "user", "content": "a\\ud800"}]}',
            {},
            (400, "invalid_request_error", "messages.0.content: it holds a lone surrogate"),
        ),
    ],
    ids=[
        "bad-json",
        "thinking",
        "stop-sequences",
        "no-key",
        "huge-max-tokens",
        "empty-tool-name",
        "same-tool-name",
        "user-id-number",
        "lone-surrogate",
    ],
)
def test_raw_bad_requests_in_anthropics_shape(
    stack: Stack, content: bytes | dict[str, Any], headers: dict[str, str], expected: tuple[int, str, str]
) -> None:
    sent = {"x-api-key": stack.key, "content-type": "application/json", **headers}
    raw = content if isinstance(content, bytes) else json.dumps(content).encode()
    with httpx.Client(base_url=_root(stack), timeout=30) as http:
        response = http.post("/v1/messages", content=raw, headers=sent)
    status, kind, named = expected
    assert response.status_code == status
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and named in body["error"]["message"]
    assert body["request_id"] == response.headers["request-id"] == response.headers["x-request-id"]


def test_revoked_key(stack: Stack) -> None:
    secret = stack.new_key("anthropic-revoked")
    with anthropic.Anthropic(base_url=_root(stack), api_key=secret, max_retries=0, timeout=30.0) as sdk:

        def answers(status: int) -> bool:
            try:
                sdk.messages.create(model="mock-small", max_tokens=1, messages=HELLO)
            except anthropic.APIStatusError as error:
                return error.status_code == status
            return status == 200

        wait_for(lambda: answers(200), 5, 0.1, "the new key works")
        assert revoke_key(stack.keys_path, "anthropic-revoked")
        wait_for(lambda: answers(401), 5, 0.1, "revocation")
        with pytest.raises(anthropic.AuthenticationError) as caught:
            sdk.messages.create(model="mock-small", max_tokens=1, messages=HELLO)
    _refused(caught, "authentication_error", "Incorrect API key")


@pytest.mark.slow
def test_the_edges_own_overload_is_529_overloaded(tmp_path: Path) -> None:
    """Over ``http.max_in_flight`` (1 here: a stream holds it) the edge is overloaded, which Anthropic's
    clients retry as a 529 overloaded_error, not a rate_limit_error (that is for the key's limits)."""
    edge = {"http": {"host": "127.0.0.1", "port": 0, "max_in_flight": 1}}
    routes = [{"model": "mock-slow", "adapter": "mock", "options": {"tokens": 1000, "tokens_per_second": 20}}]
    with (
        running_stack(tmp_path / "stack", {"node-a": routes}, edge_settings=edge) as small,
        anthropic.Anthropic(base_url=_root(small), api_key=small.key, max_retries=0, timeout=30.0) as sdk,
        sdk.messages.stream(model="mock-slow", max_tokens=1000, messages=HELLO) as held,
    ):
        next(iter(held))
        with pytest.raises(anthropic.InternalServerError) as caught:
            sdk.messages.create(model="mock-slow", max_tokens=5, messages=HELLO)
        assert caught.value.status_code == 529 and caught.value.response.headers["retry-after"] == "1"
        _refused(caught, "overloaded_error", "its limit")


# -- cancellation -------------------------------------------------------------------------------


def test_disconnect_mid_stream_cancels_the_run(stack: Stack, client: anthropic.Anthropic) -> None:
    with client.messages.create(model="mock-slow", max_tokens=1000, messages=HELLO, stream=True) as stream:
        request_id = stream.response.headers["request-id"]
        for count, _ in enumerate(stream, 1):
            if count == 4:
                break
        gone = time.time()
    # the SDK's stream closed the connection on leaving the block

    def ended() -> dict[str, Any] | None:
        record = stack.run("node-a", request_id)
        return record if record is not None and record["status"] != "running" else None

    record = wait_for(ended, 5, 0.1, "the node's record of the run to end")
    assert record["status"] == "cancelled", record
    assert datetime.fromisoformat(str(record["finished_at"])).timestamp() - gone < 1.0


# -- a model that cannot count, a run that fails mid-stream -------------------------------------


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A node serving a cli model (a program: it cannot count tokens) and a mock that fails after 3 tokens."""
    root = tmp_path_factory.mktemp("messages")
    program = root / "hello.py"
    program.write_text("print('hello from a program')\n")
    routes = [
        {"model": "cli-hello", "adapter": "cli", "options": {"argv": [sys.executable, str(program)]}},
        {"model": "mock-failing", "adapter": "mock", "options": {"tokens": 8, "fail_after": 3}},
    ]
    with running_stack(root / "stack", {"node-a": routes}) as started:
        yield started


@pytest.mark.slow
def test_count_tokens_where_the_backend_cannot_count(odd_models: Stack) -> None:
    with anthropic.Anthropic(base_url=_root(odd_models), api_key=odd_models.key, max_retries=0) as sdk:
        assert sdk.messages.create(model="cli-hello", max_tokens=20, messages=HELLO).stop_reason == "end_turn"
        with pytest.raises(anthropic.BadRequestError) as caught:
            sdk.messages.count_tokens(model="cli-hello", messages=HELLO)
    _refused(caught, "invalid_request_error", "cli-hello", "count")


@pytest.mark.slow
def test_a_run_failing_mid_stream_ends_with_an_error_event(odd_models: Stack) -> None:
    body = {"model": "mock-failing", "max_tokens": 100, "messages": HELLO, "stream": True}
    with (
        httpx.Client(base_url=_root(odd_models), timeout=30) as http,
        http.stream("POST", "/v1/messages", json=body, headers={"x-api-key": odd_models.key}) as response,
    ):
        assert response.status_code == 200
        parsed = _raw_events(response)
    names = [name for name, _ in parsed]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "error"
    assert names.count("content_block_delta") == 3 and "message_stop" not in names
    error = parsed[-1][1]
    assert error["error"]["type"] == "api_error" and "fail_after" in error["error"]["message"]
    with (
        anthropic.Anthropic(base_url=_root(odd_models), api_key=odd_models.key, max_retries=0) as sdk,
        pytest.raises(anthropic.APIStatusError) as caught,
        sdk.messages.stream(model="mock-failing", max_tokens=100, messages=HELLO) as stream,
    ):
        stream.get_final_message()
    assert caught.value.type == "api_error"
