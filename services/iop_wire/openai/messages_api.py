"""Anthropic's Messages API over IOP, beside the OpenAI shapes: a request body in as the run.request a
chat completion makes, the run's events out as Anthropic's ``Message`` and stream events, errors in
Anthropic's shape.

One run underneath: ``POST /v1/messages`` is a RUN_KIND_CHAT run whose messages and tools are chat
completions' (tools as ``{"type": "function", "function": {...}}`` in ``openai_fields``), so
admission, fairness, limits, cancellation, usage, the ledger and failover are the chat's;
``/v1/messages/count_tokens`` is the same mapping as a RUN_KIND_COUNT_TOKENS run. Every field is
checked here, a problem a 400 whose message starts with the field's path (``messages.0.role: ...``)
as Anthropic's do. Fields only about Anthropic's platform (service_tier, container, cache_control,
...) are accepted and ignored; those no IOP backend can honour (thinking, server tools, MCP servers)
are refused naming them: ignoring them would mislead.

The run says neither which stop sequence matched nor the prompt's size before it ends, so
``stop_sequence`` is always null (a matched sequence ends the turn as ``end_turn``), and a stream's
``message_start`` counts 0 input tokens: the count comes in ``message_delta``'s usage.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.struct_pb2 import Struct

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.openai.errors import ApiError
from iop_wire.openai.requests import (
    ANTHROPIC_TOOL_NAME,
    MAX_MODEL_NAME,
    MAX_STOP,
    MAX_TOKENS,
    function_tool,
    kind_of,
    tool_choice_sent,
    tool_name_problem,
)
from iop_wire.openai.responses import Outcome, json_bytes

__all__ = [
    "MAX_TOKENS",
    "MessageStream",
    "MessagesRequest",
    "count_request",
    "error_body",
    "error_status",
    "message_body",
    "messages_request",
]

_FIELDS = frozenset(
    {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k"}
    | {"tools", "tool_choice", "metadata", "thinking", "mcp_servers", "output_config"}
)
_IGNORED = frozenset(
    {"service_tier", "container", "cache_control", "inference_geo", "speed", "diagnostics", "user_profile_id"}
    | {"workspace_id", "context_management"}
)
"""Fields about Anthropic's platform, not the model: accepted, not used."""
_ROLES = {"user": pb.ROLE_USER, "assistant": pb.ROLE_ASSISTANT, "system": pb.ROLE_SYSTEM}
"""Roles of ``messages`` (system: text blocks only, as the top-level ``system``)."""
_STOP = {
    pb.FINISH_REASON_LENGTH: "max_tokens",
    pb.FINISH_REASON_TOOL_CALLS: "tool_use",
    pb.FINISH_REASON_CONTENT_FILTER: "refusal",
}
"""Anthropic's stop_reason per finish reason; anything else (STOP, a stop sequence met) is ``end_turn``."""
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
"""Anthropic's error type per status; other 4xx are ``invalid_request_error``, other 5xx ``api_error``."""
"""A tool's name as Anthropic takes it."""
_INDEX = re.compile(r"\[(\d+)\]")
"""A list index in OpenAI's path style (``messages[0]``), Anthropic's being ``messages.0``."""


@dataclass(slots=True)
class MessagesRequest:
    """A Messages request, checked."""

    request: pb.RunRequest
    stream: bool


def messages_request(data: Mapping[str, Any], run_id: str) -> MessagesRequest:
    """``POST /v1/messages``'s body (from ``parse_body``) as a chat run.request."""
    request = _request(data, run_id, pb.RUN_KIND_CHAT)
    request.sampling.max_tokens = _integer(data, "max_tokens", low=1, high=MAX_TOKENS, required=True)
    _sampling(data, request.sampling)
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid("stream", f"Input should be a valid boolean, got {kind_of(stream)}")
    request.stream = bool(stream)
    return MessagesRequest(request, bool(stream))


_NOT_COUNTED = frozenset(
    {"max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences", "metadata", "service_tier"}
)
"""Fields of a create that Anthropic's count_tokens does not take (it takes model, messages, system, tools,
tool_choice, thinking and a few more): an extra input there, as Anthropic answers them."""


def count_request(data: Mapping[str, Any], run_id: str) -> pb.RunRequest:
    """``POST /v1/messages/count_tokens``'s body as a count run: the same mapping, without max_tokens and
    the other fields about generating (a 400, as Anthropic's)."""
    for name in data:
        if name in _NOT_COUNTED:
            raise _invalid(name, "Extra inputs are not permitted")
    return _request(data, run_id, pb.RUN_KIND_COUNT_TOKENS)


