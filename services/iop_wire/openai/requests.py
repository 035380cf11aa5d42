"""OpenAI request bodies in, ``run.request`` out: every field checked, each problem a 400 naming it.

The edge checks what OpenAI's API checks (types, ranges, required fields, unknown fields) so a
client gets the same 400 it would get from OpenAI, with ``param`` naming the field, before any
run starts. Fields that change what the model does and that IOP carries without interpreting
(tools, response_format, logprobs, ...) go to the node in ``openai_fields``; an adapter that
cannot honour one refuses the run naming it (INVALID_ARGUMENT with ``param``, a 400 here).
Fields that only concern OpenAI's own platform (store, service_tier, ...) are accepted and
ignored, as other OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.struct_pb2 import Struct

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.openai.errors import ApiError
from iop_wire.openai.values import check_values, too_deep

__all__ = [
    "ANTHROPIC_TOOL_NAME",
    "MAX_STOP",
    "MAX_TOKENS",
    "OPENAI_TOOL_NAME",
    "ChatRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "function_tool",
    "kind_of",
    "known_fields",
    "missing",
    "model",
    "parse_body",
    "required",
    "sampling",
    "show",
    "tool_choice_sent",
    "tool_name_problem",
]

_ROLES = {
    "system": pb.ROLE_SYSTEM,
    "developer": pb.ROLE_DEVELOPER,
    "user": pb.ROLE_USER,
    "assistant": pb.ROLE_ASSISTANT,
    "tool": pb.ROLE_TOOL,
    "function": pb.ROLE_TOOL,
}
_CARRIED = frozenset(
    {
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "functions",
        "function_call",
        "reasoning_effort",
        "user",
        "n",
    }
)
"""Chat fields the node's adapter receives as they are (``openai_fields``)."""
_IGNORED = frozenset(
    {"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "verbosity", "stream_options"}
)
"""Fields about OpenAI's platform, not the model: accepted, not used (stream_options is read here)."""
_UNSUPPORTED = frozenset({"modalities", "audio", "prediction", "web_search_options"})
"""Valid OpenAI fields no IOP adapter can honour: 400 naming them."""
_CHAT_FIELDS = {"model", "messages", "stream", "temperature", "top_p", "max_tokens", "max_completion_tokens"}
_CHAT_FIELDS |= {"stop", "seed", "presence_penalty", "frequency_penalty"}
_COMPLETION_FIELDS = {"model", "prompt", "stream", "temperature", "top_p", "max_tokens", "stop", "seed"}
_COMPLETION_FIELDS |= {"presence_penalty", "frequency_penalty", "n", "user", "logit_bias", "logprobs", "echo"}
_COMPLETION_FIELDS |= {"best_of", "suffix", "stream_options"}
_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
MAX_STOP = 4
"""Stop sequences one run carries (OpenAI-compatible backends take 4): more is a 400, as one run cannot be split."""
MAX_MODEL_NAME = 256
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]+")
"""Longest model name taken: it is echoed in errors, logged and kept in ledgers."""


@dataclass(slots=True)
class ChatRequest:
    """A chat completion request, checked."""

    request: pb.RunRequest
    stream: bool
    include_usage: bool


@dataclass(slots=True)
class CompletionRequest:
    """A (legacy) text completion request, checked: one run per prompt."""

    requests: list[pb.RunRequest]
    stream: bool
    include_usage: bool
    echo: bool


@dataclass(slots=True)
class EmbeddingRequest:
    """An embeddings request, checked."""

    request: pb.RunRequest
    base64: bool
    dimensions: int | None


def parse_body(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body; 400 for anything else."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        message = (
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't using "
            f"your HTTP library correctly. The OpenAI API expects a JSON payload: {exc})"
        )
        raise ApiError(400, message) from None
    except RecursionError:  # deeper than Python's recursion limit: far over MAX_DEPTH
        raise too_deep(body) from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {kind_of(data)}")
    check_values(data)
    return data


