"""OpenAI's Responses API (``POST /v1/responses``) mapped onto the same run as chat completions.

A ``CreateResponse`` body becomes a ``RUN_KIND_CHAT`` run.request built exactly as a chat
completion's: messages made the way :mod:`iop_wire.openai.requests` makes them, tools,
tool_choice and the text format in ``openai_fields`` in chat completions' shape (nodes see one
shape), ``max_output_tokens`` as ``sampling.max_tokens``. So admission, limits, cancellation,
usage and failover are the chat path's. The run's events come back as a ``Response`` object, or
as the Responses event stream (:class:`ResponseEvents`).

Input items are kept in their stored form (``ItemResource``: every item with an ``id`` and a
``status``), which is what ``GET /v1/responses/{id}/input_items`` lists and what a later
``previous_response_id`` replays. Fields the platform cannot honour (hosted tools, background
mode, stored prompts, conversations) are a 400 naming the field; fields about OpenAI's platform
only (service tier, prompt cache keys) are accepted and ignored, as for chat completions.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.openai import requests as chat
from iop_wire.openai.errors import ApiError
from iop_wire.openai.responses import Outcome, json_bytes

__all__ = [
    "ResponseEvents",
    "ResponsesRequest",
    "conversation",
    "new_id",
    "parse_create",
    "response_body",
    "run_request",
]

_HANDLED = {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p"}
_HANDLED |= {"text", "stream", "store", "previous_response_id", "metadata", "parallel_tool_calls", "user"}
_HANDLED |= {"reasoning", "include", "truncation", "background", "stream_options", "max_tool_calls", "top_logprobs"}
_IGNORED = {"service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options"}
"""About OpenAI's platform, not the model: accepted, not used."""
_REFUSED = {
    "prompt": "stored prompt templates are not kept by this server: send the input itself",
    "conversation": "conversations are not kept by this server: use previous_response_id",
    "moderation": "moderation is not run by this server",
    "context_management": "context management (compaction) is not done by this server",
}
_NOTHING_TO_INCLUDE = {
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
}
"""``include`` values about items this server never produces (hosted tools, reasoning): nothing to add."""
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_ROLES = {"user": pb.ROLE_USER, "system": pb.ROLE_SYSTEM, "developer": pb.ROLE_DEVELOPER}
_TOOL_CHOICES = ("none", "auto", "required")
_FORMATS = ("text", "json_object", "json_schema")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def new_id(prefix: str) -> str:
    """An object id as OpenAI's look: ``<prefix>_`` and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass(slots=True)
class ResponsesRequest:
    """A ``CreateResponse`` body, checked; the run is built once ``previous_response_id`` is resolved."""

    model: str
    input_items: list[dict[str, Any]]
    """This request's input, as stored items (ids included)."""
    stream: bool
    store: bool
    previous_response_id: str | None
    instructions: str | None
    sampling: pb.Sampling
    openai_fields: dict[str, Any]
    """tools, tool_choice, response_format, ... in chat completions' shape."""
    echo: dict[str, Any] = field(default_factory=dict)
    """The request's fields as the Response object repeats them."""
    user: str = ""