def _request(data: Mapping[str, Any], run_id: str, kind: pb.RunKind.ValueType) -> pb.RunRequest:
    for name in data:
        if name not in _FIELDS and name not in _IGNORED:
            raise _invalid(_shown(name), "Extra inputs are not permitted")
    _refuse_unsupported(data)
    request = pb.RunRequest(run_id=run_id, model=_model(data), kind=kind)
    if (system := data.get("system")) is not None:
        request.messages.append(pb.ChatMessage(role=pb.ROLE_SYSTEM, content=_system(system)))
    messages = data.get("messages")
    if messages is None:
        raise _invalid("messages", "Field required")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "Input should be a non-empty list of messages")
    for index, message in enumerate(messages):
        request.messages.extend(_message(message, f"messages.{index}"))
    fields = _tools(data)
    if (output := data.get("output_config")) is not None:
        fields.update(_output_config(output))
    if fields:
        struct = Struct()
        struct.update(fields)
        request.openai_fields.CopyFrom(struct)
    metadata = data.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _invalid("metadata", f"Input should be an object, got {kind_of(metadata)}")
    user = (metadata or {}).get("user_id")
    if user is not None and not isinstance(user, str):
        raise _invalid("metadata.user_id", f"Input should be a valid string, got {kind_of(user)}")
    if user:
        request.metadata["user"] = user
    return request


def _invalid(where: str, problem: str) -> ApiError:
    """A 400 as Anthropic words it: the field's path, then the problem."""
    return ApiError(400, f"{where}: {problem}", param=where)


def _shown(name: str) -> str:
    """A client's field name as echoed in an error: a megabyte one is not."""
    return name if len(name) <= 64 else name[:61] + "..."


def _refuse_unsupported(data: Mapping[str, Any]) -> None:
    thinking = data.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise _invalid("thinking", "extended thinking is not supported by this server; omit it or send type disabled")
    if data.get("mcp_servers"):
        raise _invalid("mcp_servers", "MCP servers are not supported by this server: declare client tools instead")


def _model(data: Mapping[str, Any]) -> str:
    model = data.get("model")
    if model is None:
        raise _invalid("model", "Field required")
    if not isinstance(model, str) or not model:
        raise _invalid("model", f"Input should be a non-empty string, got {kind_of(model)}")
    if len(model) > MAX_MODEL_NAME:
        raise _invalid("model", f"{len(model)} characters, over the {MAX_MODEL_NAME} a name may have")
    return model


def _integer(data: Mapping[str, Any], name: str, *, low: int, high: int | None = None, required: bool = False) -> int:
    value = data.get(name)
    if value is None and required:
        raise _invalid(name, "Field required")
    if value is None:
        return low
    if not isinstance(value, int) or isinstance(value, bool):
        raise _invalid(name, f"Input should be a valid integer, got {kind_of(value)}")
    if value < low:
        raise _invalid(name, f"Input should be greater than or equal to {low}, got {value}")
    if high is not None and value > high:
        raise _invalid(name, f"Input should be less than or equal to {high}, got {value}")
    return value


def _sampling(data: Mapping[str, Any], sampling: pb.Sampling) -> None:
    for name in ("temperature", "top_p"):  # both 0 to 1 in Anthropic's API
        value = data.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise _invalid(name, f"Input should be a valid number, got {kind_of(value)}")
        if not 0 <= value <= 1:
            raise _invalid(name, f"Input should be between 0 and 1, got {value}")
        setattr(sampling, name, float(value))
    if (top_k := _integer(data, "top_k", low=0, high=MAX_TOKENS)) > 0:  # 0: no top-k cut; int32 on the wire
        sampling.top_k = top_k
    stop = data.get("stop_sequences")
    if stop is None:
        return
    if not isinstance(stop, list) or not all(isinstance(item, str) and item for item in stop):
        raise _invalid("stop_sequences", "Input should be a list of non-empty strings")
    if len(stop) > MAX_STOP:
        message = f"{len(stop)} stop sequences, over the {MAX_STOP} one request may have on this server"
        raise _invalid("stop_sequences", message)
    sampling.stop.extend(stop)


# -- messages and content blocks ------------------------------------------------------------


def _system(system: Any) -> list[pb.ContentPart]:
    if isinstance(system, str):
        return [pb.ContentPart(text=system)]
    if not isinstance(system, list):
        raise _invalid("system", f"Input should be a string or a list of text blocks, got {kind_of(system)}")
    parts = []
    for index, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _invalid(f"system.{index}", "Input should be a text block")
        parts.append(pb.ContentPart(text=block["text"]))
    return parts


