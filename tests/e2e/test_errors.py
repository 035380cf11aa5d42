"""Every error the edge answers, with its status and OpenAI's body ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import json
import math
import socket
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from iop_edge.keys import revoke_key

from .conftest import Stack, wait_for
from .openai_schema import validate

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
ANY = object()
"""Any param: OpenAI itself sends null where this edge may name the field."""


def _error(response: Any, status: int, *, param: str | object | None = None, code: str | None = None) -> dict[str, Any]:
    """The error object of ``response``, checked: status, a valid ErrorResponse, param and code."""
    body = response.json()
    assert response.status_code == status, body
    validate("ErrorResponse", body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert param is ANY or error["param"] == param, error
    assert error["code"] == code, error
    assert response.headers["content-type"].startswith("application/json")
    return error  # type: ignore[no-any-return]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "mock-small", "messages": HELLO, **fields}


def test_malformed_json(stack: Stack) -> None:
    with stack.http() as http:
        response = http.post(
            "/chat/completions",
            content=b'{"model": "mock-small", "messages": [',
            headers={"content-type": "application/json"},
        )
    assert _error(response, 400)["type"] == "invalid_request_error"


def test_missing_model(stack: Stack) -> None:
    with stack.http() as http:
        _error(http.post("/chat/completions", json={"messages": HELLO}), 400, param="model")


def test_unknown_model(stack: Stack) -> None:
    with stack.http() as http:
        error = _error(
            http.post("/chat/completions", json=_chat(model="no-such-model")),
            404,
            param=ANY,
            code="model_not_found",
        )
        assert error["type"] == "invalid_request_error"
        _error(http.get("/models/no-such-model"), 404, param="model", code="model_not_found")


def test_no_key(stack: Stack) -> None:
    with stack.http() as http:
        response = http.post("/chat/completions", json=_chat(), headers={"authorization": ""})
    assert _error(response, 401)["type"] == "invalid_request_error"


def test_bad_key(stack: Stack) -> None:
    with stack.http("sk-iop-not-a-key-at-all") as http:
        _error(http.post("/chat/completions", json=_chat()), 401, code="invalid_api_key")
        _error(http.get("/models"), 401, code="invalid_api_key")
    with pytest.raises(openai.AuthenticationError) as caught:
        stack.client("sk-iop-not-a-key-at-all").models.list()
    validate("ErrorResponse", caught.value.response.json())


def test_revoked_key(stack: Stack) -> None:
    secret = stack.new_key("soon-revoked")
    with stack.http(secret) as http:
        wait_for(lambda: http.post("/chat/completions", json=_chat()).status_code == 200, 5, 0.1, "the new key works")
        assert revoke_key(stack.keys_path, "soon-revoked")
        wait_for(lambda: http.post("/chat/completions", json=_chat()).status_code == 401, 5, 0.1, "revocation")
        _error(http.post("/chat/completions", json=_chat()), 401, code="invalid_api_key")


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"temperature": "hot"}, "temperature", "invalid_type"),
        ({"temperature": 2.5}, "temperature", "decimal_above_max_value"),
        ({"max_tokens": -1}, "max_tokens", "integer_below_min_value"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "integer_below_min_value"),
        ({"messages": []}, "messages", "empty_array"),
        ({"messages": "hello"}, "messages", "invalid_type"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "invalid_value"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        ({"stream_options": {"include_usage": True}}, "stream_options", None),
        ({"n": 2}, "n", None),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", None),
    ],
    ids=lambda value: str(value)[:40],
)
def test_bad_fields_name_the_param(stack: Stack, fields: dict[str, Any], param: str, code: str | None) -> None:
    with stack.http() as http:
        assert _error(http.post("/chat/completions", json=_chat(**fields)), 400, param=param, code=code)["type"] == (
            "invalid_request_error"
        )


def test_unrecognized_field(stack: Stack) -> None:
    # OpenAI: 400 "Unrecognized request argument supplied: <name>", param and code null
    with stack.http() as http:
        error = _error(http.post("/chat/completions", json=_chat(frobnicate=True)), 400)
    assert "frobnicate" in error["message"]


def test_sdk_raises_bad_request_for_a_wrong_type(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        stack.client().chat.completions.create(model="mock-small", messages=HELLO, temperature="warm")  # type: ignore[call-overload]
    assert caught.value.param == "temperature"
    validate("ErrorResponse", caught.value.response.json())


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param", "code"),
    [
        # a JSON body that is not an object
        ("POST", "/chat/completions", [1, 2], 400, None, None),
        # an empty body
        ("POST", "/chat/completions", None, 400, None, None),
        # embeddings of an empty string: OpenAI refuses it naming input
        ("POST", "/embeddings", {"model": "mock-small", "input": ""}, 400, "input", None),
        # a completion with no prompt
        ("POST", "/completions", {"model": "mock-small"}, 400, "prompt", None),
        # an unknown route: OpenAI answers 404 "Invalid URL (POST /v1/nope)"
        ("POST", "/nope", {}, 404, None, "unknown_url"),
        # the wrong method on a real route
        ("GET", "/chat/completions", None, 405, None, "method_not_allowed"),
    ],
    ids=["array-body", "empty-body", "empty-input", "no-prompt", "unknown-url", "wrong-method"],
)
def test_other_bad_input(  # noqa: PLR0917 - one argument per column of the table
    stack: Stack, method: str, path: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    with stack.http() as http:
        response = http.request(method, path, json=body) if body is not None else http.request(method, path)
        _error(response, status, param=param, code=code)


def test_rate_limit_exceeded(stack: Stack) -> None:
    secret = stack.new_key("one-a-minute", rpm=1)
    with stack.http(secret) as http:
        wait_for(lambda: http.post("/chat/completions", json=_chat()).status_code == 200, 5, 0.1, "the new key works")
        response = http.post("/chat/completions", json=_chat())
        error = _error(response, 429, code="rate_limit_exceeded")
    assert int(response.headers["retry-after"]) >= 1
    assert error["type"] == "requests"
    with pytest.raises(openai.RateLimitError) as caught:
        stack.client(secret).chat.completions.create(model="mock-small", messages=HELLO)
    validate("ErrorResponse", caught.value.response.json())


def test_no_node_can_serve_the_model(stack: Stack) -> None:
    stack.admin("drain", "node-a", "--reason", "e2e")
    try:
        with stack.http() as http:

            def refused() -> Any:
                response = http.post("/chat/completions", json=_chat())
                return response if response.status_code == 503 else None

            response = wait_for(refused, 5, 0.1, "503 once drained")
            _error(response, 503, code="service_unavailable")
            assert int(response.headers["retry-after"]) >= 1
    finally:
        stack.admin("undrain", "node-a")
        wait_for(lambda: "mock-small" in stack.served(), 10, 0.1, "served again")
        with stack.http() as http:
            wait_for(lambda: http.post("/chat/completions", json=_chat()).status_code == 200, 10, 0.1, "undrained")


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return value


_LONE = "\ud800"
"""A lone surrogate: valid in JSON text (``"\\ud800"``), not Unicode text; protobuf cannot encode it."""


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"model": "mock-small", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "messages"),
        (json.dumps(_chat(messages=[{"role": "user", "content": _LONE}])), "messages[0].content"),
        (json.dumps(_chat(model="mock" + _LONE)), "model"),
        (json.dumps(_chat(user=_LONE)), "user"),
        (
            json.dumps(_chat(messages=[{"role": "user", "content": [{"type": "text", "text": _LONE}]}])),
            "messages[0].content[0].text",
        ),
        (json.dumps(_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": _deep(40)}}])), ANY),
        (json.dumps(_chat(logit_bias={"50256": math.nan})), "logit_bias.50256"),
        (
            json.dumps(_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"x": math.inf}}}])),
            "tools[0].function.parameters.x",
        ),
        (json.dumps(_chat(model="m" * 1_000_000)), "model"),
    ],
    ids=[
        "nested-1e5",
        "surrogate-content",
        "surrogate-model",
        "surrogate-user",
        "surrogate-part",
        "tools-40-deep",
        "nan-logit-bias",
        "inf-in-tools",
        "1mb-model",
    ],
)
def test_bodies_no_run_can_carry_are_400_naming_the_field(stack: Stack, body: str, param: Any) -> None:
    assert stack.edge is not None
    logged = len(stack.edge.log.read_bytes())
    with stack.http() as http:
        response = http.post("/chat/completions", content=body.encode(), headers={"content-type": "application/json"})
    error = _error(response, 400, param=param, code="invalid_value")
    if param is ANY:
        assert error["param"].startswith("tools[0].function.parameters"), error
    assert len(response.content) < 4096, "the bad value is not echoed whole"
    log = stack.edge.log.read_bytes()[logged:]
    assert b"Traceback" not in log and b"error" not in log.lower(), log[-2000:]
    _still_serving(stack)


def _still_serving(stack: Stack) -> None:
    answer = stack.client().chat.completions.create(model="mock-small", messages=HELLO)
    assert answer.choices[0].message.content


def test_a_chat_over_the_platform_limit_is_413_in_terms_of_the_request(stack: Stack) -> None:
    big = "a" * (5 * 1024 * 1024)  # under http.max_body_bytes (16 MiB), over what one run carries (4 MiB)
    with stack.http() as http:
        response = http.post("/chat/completions", json=_chat(messages=[{"role": "user", "content": big}]))
    error = _error(response, 413, code="request_too_large")
    assert "request" in error["message"] and "frame" not in error["message"], error
    _still_serving(stack)


def test_a_client_gone_mid_body_is_counted_not_a_traceback(stack: Stack) -> None:
    assert stack.edge is not None
    counted = 'iop_edge_client_disconnects_total{route="chat.completions"}'
    before = stack.edge_metric(counted)
    logged = len(stack.edge.log.read_bytes())
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {stack.key}\r\ncontent-length: 1000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", stack.edge_port)) as sock:
        sock.sendall(head.encode() + b'{"model": "mock-small", ')
    wait_for(lambda: stack.edge_metric(counted) == before + 1, 5, 0.05, "the departure counted")
    log = stack.edge.log.read_bytes()[logged:]
    assert b"Traceback" not in log and b"error" not in log.lower(), log[-2000:]
    _still_serving(stack)


def test_models_no_node_serves_add_no_metric_series(stack: Stack) -> None:
    with stack.http() as http:
        for index in range(3):
            _error(
                http.post("/chat/completions", json=_chat(model=f"made-up-{index}")),
                404,
                param=ANY,
                code="model_not_found",
            )
        metrics = http.get(stack.base_url.removesuffix("/v1") + "/metrics").text
    assert "made-up" not in metrics  # a client naming random models cannot grow the edge's memory
    assert 'model="mock-small"' in metrics
