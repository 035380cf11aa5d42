"""OpenAI's Responses API (``POST /v1/responses``) mapped onto the same run as chat completions.

A ``CreateResponse`` body becomes a ``RUN_KIND_CHAT`` run.request in the shape a chat completion's
has, by a builder of its own (input items become chat messages here): tools, tool_choice and the
text format in ``openai_fields`` in chat completions' shape (nodes see one shape; the function tools,
their names and tool_choice without tools through :mod:`iop_wire.openai.requests`' helpers, as
Messages), ``max_output_tokens`` as ``sampling.max_tokens`` (checked by chat's sampling).
So admission, limits, cancellation, usage and failover are the chat path's. The run's events come
back as a ``Response`` object, or as the Responses event stream (:mod:`iop_wire.openai.responses_output`).

Input items are kept in their stored form (``ItemResource``: every item with an ``id`` and a
``status``), which is what ``GET /v1/responses/{id}/input_items`` lists and what a later
``previous_response_id`` replays. Fields the platform cannot honour (hosted tools, background
mode, stored prompts, conversations) are a 400 naming the field; fields about OpenAI's platform
only (service tier, prompt cache keys) are accepted and ignored, as for chat completions.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.openai import requests as chat
from iop_wire.openai.errors import ApiError

__all__ = ["ResponsesRequest", "conversation", "new_id", "parse_create", "run_request", "text_part"]

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
_VERBOSITIES = ("low", "medium", "high")
_DETAILS = ("auto", "low", "high", "original")
_FORMAT_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


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
    _refuse(data)
    model = chat.model(data)
    sampling = pb.Sampling()
    chat.sampling(_sampling_fields(data), sampling, max_tokens=("max_output_tokens",))
    fields, echo = _carried(data)
    _check_rest(data)
    instructions = _string_field(data, "instructions")
    previous = _string_field(data, "previous_response_id") or None
    store = _flag(data, "store") is not False
    user = _string_field(data, "user") or ""
    echo |= {
        "instructions": instructions,
        "temperature": sampling.temperature if sampling.HasField("temperature") else 1.0,
        "top_p": sampling.top_p if sampling.HasField("top_p") else 1.0,
        "max_output_tokens": data.get("max_output_tokens"),
        "previous_response_id": previous,
        "metadata": _metadata(data.get("metadata")),
        "truncation": "disabled",
        "store": store,
        "background": False,
        "service_tier": "default",
        "top_logprobs": 0,
        **({"user": user} if user else {}),
    }
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
        raise chat.missing("input")
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


def _refuse(data: Mapping[str, Any]) -> None:
    """400 for the fields asking what this server does not do."""
    for name, why in _REFUSED.items():
        if data.get(name) is not None:
            raise ApiError(400, f"'{name}' is not supported: {why}.", param=name, code="unsupported_parameter")
    if data.get("background"):
        message = "'background' is not supported: responses are made while the request waits (stream for progress)."
        raise ApiError(400, message, param="background", code="unsupported_parameter")


def _carried(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields the node's adapter receives, in chat completions' shape; and how the Response echoes them."""
    fields: dict[str, Any] = {}
    tools = _tools(data.get("tools"))
    if tools:
        fields["tools"] = [
            chat.function_tool(tool["name"], tool["parameters"], tool["description"], tool["strict"]) for tool in tools
        ]
    tool_choice = _tool_choice(data.get("tool_choice"), tools)
    try:
        sent = chat.tool_choice_sent(None if tool_choice is None else _chat_tool_choice(tool_choice), bool(tools))
    except ValueError as exc:
        raise ApiError(400, f"{exc}.", param="tool_choice", code="invalid_value") from None
    if sent is not None:
        fields["tool_choice"] = sent
    parallel = _flag(data, "parallel_tool_calls")
    if parallel is not None and tools:
        fields["parallel_tool_calls"] = parallel
    text = _text(data.get("text"))
    if (text_format := text["format"])["type"] != "text":
        fields["response_format"] = _chat_format(text_format)
    reasoning = _reasoning(data.get("reasoning"))
    if reasoning and reasoning.get("effort"):
        fields["reasoning_effort"] = reasoning["effort"]
    echo = {
        "tools": tools,
        "tool_choice": tool_choice if tool_choice is not None else "auto",
        "parallel_tool_calls": True if parallel is None else parallel,
        "text": text,
        "reasoning": reasoning,
    }
    return fields, echo


def _cut(value: str) -> str:
    """A client's string as an error message echoes it: a megabyte one is not (64 characters, as Messages)."""
    return value if len(value) <= 64 else value[:61] + "..."