def _message(message: Any, where: str) -> list[pb.ChatMessage]:
    """One Anthropic message as chat messages: a user message's tool_result blocks become tool messages,
    before a user message with the rest of its blocks (if any)."""
    if not isinstance(message, dict):
        raise _invalid(where, f"Input should be an object, got {kind_of(message)}")
    for name in message:
        if name not in ("role", "content"):
            raise _invalid(f"{where}.{_shown(name)}", "Extra inputs are not permitted")
    role = message.get("role")
    if role not in _ROLES:
        raise _invalid(f"{where}.role", f"Input should be 'user', 'assistant' or 'system', got {json.dumps(role)[:40]}")
    content = message.get("content")
    if content is None:
        raise _invalid(f"{where}.content", "Field required")
    if isinstance(content, str):
        return [pb.ChatMessage(role=_ROLES[role], content=[pb.ContentPart(text=content)])]
    if not isinstance(content, list):
        raise _invalid(f"{where}.content", f"Input should be a string or a list of blocks, got {kind_of(content)}")
    results: list[pb.ChatMessage] = []
    main = pb.ChatMessage(role=_ROLES[role])
    for index, block in enumerate(content):
        _block(block, role, f"{where}.content.{index}", main, results)
    if main.content or main.tool_calls or not results:
        results.append(main)
    return results


def _block(block: Any, role: str, where: str, main: pb.ChatMessage, results: list[pb.ChatMessage]) -> None:
    """One content block added to ``main`` (text, image, tool_use) or to ``results`` (a tool_result)."""
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(block, dict) or not isinstance(kind, str):
        raise _invalid(where, "Input should be a content block (an object with a type)")
    if kind == "text":
        main.content.append(pb.ContentPart(text=_string(block, "text", where)))
    elif kind == "image" and role == "user":
        main.content.append(pb.ContentPart(image_url=pb.ImageUrl(url=_image(block.get("source"), f"{where}.source"))))
    elif kind == "tool_use" and role == "assistant":
        tool_input = block.get("input")
        if not isinstance(tool_input, dict):
            raise _invalid(f"{where}.input", f"Input should be an object, got {kind_of(tool_input)}")
        function = pb.FunctionCall(name=_string(block, "name", where), arguments=json.dumps(tool_input))
        main.tool_calls.append(pb.ToolCall(id=_string(block, "id", where), type="function", function=function))
    elif kind == "tool_result" and role == "user":
        results.append(_tool_result(block, where))
    elif kind in ("thinking", "redacted_thinking") and role == "assistant":
        pass  # an earlier turn's reasoning, from a server that thinks: not part of the conversation's text
    else:
        allowed = {"user": "text, image, tool_result", "assistant": "text, tool_use"}.get(role, "text")
        message = f"block type {json.dumps(kind)[:60]} is not supported in a {role} message here (only {allowed})"
        raise _invalid(f"{where}.type", message)