def parse_create(data: Mapping[str, Any]) -> ResponsesRequest:
    """A ``CreateResponse`` body checked (``data`` from ``requests.parse_body``); 400 naming the field otherwise."""
    chat.known_fields(data, _HANDLED | _IGNORED | _REFUSED.keys())
    for name, why in _REFUSED.items():
        if data.get(name) is not None:
            raise ApiError(400, f"'{name}' is not supported: {why}.", param=name, code="unsupported_parameter")
    if data.get("background"):
        message = "'background' is not supported: responses are made while the request waits (stream for progress)."
        raise ApiError(400, message, param="background", code="unsupported_parameter")
    model = chat._model(data)
    sampling = pb.Sampling()
    chat._sampling(_sampling_fields(data), sampling, max_tokens=("max_output_tokens",))
    fields: dict[str, Any] = {}
    tools = _tools(data.get("tools"))
    if tools:
        fields["tools"] = [_chat_tool(tool) for tool in tools]
    tool_choice = _tool_choice(data.get("tool_choice"), tools)
    if tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(tool_choice)
    parallel = _flag(data, "parallel_tool_calls")
    if parallel is not None and tools:
        fields["parallel_tool_calls"] = parallel
    text = _text(data.get("text"))
    if (text_format := text["format"])["type"] != "text":
        fields["response_format"] = _chat_format(text_format)
    reasoning = _reasoning(data.get("reasoning"))
    if reasoning and reasoning.get("effort"):
        fields["reasoning_effort"] = reasoning["effort"]
    _check_rest(data)
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid_type("instructions", "a string", instructions)
    previous = data.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _invalid_type("previous_response_id", "a string", previous)
    metadata = _metadata(data.get("metadata"))
    store = _flag(data, "store") is not False
    echo = {
        "instructions": instructions,
        "tools": tools,
        "tool_choice": tool_choice if tool_choice is not None else "auto",
        "temperature": sampling.temperature if sampling.HasField("temperature") else 1.0,
        "top_p": sampling.top_p if sampling.HasField("top_p") else 1.0,
        "max_output_tokens": data.get("max_output_tokens"),
        "parallel_tool_calls": True if parallel is None else parallel,
        "previous_response_id": previous,
        "metadata": metadata,
        "reasoning": reasoning,
        "text": text,
        "truncation": "disabled",
        "store": store,
        "background": False,
        "service_tier": "default",
        "top_logprobs": 0,
    }
    user = data.get("user") if isinstance(data.get("user"), str) else ""
    if user:
        echo["user"] = user
    return ResponsesRequest(
        model=model,
        input_items=_input_items(data.get("input")),
        stream=bool(_flag(data, "stream")),
        store=store,
        previous_response_id=previous,
        instructions=instructions,
        sampling=sampling,
        openai_fields=fields,
        echo=echo,
        user=user or "",
    )


def run_request(parsed: ResponsesRequest, run_id: str, history: list[dict[str, Any]]) -> pb.RunRequest:
    """The chat run of ``parsed``: its instructions, then ``history`` (the items of the previous
    responses), then its own input items, as chat messages."""
    request = pb.RunRequest(run_id=run_id, model=parsed.model, kind=pb.RUN_KIND_CHAT, stream=parsed.stream)
    if parsed.instructions:
        request.messages.append(pb.ChatMessage(role=pb.ROLE_SYSTEM, content=[pb.ContentPart(text=parsed.instructions)]))
    request.messages.extend(_messages([*history, *parsed.input_items]))
    if not request.messages:
        raise ApiError(400, "Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    request.sampling.CopyFrom(parsed.sampling)
    if parsed.openai_fields:
        request.openai_fields.update(parsed.openai_fields)
    if parsed.user:
        request.metadata["user"] = parsed.user
    return request


def conversation(
    history: list[dict[str, Any]], parsed: ResponsesRequest, body: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The items a response continued with ``previous_response_id`` replays: the earlier ones, this
    request's input and this response's output (instructions are not carried, as OpenAI does)."""
    return [*history, *parsed.input_items, *body["output"]]


# -- the request's fields ---------------------------------------------------------------------


def _sampling_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """The fields chat's sampling checks read (and only those: stop, seed, penalties are not Responses fields)."""
    return {name: data[name] for name in ("temperature", "top_p", "max_output_tokens") if name in data}


def _flag(data: Mapping[str, Any], name: str) -> bool | None:
    value = data.get(name)
    if value is not None and not isinstance(value, bool):
        raise _invalid_type(name, "a boolean", value)
    return value


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _invalid_type("tools", "an array", tools)
    checked = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _invalid_type(where, "an object", tool)
        kind = tool.get("type")
        if kind != "function":
            message = (
                f"Tool type {chat._show(kind)} is not supported by this server: only function tools "
                "(hosted tools such as web search, file search and code interpreter run at OpenAI)."
            )
            raise ApiError(400, message, param=f"{where}.type", code="unsupported_parameter")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(
                400,
                f"Missing required parameter: '{where}.name'.",
                param=f"{where}.name",
                code="missing_required_parameter",
            )
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _invalid_type(f"{where}.parameters", "an object", parameters)
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _invalid_type(f"{where}.strict", "a boolean", strict)
        description = tool.get("description")
        checked.append(
            {"type": "function", "name": name, "description": description, "parameters": parameters, "strict": strict}
        )
    return checked


def _chat_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "parameters": tool["parameters"] or {"type": "object", "properties": {}}}
    if tool["description"] is not None:
        function["description"] = tool["description"]
    if tool["strict"] is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any] | None:
    if choice is None or (isinstance(choice, str) and choice in _TOOL_CHOICES):
        return str(choice) if choice is not None else None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or name not in {tool["name"] for tool in tools}:
            message = f"Tool choice names the function {chat._show(name)}, which is not in 'tools'."
            raise ApiError(400, message, param="tool_choice", code="invalid_value")
        return {"type": "function", "name": name}
    message = (
        f"Invalid value for 'tool_choice': {chat._show(choice)}. This server takes 'none', 'auto', 'required' "
        'or {"type": "function", "name": ...}.'
    )
    raise ApiError(400, message, param="tool_choice", code="invalid_value")


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice["name"]}}