def chat_request(data: Mapping[str, Any], run_id: str) -> ChatRequest:
    """A chat completion request as a run.request (``data`` from :func:`parse_body`)."""
    known_fields(data, _CHAT_FIELDS | _CARRIED | _IGNORED | _UNSUPPORTED)
    request = pb.RunRequest(run_id=run_id, model=model(data), kind=pb.RUN_KIND_CHAT)
    messages = required(data, "messages", list, "array")
    if not messages:
        raise ApiError(400, "[] is too short - 'messages'", param="messages", code="empty_array")
    for index, message in enumerate(messages):
        request.messages.append(_message(message, f"messages[{index}]"))
    stream = _optional(data, "stream", bool, "boolean") or False
    sampling(data, request.sampling, max_tokens=("max_completion_tokens", "max_tokens"))
    carried = {name: data[name] for name in _CARRIED if data.get(name) is not None}
    _check_carried(carried)
    carried.pop("n", None)  # 1: the only value served
    if carried:
        request.openai_fields.CopyFrom(_struct(carried))
    if isinstance(user := data.get("user"), str) and user:
        request.metadata["user"] = user
    return ChatRequest(request, stream, _include_usage(data, stream))


def completion_request(data: Mapping[str, Any], run_id: str) -> CompletionRequest:
    """A text completion request: one run.request per prompt (``<run_id>-<index>`` past the first)."""
    known_fields(data, _COMPLETION_FIELDS)
    model_name = model(data)
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(item, str) for item in prompt):
        prompts = list(prompt)
    elif prompt is None:
        raise ApiError(400, "you must provide a prompt parameter", param="prompt")
    else:
        raise ApiError(400, "prompt must be a string or a non-empty array of strings", param="prompt")
    stream = _optional(data, "stream", bool, "boolean") or False
    for name in ("n", "best_of"):
        if _optional(data, name, int, "integer") not in (None, 1):
            raise ApiError(400, f"{name} > 1 is not supported: send one request per choice", param=name)
    if data.get("suffix") is not None:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if data.get("logprobs") is not None:
        raise ApiError(400, "logprobs is not supported for completions", param="logprobs")
    echo = _optional(data, "echo", bool, "boolean") or False
    template = pb.RunRequest(model=model_name, kind=pb.RUN_KIND_COMPLETION, stream=stream)
    sampling(data, template.sampling, max_tokens=("max_tokens",), default_max_tokens=16)
    if isinstance(user := data.get("user"), str) and user:
        template.metadata["user"] = user
    requests = []
    for index, text in enumerate(prompts):
        request = pb.RunRequest()
        request.CopyFrom(template)
        request.run_id = run_id if index == 0 else f"{run_id}-{index}"
        request.prompt.append(text)
        requests.append(request)
    return CompletionRequest(requests, stream, _include_usage(data, stream), echo)


def embedding_request(data: Mapping[str, Any], run_id: str) -> EmbeddingRequest:
    """An embeddings request as one run.request whose prompt holds each input."""
    known_fields(data, _EMBEDDING_FIELDS)
    model_name = model(data)
    given = data.get("input")
    if isinstance(given, str):
        inputs = [given]
    elif isinstance(given, list) and given and all(isinstance(item, str) for item in given):
        inputs = list(given)
    elif isinstance(given, list) and given and all(isinstance(item, int) for item in given):
        raise ApiError(400, "token arrays are not supported as input: send text", param="input")
    elif given is None:
        raise ApiError(400, "you must provide an input parameter", param="input")
    else:
        raise ApiError(400, "input must be a string or a non-empty array of strings", param="input")
    if any(not text for text in inputs):
        raise ApiError(400, "input cannot contain an empty string", param="input")
    encoding = data.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise ApiError(
            400, f"{encoding!r} is not one of ['float', 'base64'] - 'encoding_format'", param="encoding_format"
        )
    dimensions = _optional(data, "dimensions", int, "integer")
    if dimensions is not None and dimensions < 1:
        raise ApiError(400, f"{dimensions} is less than the minimum of 1 - 'dimensions'", param="dimensions")
    request = pb.RunRequest(run_id=run_id, model=model_name, kind=pb.RUN_KIND_EMBEDDING, prompt=inputs)
    if isinstance(user := data.get("user"), str) and user:
        request.metadata["user"] = user
    return EmbeddingRequest(request, encoding == "base64", dimensions)