def _string(block: Mapping[str, Any], name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise _invalid(f"{where}.{name}", "Field required" if value is None else "Input should be a valid string")
    return value


def _image(source: Any, where: str) -> str:
    """An image block's source as a URL (a data: URL for base64 data)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media_type = _string(source, "media_type", where)
        return f"data:{media_type};base64,{_string(source, 'data', where)}"
    if kind == "url" and isinstance(source, dict):
        return _string(source, "url", where)
    raise _invalid(f"{where}.type", "image sources of type base64 and url are supported")


def _tool_result(block: Mapping[str, Any], where: str) -> pb.ChatMessage:
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _invalid(f"{where}.content.{index}.type", "only text blocks are supported in a tool_result")
            texts.append(_string(part, "text", f"{where}.content.{index}"))
        text = "\n".join(texts)
    else:
        raise _invalid(f"{where}.content", f"Input should be a string or a list of blocks, got {kind_of(content)}")
    if block.get("is_error") is True:
        text = f"Error: {text}"  # chat has no such flag: the model reads it in the text
    return pb.ChatMessage(
        role=pb.ROLE_TOOL, content=[pb.ContentPart(text=text)], tool_call_id=_string(block, "tool_use_id", where)
    )


# -- tools ------------------------------------------------------------------------------------


def _tools(data: Mapping[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in chat completions' shape (the fields for ``openai_fields``)."""
    tools = data.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise _invalid("tools", f"Input should be a list of tools, got {kind_of(tools)}")
    functions = [_tool(tool, f"tools.{index}") for index, tool in enumerate(tools)]
    names = [function["function"]["name"] for function in functions]
    if (problem := tool_name_problem(names, longest=ANTHROPIC_TOOL_NAME)) is not None:
        index, why = problem
        raise _invalid(f"tools.{index}.name", why)
    fields: dict[str, Any] = {"tools": functions} if functions else {}
    choice = data.get("tool_choice")
    if choice is None:
        return fields
    kind = choice.get("type") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or kind not in ("auto", "any", "tool", "none"):
        raise _invalid("tool_choice", "Input should be an object of type auto, any, tool or none")
    try:  # auto and none without tools: dropped, as what no tools mean anyway
        if tool_choice_sent({"any": "required", "tool": "required"}.get(kind, kind), bool(functions)) is None:
            return fields
    except ValueError:
        raise _invalid("tool_choice", f"tool_choice {kind} needs tools") from None
    if kind == "tool":
        name = _string(choice, "name", "tool_choice")
        if name not in {function["function"]["name"] for function in functions}:
            raise _invalid("tool_choice.name", f"{json.dumps(name)[:80]} is not one of the request's tools")
        fields["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        fields["tool_choice"] = {"any": "required"}.get(kind, kind)
    if choice.get("disable_parallel_tool_use") is True:
        fields["parallel_tool_calls"] = False
    return fields


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise _invalid(where, f"Input should be an object, got {kind_of(tool)}")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        message = f"{json.dumps(kind)[:60]}: server tools are not supported; declare a client tool (name, input_schema)"
        raise _invalid(f"{where}.type", message)
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise _invalid(f"{where}.input_schema", "Field required" if schema is None else "Input should be an object")
    name = _string(tool, "name", where)  # its characters and length: tool_name_problem, for all the tools
    return function_tool(name, schema, tool.get("description"), tool.get("strict"))


def _output_config(output: Any) -> dict[str, Any]:
    """Structured output (``format`` of type json_schema) as chat's response_format; ``effort`` is a hint
    about thinking, which IOP does not do: ignored."""
    if not isinstance(output, dict):
        raise _invalid("output_config", f"Input should be an object, got {kind_of(output)}")
    wanted = output.get("format")
    if wanted is None:
        return {}
    schema = wanted.get("schema") if isinstance(wanted, dict) and wanted.get("type") == "json_schema" else None
    if not isinstance(schema, dict):
        raise _invalid("output_config.format", "Input should be an object of type json_schema with a schema")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}}


# -- answers ----------------------------------------------------------------------------------


def stop_reason(complete: pb.RunComplete) -> str:
    """Anthropic's stop_reason for how the run ended."""
    return _STOP.get(complete.finish_reason, "end_turn")