def _text(text: Any) -> dict[str, Any]:
    if text is None:
        return {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise _invalid_type("text", "an object", text)
    chat.known_fields(text, {"format", "verbosity"})
    given = text.get("format") or {"type": "text"}
    kind = given.get("type") if isinstance(given, dict) else None
    if kind not in _FORMATS:
        message = f"Invalid value: {chat._show(kind)}. Supported values are: 'text', 'json_object' and 'json_schema'."
        raise ApiError(400, message, param="text.format.type", code="invalid_value")
    if kind == "json_schema":
        for name, expected in (("name", str), ("schema", dict)):
            if not isinstance(given.get(name), expected):
                raise ApiError(
                    400,
                    f"Missing required parameter: 'text.format.{name}'.",
                    param=f"text.format.{name}",
                    code="missing_required_parameter",
                )
    checked = {"format": dict(given)}
    if text.get("verbosity") is not None:
        checked["verbosity"] = text["verbosity"]
    return checked


def _chat_format(text_format: Mapping[str, Any]) -> dict[str, Any]:
    if text_format["type"] == "json_object":
        return {"type": "json_object"}
    schema = {key: text_format[key] for key in ("name", "schema", "description", "strict") if key in text_format}
    return {"type": "json_schema", "json_schema": schema}


def _reasoning(reasoning: Any) -> dict[str, Any] | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise _invalid_type("reasoning", "an object", reasoning)
    effort = reasoning.get("effort")
    if effort is not None and effort not in _EFFORTS:
        allowed = ", ".join(f"'{name}'" for name in _EFFORTS)
        message = f"Invalid value: {chat._show(effort)}. Supported values are: {allowed}."
        raise ApiError(400, message, param="reasoning.effort", code="invalid_value")
    return {"effort": effort, "summary": None}


def _check_rest(data: Mapping[str, Any]) -> None:
    """The fields that are fine only with values that change nothing here."""
    truncation = data.get("truncation")
    if truncation not in (None, "disabled"):
        message = "'truncation' 'auto' is not supported: an input over the model's context is refused, never cut."
        raise ApiError(400, message, param="truncation", code="unsupported_parameter")
    include = data.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(item, str) for item in include):
            raise _invalid_type("include", "an array of strings", include)
        for item in include:
            if item not in _NOTHING_TO_INCLUDE:
                raise ApiError(
                    400,
                    f"include {item!r} is not supported by this server",
                    param="include",
                    code="unsupported_parameter",
                )
    if data.get("top_logprobs"):
        raise ApiError(400, "'top_logprobs' is not supported for responses", param="top_logprobs")
    if (limit := data.get("max_tool_calls")) is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
        raise _invalid_type("max_tool_calls", "an integer", limit)
    if (options := data.get("stream_options")) is not None and not isinstance(options, dict):
        raise _invalid_type("stream_options", "an object", options)


