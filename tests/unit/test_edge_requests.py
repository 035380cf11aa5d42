"""The edge's request checks and the IOP-code-to-HTTP table, without sockets."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from google.protobuf import json_format

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import IopError
from iop_wire.openai.errors import STATUS, ApiError, from_iop
from iop_wire.openai.requests import chat_request, completion_request, embedding_request, parse_body

_CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _refused(call: Any, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)
    return caught.value


def test_a_chat_request_carries_sampling_messages_and_model_fields() -> None:
    data = {
        **_CHAT,
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        "temperature": 0.5,
        "top_p": 1,
        "max_completion_tokens": 7,
        "max_tokens": 99,
        "stop": ["\n"],
        "seed": 3,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "top_logprobs": 2,
        "logprobs": True,
        "user": "u-1",
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "store": False,
    }
    chat = chat_request(data, "r1")
    run = chat.request
    assert (run.run_id, run.model, run.kind) == ("r1", "m", pb.RUN_KIND_CHAT)
    assert [m.role for m in run.messages] == [pb.ROLE_SYSTEM, pb.ROLE_USER, pb.ROLE_ASSISTANT, pb.ROLE_TOOL]
    assert run.messages[1].content[1].image_url.url == "x" and run.messages[2].tool_calls[0].function.name == "f"
    assert run.messages[3].tool_call_id == "c1"
    sampling = run.sampling
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens, list(sampling.stop), sampling.seed) == (
        0.5,
        1.0,
        7,  # max_completion_tokens wins over max_tokens
        ["\n"],
        3,
    )
    fields = json_format.MessageToDict(run.openai_fields)
    assert set(fields) == {"tools", "top_logprobs", "logprobs", "user"}  # n == 1 is not carried
    assert run.metadata["user"] == "u-1"
    assert chat.stream and chat.include_usage


@pytest.mark.parametrize(
    ("change", "status", "param", "words"),
    [
        ({"model": None}, 400, "model", "provide a model"),
        ({"model": 3}, 400, "model", "not of type 'string'"),
        ({"messages": None}, 400, "messages", "Missing required parameter"),
        ({"messages": []}, 400, "messages", "too short"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "Supported values"),
        ({"messages": [{"role": "user"}]}, 400, "messages[0].content", "Missing required parameter"),
        ({"messages": ["hi"]}, 400, "messages[0]", "expected an object"),
        ({"temperature": "hot"}, 400, "temperature", "expected a decimal, but got a string"),
        ({"temperature": 2.5}, 400, "temperature", "above maximum value"),
        ({"top_p": -0.1}, 400, "top_p", "below minimum value"),
        ({"max_tokens": -1}, 400, "max_tokens", "Expected a value >= 1"),
        ({"max_tokens": 1.5}, 400, "max_tokens", "expected an integer"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "up to 4"),
        ({"n": 2}, 400, "n", "n > 1"),
        ({"logprobs": "yes"}, 400, "logprobs", "Invalid value"),
        ({"top_logprobs": 3}, 400, "top_logprobs", "logprobs must be true"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed when 'stream'"),
        ({"stream": "yes"}, 400, "stream", "expected a boolean"),
        ({"audio": {"voice": "x"}}, 400, "audio", "not supported"),
        ({"frobnicate": 1}, 400, None, "Unrecognized request argument supplied: frobnicate"),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(
    change: dict[str, Any], status: int, param: str | None, words: str
) -> None:
    error = _refused(chat_request, {**_CHAT, **change}, "r1")
    assert (error.status, error.param) == (status, param)
    assert words in error.message
    assert error.body()["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [b"{bad", b"[1, 2]", b"\xff\xfe", b""])
def test_a_body_that_is_not_a_json_object_is_400(body: bytes) -> None:
    error = _refused(parse_body, body)
    assert error.status == 400 and error.param is None


def test_completions_take_one_run_per_prompt_and_default_to_16_tokens() -> None:
    completion = completion_request({"model": "m", "prompt": ["a", "b"]}, "r1")
    assert [run.run_id for run in completion.requests] == ["r1", "r1-1"]
    assert [list(run.prompt) for run in completion.requests] == [["a"], ["b"]]
    assert all(run.sampling.max_tokens == 16 and run.kind == pb.RUN_KIND_COMPLETION for run in completion.requests)
    for change, param in (({"prompt": 5}, "prompt"), ({"n": 3}, "n"), ({"suffix": "x"}, "suffix")):
        assert _refused(completion_request, {"model": "m", "prompt": "a", **change}, "r").param == param


def test_embeddings_take_strings_and_an_encoding() -> None:
    embedding = embedding_request({"model": "m", "input": ["a", "b"], "encoding_format": "base64"}, "r1")
    assert list(embedding.request.prompt) == ["a", "b"] and embedding.base64
    for change, param in (
        ({"input": [1, 2]}, "input"),
        ({"input": [""]}, "input"),
        ({"encoding_format": "hex"}, "encoding_format"),
        ({"dimensions": 0}, "dimensions"),
    ):
        assert _refused(embedding_request, {"model": "m", "input": "a", **change}, "r").param == param


def test_every_iop_error_code_has_one_status_and_retry_after_travels() -> None:
    assert set(STATUS) == set(pb.ErrorCode.values())
    wait = datetime.timedelta(seconds=2.2)
    full = IopError(pb.ERROR_CODE_RESOURCE_EXHAUSTED, "no room", retry_after=wait, reason=pb.ERROR_REASON_QUEUE_FULL)
    error = from_iop(full)
    assert (error.status, error.code, error.headers()) == (429, "queue_full", {"retry-after": "3"})
    # The reason decides, not the message's words.
    limited = from_iop(IopError(pb.ERROR_CODE_RESOURCE_EXHAUSTED, "the queue is long", retry_after=wait))
    assert limited.code == "rate_limit_exceeded"
    invalid = from_iop(IopError(pb.ERROR_CODE_INVALID_ARGUMENT, "no tools here", param="tools"))
    assert (invalid.status, invalid.param, invalid.type) == (400, "tools", "invalid_request_error")
    assert from_iop(IopError(pb.ERROR_CODE_UNAVAILABLE, "no node", retryable=True)).headers() == {"retry-after": "1"}
    assert from_iop(IopError(pb.ERROR_CODE_DEADLINE_EXCEEDED, "late")).status == 504