def usage_body(usage: pb.Usage) -> dict[str, int]:
    """Anthropic's Usage: its input_tokens leave out those read from a cache (OpenAI's prompt_tokens count them)."""
    return {
        "input_tokens": usage.prompt_tokens - min(usage.cached_tokens, usage.prompt_tokens),
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def message_body(run_id: str, model: str, outcome: Outcome, complete: pb.RunComplete) -> dict[str, Any]:
    """A whole Message: the text as one text block, then a tool_use block per tool call."""
    content: list[dict[str, Any]] = []
    if text := "".join(outcome.text):
        content.append({"type": "text", "text": text})
    for call in outcome.calls():
        function = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": _input(function)})
    return {
        "id": f"msg_{run_id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(complete),
        "stop_sequence": None,
        "usage": usage_body(complete.usage),
    }


def _input(function: Mapping[str, str]) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's ``input`` is ({} when they are not one, as a call
    cut by max_tokens: its partial JSON is only in a stream's input_json_delta events)."""
    try:
        value = json.loads(function["arguments"] or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json_bytes({"type": kind, **payload}) + b"\n\n"


class MessageStream:
    """Anthropic's stream events of one run (``app.Chunks``): message_start and ping, then a content block
    per text run or tool call (start, deltas, stop), then message_delta and message_stop.

    A run may interleave its tool calls' fragments (call 0, call 1, call 0 again: parallel calls from
    one backend): each call's block stays open until the message ends, so a later fragment of an
    earlier call is one more input_json_delta at that call's block index. A text block closes when a
    tool call starts (text after it is a new block)."""

    __slots__ = ("_blocks", "_head", "_text", "_tools")

    def __init__(self, run_id: str, model: str) -> None:
        self._head = {"id": f"msg_{run_id}", "type": "message", "role": "assistant", "model": model}
        self._blocks = 0
        """Content blocks started."""
        self._text: int | None = None
        """The open text block's index, if one is open."""
        self._tools: dict[int, int] = {}
        """Each tool call's block index by the call's index (all open until the message ends)."""

    def first(self) -> bytes:
        """message_start (input tokens unknown until the run ends: 0 here, counted in message_delta), ping."""
        message: dict[str, Any] = {**self._head, "content": [], "stop_reason": None, "stop_sequence": None}
        message["usage"] = usage_body(pb.Usage())
        return _event("message_start", {"message": message}) + _event("ping", {})

    def delta(self, delta: pb.RunDelta) -> bytes:
        """text_delta events in a text block; a tool call's fragments as input_json_delta in its tool_use block."""
        out: list[bytes] = []
        if delta.text:
            if self._text is None:
                self._text = self._blocks
                out.append(self._start({"type": "text", "text": ""}))
            body = {"type": "text_delta", "text": delta.text}
            out.append(_event("content_block_delta", {"index": self._text, "delta": body}))
        for fragment in delta.tool_calls:
            block = self._tools.get(fragment.index)
            if block is None:
                out.append(self._stop_text())
                block = self._tools[fragment.index] = self._blocks
                tool_use = {"type": "tool_use", "id": fragment.id, "name": fragment.function_name, "input": {}}
                out.append(self._start(tool_use))
            if fragment.arguments:
                body = {"type": "input_json_delta", "partial_json": fragment.arguments}
                out.append(_event("content_block_delta", {"index": block, "delta": body}))
        return b"".join(out)

    def _start(self, block: dict[str, Any]) -> bytes:
        self._blocks += 1
        return _event("content_block_start", {"index": self._blocks - 1, "content_block": block})

    def _stop_text(self) -> bytes:
        if self._text is None:
            return b""
        index, self._text = self._text, None
        return _event("content_block_stop", {"index": index})

    def last(self, complete: pb.RunComplete) -> bytes:
        """Every open block's stop (in index order), message_delta with the stop reason and the whole usage,
        message_stop."""
        open_blocks = sorted([*self._tools.values(), *([] if self._text is None else [self._text])])
        self._text, self._tools = None, {}
        stops = b"".join(_event("content_block_stop", {"index": index}) for index in open_blocks)
        delta = {"stop_reason": stop_reason(complete), "stop_sequence": None}
        end = _event("message_delta", {"delta": delta, "usage": usage_body(complete.usage)})
        return stops + end + _event("message_stop", {})

    def error(self, error: ApiError) -> bytes:
        """A failure after the stream started: an ``error`` event with Anthropic's error body."""
        return _event("error", {"error": error_body(error)["error"]})

    def cancelled(self) -> None:
        """The client left mid-stream: nothing is kept of a Messages stream."""


# -- errors -----------------------------------------------------------------------------------


_OVERLOADED = frozenset({"too_many_requests", "queue_full"})
"""Codes of a 429 that says the platform is busy (the edge's ``http.max_in_flight``, the model's queue
full), not that the key went over its own limits."""


def error_status(error: ApiError) -> int:
    """The HTTP status Anthropic's clients expect: IOP's 503 (no capacity now: no node ready, shutting
    down) and a 429 of the platform's own load (the edge's ``http.max_in_flight``, the model's queue
    full) are Anthropic's 529 overloaded_error, which their SDKs and tools retry as such; a 429 of the
    key's own limits stays a rate_limit_error."""
    if error.status == 503 or (error.status == 429 and error.code in _OVERLOADED):
        return 529
    return error.status


def error_body(error: ApiError, request_id: str = "") -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}, "request_id"}`` for ``error``."""
    status = error_status(error)
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    message = _worded(error)
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": request_id or None}


def _worded(error: ApiError) -> str:
    """The message of ``error`` as Anthropic words a field's problem (``messages.0.content: ...``) when it
    comes from the body's checks shared with the OpenAI routes (``parse_body``: a lone surrogate, a value
    nested too deep, NaN), which name the field in OpenAI's style (``Invalid value for 'messages[0].content'``)."""
    where = error.param
    if error.code != "invalid_value" or not where:
        return error.message
    path = _INDEX.sub(r".\1", where)
    for head in (f"Invalid value for '{where}': ", f"'{where}' is "):
        if error.message.startswith(head):
            return f"{path}: {error.message.removeprefix(head)}"
    return error.message