def _metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise _invalid_type("metadata", "an object of strings", metadata)
    if len(metadata) > 16 or any(len(key) > 64 or len(value) > 512 for key, value in metadata.items()):
        message = "Invalid 'metadata': at most 16 pairs, keys up to 64 characters, values up to 512."
        raise ApiError(400, message, param="metadata", code="invalid_value")
    return dict(metadata)


def _invalid_type(name: str, expected: str, value: Any) -> ApiError:
    return ApiError(
        400,
        f"Invalid type for '{name}': expected {expected}, but got {chat.kind_of(value)} instead.",
        param=name,
        code="invalid_type",
    )


# -- input items ----------------------------------------------------------------------------


def _input_items(given: Any) -> list[dict[str, Any]]:
    if given is None:
        return []
    if isinstance(given, str):
        return [_message_item("user", given, "input")]
    if not isinstance(given, list):
        raise _invalid_type("input", "a string or an array", given)
    return [_input_item(item, f"input[{index}]") for index, item in enumerate(given)]


def _input_item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise _invalid_type(where, "an object", item)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _MESSAGE_ROLES:
            allowed = "'assistant', 'system', 'developer', and 'user'"
            message = f"Invalid value: {chat._show(role)}. Supported values are: {allowed}."
            raise ApiError(400, message, param=f"{where}.role", code="invalid_value")
        return _message_item(role, item.get("content"), f"{where}.content")
    if kind == "function_call":
        call_id, name, arguments = (_string(item, key, where) for key in ("call_id", "name", "arguments"))
        return {
            "id": _given_id(item, "fc"),
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": "completed",
        }
    if kind == "function_call_output":
        call_id = _string(item, "call_id", where)
        output = item.get("output")
        if isinstance(output, list):
            output = "".join(_text_of(part, f"{where}.output[{index}]") for index, part in enumerate(output))
        if not isinstance(output, str):
            raise _invalid_type(f"{where}.output", "a string", output)
        return {
            "id": _given_id(item, "fco"),
            "type": "function_call_output",
            "call_id": call_id,
            "output": output,
            "status": "completed",
        }
    if kind == "item_reference":
        message = "Item references are not supported: send the item itself, or use previous_response_id."
        raise ApiError(400, message, param=f"{where}.type", code="unsupported_parameter")
    message = (
        f"Input items of type {chat._show(kind)} are not supported by this server: "
        "messages, function_call and function_call_output are."
    )
    raise ApiError(400, message, param=f"{where}.type", code="unsupported_parameter")


def _message_item(role: str, content: Any, where: str) -> dict[str, Any]:
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts = [_text_part(part_type, content)]
    elif isinstance(content, list):
        parts = [_content_part(part, part_type, f"{where}[{index}]") for index, part in enumerate(content)]
    else:
        if content is None:
            raise ApiError(
                400, f"Missing required parameter: '{where}'.", param=where, code="missing_required_parameter"
            )
        raise _invalid_type(where, "a string or an array", content)
    return {"id": new_id("msg"), "type": "message", "role": role, "content": parts, "status": "completed"}


def _text_part(part_type: str, text: str) -> dict[str, Any]:
    if part_type == "output_text":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "input_text", "text": text}


def _content_part(part: Any, part_type: str, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "refusal", "text"):
        return _text_part(part_type, _text_of(part, where))
    if kind == "input_image" and part_type == "input_text":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            message = "Images are taken by URL (image_url) here: files are not kept by this server for input."
            raise ApiError(400, message, param=f"{where}.image_url", code="unsupported_parameter")
        return {"type": "input_image", "image_url": url, "detail": str(part.get("detail") or "auto")}
    message = f"Content of type {chat._show(kind)} is not supported here: input_text and input_image are."
    raise ApiError(400, message, param=f"{where}.type", code="unsupported_parameter")