# -- fields ---------------------------------------------------------------------------------


def known_fields(data: Mapping[str, Any], allowed: set[str] | frozenset[str]) -> None:
    """400 for a field OpenAI does not know (or one no IOP adapter honours)."""
    for name in data:
        if name not in allowed:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}")
    for name in _UNSUPPORTED & data.keys():
        if data[name] is not None:
            raise ApiError(400, f"{name} is not supported by this server", param=name)


def model(data: Mapping[str, Any]) -> str:
    """The request's ``model``: a non-empty string, at most MAX_MODEL_NAME characters; 400 otherwise."""
    name = data.get("model")
    if name is None:
        raise ApiError(400, "you must provide a model parameter", param="model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{show(name)} is not of type 'string' - 'model'", param="model")
    if len(name) > MAX_MODEL_NAME:
        message = f"Invalid 'model': {show(name)} is {len(name)} characters, over the {MAX_MODEL_NAME} a name may have."
        raise ApiError(400, message, param="model", code="invalid_value")
    return name


def required(data: Mapping[str, Any], name: str, kind: type, kind_name: str) -> Any:
    """``data[name]``; 400 when missing or not of ``kind``."""
    if name not in data or data[name] is None:
        raise missing(name)
    return _typed(data[name], name, kind, kind_name)