def _string_field(data: Mapping[str, Any], name: str) -> str | None:
    value = data.get(name)
    if value is not None and not isinstance(value, str):
        raise _invalid_type(name, "a string", value)
    return value


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
                f"Tool type {chat.show(kind)} is not supported by this server: only function tools "
                "(hosted tools such as web search, file search and code interpreter run at OpenAI)."
            )
            raise ApiError(400, message, param=f"{where}.type", code="unsupported_parameter")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise chat.missing(f"{where}.name")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _invalid_type(f"{where}.parameters", "an object", parameters)
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _invalid_type(f"{where}.strict", "a boolean", strict)
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _invalid_type(f"{where}.description", "a string", description)
        checked.append(
            {"type": "function", "name": name, "description": description, "parameters": parameters, "strict": strict}
        )
    names = [str(tool["name"]) for tool in checked]
    if (problem := chat.tool_name_problem(names, longest=chat.OPENAI_TOOL_NAME)) is not None:
        index, why = problem
        where = f"tools[{index}].name"
        raise ApiError(400, f"Invalid '{where}': {why}.", param=where, code="invalid_value")
    return checked


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any] | None:
    if choice is None or (isinstance(choice, str) and choice in _TOOL_CHOICES):
        return str(choice) if choice is not None else None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or name not in {tool["name"] for tool in tools}:
            message = f"Tool choice names the function {chat.show(name)}, which is not in 'tools'."
            raise ApiError(400, message, param="tool_choice", code="invalid_value")
        return {"type": "function", "name": name}
    message = (
        f"Invalid value for 'tool_choice': {chat.show(choice)}. This server takes 'none', 'auto', 'required' "
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
        message = f"Invalid value: {chat.show(kind)}. Supported values are: 'text', 'json_object' and 'json_schema'."
        raise ApiError(400, message, param="text.format.type", code="invalid_value")
    if kind == "json_schema":
        _json_schema_format(given)
    checked = {"format": dict(given)}
    if (verbosity := text.get("verbosity")) is not None:
        if verbosity not in _VERBOSITIES:
            message = f"Invalid value: {chat.show(verbosity)}. Supported values are: 'low', 'medium' and 'high'."
            raise ApiError(400, message, param="text.verbosity", code="invalid_value")
        checked["verbosity"] = verbosity
    return checked


def _json_schema_format(given: Mapping[str, Any]) -> None:
    """A json_schema text format's name (OpenAI's pattern), schema and strict flag checked."""
    for name, expected in (("name", str), ("schema", dict)):
        if not isinstance(given.get(name), expected):
            raise chat.missing(f"text.format.{name}")
    if not _FORMAT_NAME.fullmatch(given["name"]):
        message = (
            f"Invalid 'text.format.name': {chat.show(given['name'])}. It must be 1 to 64 letters, digits, "
            "underscores or dashes."
        )
        raise ApiError(400, message, param="text.format.name", code="invalid_value")
    if (strict := given.get("strict")) is not None and not isinstance(strict, bool):
        raise _invalid_type("text.format.strict", "a boolean", strict)
    if (description := given.get("description")) is not None and not isinstance(description, str):
        raise _invalid_type("text.format.description", "a string", description)


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
        message = f"Invalid value: {chat.show(effort)}. Supported values are: {allowed}."
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
                    f"include {_cut(item)!r} is not supported by this server",
                    param="include",
                    code="unsupported_parameter",
                )
    if data.get("top_logprobs"):
        message = "'top_logprobs' is not supported for responses"
        raise ApiError(400, message, param="top_logprobs", code="unsupported_parameter")
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
    items = [_input_item(item, f"input[{index}]") for index, item in enumerate(given)]
    seen: set[str] = set()
    for index, item in enumerate(items):
        if item["id"] in seen:  # input_items' ``after`` names one item: two with one id would make it ambiguous
            message = f"Duplicate item id {_cut(item['id'])!r} in 'input': each input item's id must be unique."
            raise ApiError(400, message, param=f"input[{index}].id", code="invalid_value")
        seen.add(item["id"])
    return items


def _input_item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise _invalid_type(where, "an object", item)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _MESSAGE_ROLES:
            allowed = "'assistant', 'system', 'developer', and 'user'"
            message = f"Invalid value: {chat.show(role)}. Supported values are: {allowed}."
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
        f"Input items of type {chat.show(kind)} are not supported by this server: "
        "messages, function_call and function_call_output are."
    )
    raise ApiError(400, message, param=f"{where}.type", code="unsupported_parameter")


def _message_item(role: str, content: Any, where: str) -> dict[str, Any]:
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts = [text_part(part_type, content)]
    elif isinstance(content, list):
        parts = [_content_part(part, part_type, f"{where}[{index}]") for index, part in enumerate(content)]
    else:
        if content is None:
            raise chat.missing(where)
        raise _invalid_type(where, "a string or an array", content)
    return {"id": new_id("msg"), "type": "message", "role": role, "content": parts, "status": "completed"}


def text_part(part_type: str, text: str) -> dict[str, Any]:
    """A content part of text: ``output_text`` (with its empty annotations and logprobs) or ``input_text``."""
    if part_type == "output_text":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "input_text", "text": text}


def _content_part(part: Any, part_type: str, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "refusal", "text"):
        return text_part(part_type, _text_of(part, where))
    if kind == "input_image" and part_type == "input_text":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            message = "Images are taken by URL (image_url) here: files are not kept by this server for input."
            raise ApiError(400, message, param=f"{where}.image_url", code="unsupported_parameter")
        detail = part.get("detail") or "auto"
        if detail not in _DETAILS:
            message = f"Invalid value: {chat.show(detail)}. Supported values are: 'auto', 'low', 'high' and 'original'."
            raise ApiError(400, message, param=f"{where}.detail", code="invalid_value")
        return {"type": "input_image", "image_url": url, "detail": detail}
    message = f"Content of type {chat.show(kind)} is not supported here: input_text and input_image are."
    raise ApiError(400, message, param=f"{where}.type", code="unsupported_parameter")


def _text_of(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise _invalid_type(where, "an object", part)
    text = part.get("refusal") if part.get("type") == "refusal" else part.get("text")
    if not isinstance(text, str):
        raise chat.missing(f"{where}.text")
    return text


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        if value is None:
            raise chat.missing(f"{where}.{key}")
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