def _text_of(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise _invalid_type(where, "an object", part)
    text = part.get("refusal") if part.get("type") == "refusal" else part.get("text")
    if not isinstance(text, str):
        raise ApiError(
            400,
            f"Missing required parameter: '{where}.text'.",
            param=f"{where}.text",
            code="missing_required_parameter",
        )
    return text


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        if value is None:
            raise ApiError(
                400,
                f"Missing required parameter: '{where}.{key}'.",
                param=f"{where}.{key}",
                code="missing_required_parameter",
            )
        raise _invalid_type(f"{where}.{key}", "a string", value)
    return value


def _given_id(item: Mapping[str, Any], prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else new_id(prefix)


def _messages(items: list[dict[str, Any]]) -> list[pb.ChatMessage]:
    """Stored items as chat messages: consecutive function calls join one assistant message."""
    messages: list[pb.ChatMessage] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            message = pb.ChatMessage(role=_ROLES.get(item["role"], pb.ROLE_ASSISTANT))
            for part in item["content"]:
                if part["type"] == "input_image":
                    message.content.append(
                        pb.ContentPart(image_url=pb.ImageUrl(url=part["image_url"], detail=part["detail"]))
                    )
                else:
                    message.content.append(pb.ContentPart(text=part["text"]))
            messages.append(message)
        elif kind == "function_call":
            call = pb.ToolCall(id=item["call_id"], type="function")
            call.function.name, call.function.arguments = item["name"], item["arguments"]
            if not messages or messages[-1].role != pb.ROLE_ASSISTANT:
                messages.append(pb.ChatMessage(role=pb.ROLE_ASSISTANT))
            messages[-1].tool_calls.append(call)
        elif kind == "function_call_output":
            messages.append(
                pb.ChatMessage(
                    role=pb.ROLE_TOOL, tool_call_id=item["call_id"], content=[pb.ContentPart(text=item["output"])]
                )
            )
    return messages


# -- the Response object --------------------------------------------------------------------


def usage_body(usage: pb.Usage) -> dict[str, Any]:
    """OpenAI's ResponseUsage."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def skeleton(response_id: str, model: str, parsed: ResponsesRequest) -> dict[str, Any]:
    """The Response while in progress: no output yet, the request's fields echoed."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": [],
        **parsed.echo,
    }


def response_body(base: Mapping[str, Any], outcome: Outcome, complete: pb.RunComplete) -> dict[str, Any]:
    """The whole Response of a run that completed (``base`` from :func:`skeleton`)."""
    output: list[dict[str, Any]] = []
    text = "".join(outcome.text)
    if text or not outcome.tool_calls:
        output.append(_message_output(new_id("msg"), text, "completed"))
    for index in sorted(outcome.tool_calls):
        call = outcome.tool_calls[index]
        output.append(_call_output(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    return finished(base, output, complete)


def finished(base: Mapping[str, Any], output: list[dict[str, Any]], complete: pb.RunComplete) -> dict[str, Any]:
    """``base`` completed (or incomplete at the token limit) with ``output`` and the run's usage."""
    body = {**base, "output": output, "usage": usage_body(complete.usage)}
    if complete.finish_reason == pb.FINISH_REASON_LENGTH:
        body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    elif complete.finish_reason == pb.FINISH_REASON_CONTENT_FILTER:
        body["status"], body["incomplete_details"] = "incomplete", {"reason": "content_filter"}
    else:
        body["status"], body["completed_at"] = "completed", int(time.time())
    if body["status"] == "incomplete":
        for item in output:
            if item["type"] == "message":
                item["status"] = "incomplete"
    return body


def failed(base: Mapping[str, Any], output: list[dict[str, Any]], error: ApiError) -> dict[str, Any]:
    """``base`` failed: ResponseError's code is one of a few (rate_limit_exceeded, else server_error)."""
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    return {**base, "status": "failed", "output": output, "error": {"code": code, "message": error.message}}


def _message_output(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part("output_text", text)]
    return {"id": item_id, "type": "message", "role": "assistant", "content": content, "status": status}


def _call_output(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


# -- the event stream -------------------------------------------------------------------------


class ResponseEvents:
    """The Responses event stream of one run (``app.Chunks``): ``event: <type>`` / ``data: <json>`` pairs,
    ``sequence_number`` counting from 0.

    response.created, response.in_progress, then per output item: output_item.added, for a message
    content_part.added, output_text.delta..., output_text.done, content_part.done; for a function
    call function_call_arguments.delta..., function_call_arguments.done; then output_item.done.
    Last: response.completed (response.incomplete at the token limit), or response.failed.
    ``ended`` is called with the final Response (to store it).
    """

    def __init__(self, base: dict[str, Any], ended: Any = None) -> None:
        self.base = base
        self.ended = ended
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        """The output item being streamed."""
        self._calls: dict[int, dict[str, Any]] = {}
        """Function-call items by the run's tool-call index."""

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + json_bytes(payload) + b"\n\n"

    def first(self) -> bytes:
        """response.created and response.in_progress."""
        return self._event("response.created", response=self.base) + self._event(
            "response.in_progress", response=self.base
        )

    def delta(self, delta: pb.RunDelta) -> bytes:
        """Text as output_text.delta events, tool-call fragments as function_call_arguments.delta
        events, opening (and closing) output items as they start."""
        out: list[bytes] = []
        if delta.text:
            if self._open is None or self._open["type"] != "message":
                out.append(self._close())
                out.append(self._open_message())
            assert self._open is not None
            self._open["content"][0]["text"] += delta.text
            out.append(
                self._event(
                    "response.output_text.delta", **self._where(), content_index=0, delta=delta.text, logprobs=[]
                )
            )
        for fragment in delta.tool_calls:
            item = self._calls.get(fragment.index)
            if item is None:
                out.append(self._close())
                item = _call_output(new_id("fc"), fragment.id, fragment.function_name, "", "in_progress")
                self._calls[fragment.index] = item
                out.append(self._add(item))
            if fragment.arguments:
                item["arguments"] += fragment.arguments
                where = {"item_id": item["id"], "output_index": self.output.index(item)}
                out.append(self._event("response.function_call_arguments.delta", **where, delta=fragment.arguments))
        return b"".join(out)

    def last(self, complete: pb.RunComplete) -> bytes:
        """The open item closed, then response.completed (or response.incomplete)."""
        out = self._close()
        if not self.output:  # a run that said nothing still answers with an (empty) message
            out += self._open_message() + self._close()
        body = finished(self.base, self.output, complete)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        if self.ended is not None:
            self.ended(body)
        return out + self._event(kind, response=body)

    def error(self, error: ApiError) -> bytes:
        """response.failed with the error (the items streamed so far as they were)."""
        body = failed(self.base, self.output, error)
        if self.ended is not None:
            self.ended(body)
        return self._event("response.failed", response=body)

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": self.output.index(self._open)}

    def _add(self, item: dict[str, Any]) -> bytes:
        self.output.append(item)
        self._open = item
        return self._event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))

    def _open_message(self) -> bytes:
        item = _message_output(new_id("msg"), "", "in_progress")
        added = self._add(item)
        part = _text_part("output_text", "")
        return added + self._event("response.content_part.added", **self._where(), content_index=0, part=part)

    def _close(self) -> bytes:
        item = self._open
        if item is None:
            return b""
        where = self._where()
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            )
            out.append(self._event("response.content_part.done", **where, content_index=0, part=_copy(part)))
        else:
            done = {"name": item["name"], "arguments": item["arguments"]}
            out.append(self._event("response.function_call_arguments.done", **where, **done))
        item["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=where["output_index"], item=_copy(item)))
        self._open = None
        return b"".join(out)


def _copy(item: Mapping[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as it is now (it changes as the stream goes on)."""
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [dict(part) for part in copied["content"]]
    return copied