def missing(name: str) -> ApiError:
    """OpenAI's 400 for a required field (``name`` its path, e.g. ``messages[0].content``) left out."""
    return ApiError(400, f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")


def _optional(data: Mapping[str, Any], name: str, kind: type, kind_name: str) -> Any:
    value = data.get(name)
    return None if value is None else _typed(value, name, kind, kind_name)


def _typed(value: Any, name: str, kind: type, kind_name: str) -> Any:
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise ApiError(
            400,
            f"Invalid type for '{name}': expected {_a(kind_name)}, but got {kind_of(value)} instead.",
            param=name,
            code="invalid_type",
        )
    return value


def _number(data: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = _optional(data, name, float, "decimal")
    if value is None:
        return None
    if value < low:
        message = (
            f"Invalid '{name}': decimal below minimum value. Expected a value >= {low:g}, but got {value} instead."
        )
        raise ApiError(400, message, param=name, code="decimal_below_min_value")
    if value > high:
        message = (
            f"Invalid '{name}': decimal above maximum value. Expected a value <= {high:g}, but got {value} instead."
        )
        raise ApiError(400, message, param=name, code="decimal_above_max_value")
    return float(value)


MAX_TOKENS = 2**31 - 1
"""The most tokens (or top-k) a request may ask for: ``Sampling`` carries int32s on the wire. More is a
400 naming the value sent, not a clamped value the node would refuse in its own terms."""


def sampling(
    data: Mapping[str, Any],
    sampling: pb.Sampling,
    *,
    max_tokens: tuple[str, ...],
    default_max_tokens: int | None = None,
) -> None:
    for name, low, high in (
        ("temperature", 0.0, 2.0),
        ("top_p", 0.0, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
    ):
        if (value := _number(data, name, low, high)) is not None:
            setattr(sampling, name, value)
    limit = _max_tokens(data, max_tokens)
    if limit is None:
        limit = default_max_tokens
    if limit is not None:
        sampling.max_tokens = limit
    if (seed := _optional(data, "seed", int, "integer")) is not None:
        if not -(2**63) <= seed < 2**63:
            raise ApiError(400, "Invalid 'seed': it must fit in 64 bits.", param="seed")
        sampling.seed = seed
    stop = data.get("stop")
    if isinstance(stop, str):
        sampling.stop.append(stop)
    elif isinstance(stop, list):
        if len(stop) > MAX_STOP or not all(isinstance(item, str) for item in stop):
            raise ApiError(400, f"stop must be a string or up to {MAX_STOP} strings", param="stop")
        sampling.stop.extend(stop)
    elif stop is not None:
        raise ApiError(
            400,
            f"Invalid type for 'stop': expected a string or an array of strings, but got {kind_of(stop)} instead.",
            param="stop",
            code="invalid_type",
        )


def function_tool(name: str, parameters: Any, description: Any = None, strict: Any = None) -> dict[str, Any]:
    """A function tool in chat completions' shape (what a node's adapter reads), from the parts every API's
    tool has; no parameters: an object with none."""
    function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if isinstance(description, str):
        function["description"] = description
    if isinstance(strict, bool):
        function["strict"] = strict
    return {"type": "function", "function": function}


OPENAI_TOOL_NAME = 64
"""OpenAI's bound on a function's name (FunctionObject.name: letters, digits, underscores, dashes, up to 64)."""
ANTHROPIC_TOOL_NAME = 128
"""Anthropic's bound on a tool's name (same characters, up to 128)."""


def tool_name_problem(names: Sequence[str], *, longest: int) -> tuple[int, str] | None:
    """The first of ``names`` (the tools' names, in order) that is bad: its index and what is wrong with
    it (not 1 to ``longest`` letters, digits, underscores or dashes; an earlier tool's name); None when
    all are fine. Each API words the 400 its own way."""
    seen: set[str] = set()
    for index, name in enumerate(names):
        if not _TOOL_NAME.fullmatch(name) or len(name) > longest:
            return index, f"{show(name)} should be 1 to {longest} letters, digits, underscores or dashes"
        if name in seen:
            return index, f"{show(name)} is an earlier tool's name: names are unique"
        seen.add(name)
    return None


def tool_choice_sent(choice: str | dict[str, Any] | None, has_tools: bool) -> str | dict[str, Any] | None:
    """A tool_choice (chat completions' shape) as a run carries it. Without tools, ``auto`` and ``none``
    are what no tools mean anyway: dropped (OpenAI and Anthropic take them; vLLM refuses tool_choice
    without tools); ``required`` or a named function without tools raises ValueError (the caller's 400)."""
    if choice is None or has_tools:
        return choice
    if choice in ("auto", "none"):
        return None
    raise ValueError(f"tool_choice {show(choice)} needs tools, and the request has none")


def _max_tokens(data: Mapping[str, Any], names: tuple[str, ...]) -> int | None:
    """The first of ``names`` set (max_completion_tokens before max_tokens), from 1 to the wire's bound;
    400 naming the client's field and its value otherwise."""
    for name in names:
        if (value := _optional(data, name, int, "integer")) is not None:
            if value < 1:
                message = (
                    f"Invalid '{name}': integer below minimum value. Expected a value >= 1, but got {value} instead."
                )
                raise ApiError(400, message, param=name, code="integer_below_min_value")
            if value > MAX_TOKENS:  # the wire's bound (int32); each node refuses above its own, lower, limit
                message = (
                    f"Invalid '{name}': integer above maximum value. Expected a value <= {MAX_TOKENS}, "
                    f"but got {value} instead."
                )
                raise ApiError(400, message, param=name, code="integer_above_max_value")
            return int(value)
    return None


def _include_usage(data: Mapping[str, Any], stream: bool) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(
            400,
            f"Invalid type for 'stream_options': expected an object, but got {kind_of(options)} instead.",
            param="stream_options",
            code="invalid_type",
        )
    if not stream:
        raise ApiError(
            400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options"
        )
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise ApiError(400, "stream_options.include_usage must be a boolean", param="stream_options.include_usage")
    return include


def _check_carried(carried: Mapping[str, Any]) -> None:
    checks: dict[str, Callable[[Any], bool]] = {
        "tools": lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v),
        "response_format": lambda v: isinstance(v, dict) and isinstance(v.get("type"), str),
        "logprobs": lambda v: isinstance(v, bool),
        "top_logprobs": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 20,
        "parallel_tool_calls": lambda v: isinstance(v, bool),
        "tool_choice": lambda v: isinstance(v, str | dict),
        "user": lambda v: isinstance(v, str),
        "logit_bias": lambda v: isinstance(v, dict),
        "n": lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 128,
    }
    for name, value in carried.items():
        check = checks.get(name)
        if check is not None and not check(value):
            raise ApiError(400, f"Invalid value for '{name}': {show(value)}", param=name, code="invalid_value")
    if carried.get("n", 1) != 1:
        raise ApiError(400, "n > 1 is not supported: send one request per choice", param="n")
    if carried.get("top_logprobs") and not carried.get("logprobs"):
        raise ApiError(400, "logprobs must be true when top_logprobs is set", param="top_logprobs")


def _message(message: Any, where: str) -> pb.ChatMessage:
    if not isinstance(message, dict):
        raise ApiError(
            400,
            f"Invalid type for '{where}': expected an object, but got {kind_of(message)} instead.",
            param=where,
            code="invalid_type",
        )
    role_name = message.get("role")
    role = _ROLES.get(role_name) if isinstance(role_name, str) else None
    if role is None:
        allowed = "'system', 'developer', 'user', 'assistant', 'tool'"
        raise ApiError(
            400,
            f"Invalid value: {show(role_name)}. Supported values are: {allowed}.",
            param=f"{where}.role",
            code="invalid_value",
        )
    result = pb.ChatMessage(role=role)
    content = message.get("content")
    if isinstance(content, str):
        result.content.append(pb.ContentPart(text=content))
    elif isinstance(content, list):
        for index, part in enumerate(content):
            result.content.append(_part(part, f"{where}.content[{index}]"))
    elif content is not None:
        raise ApiError(
            400,
            f"Invalid type for '{where}.content': expected a string or an array, but got {kind_of(content)} instead.",
            param=f"{where}.content",
            code="invalid_type",
        )
    elif not message.get("tool_calls") and role_name != "assistant":
        raise missing(f"{where}.content")
    if isinstance(name := message.get("name"), str):
        result.name = name
    for index, call in enumerate(message.get("tool_calls") or []):
        result.tool_calls.append(_tool_call(call, f"{where}.tool_calls[{index}]"))
    if role == pb.ROLE_TOOL:
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise missing(f"{where}.tool_call_id")
        result.tool_call_id = call_id
    return result


def _part(part: Any, where: str) -> pb.ContentPart:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return pb.ContentPart(text=part["text"])
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return pb.ContentPart(text=part["refusal"])
    if kind == "image_url" and isinstance(image := part.get("image_url"), dict) and isinstance(image.get("url"), str):
        return pb.ContentPart(image_url=pb.ImageUrl(url=image["url"], detail=str(image.get("detail") or "")))
    if kind == "input_audio" and isinstance(audio := part.get("input_audio"), dict):
        return pb.ContentPart(
            input_audio=pb.InputAudio(data=str(audio.get("data", "")), format=str(audio.get("format", "")))
        )
    raise ApiError(400, f"Invalid content part: {show(part)}", param=where, code="invalid_value")


def _tool_call(call: Any, where: str) -> pb.ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"Invalid tool call: {show(call)}", param=where, code="invalid_value")
    arguments = function.get("arguments", "")
    return pb.ToolCall(
        id=str(call.get("id", "")),
        type=str(call.get("type", "function")),
        function=pb.FunctionCall(
            name=function["name"], arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)
        ),
    )


def _struct(fields: Mapping[str, Any]) -> Struct:
    struct = Struct()
    struct.update(fields)
    return struct


_KINDS: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a decimal"),
    (str, "a string"),
    (list, "an array"),
)


def kind_of(value: Any) -> str:
    """A JSON value's type as OpenAI's errors name it (``a string``, ``null``)."""
    if value is None:
        return "null"
    return next((name for kind, name in _KINDS if isinstance(value, kind)), "an object")


def _a(kind_name: str) -> str:
    return ("an " if kind_name[0] in "aeiou" else "a ") + kind_name


def show(value: Any) -> str:
    """A client's value as an error message echoes it: JSON, cut to 80 characters."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
