"""What the HTTP adapters read alike from their backends' JSON: streamed objects, text, finish
reasons, embeddings, model lists, and usage when the backend reports none.

Every function here raises ``IopError``: BACKEND_PROTOCOL_ERROR for a shape it cannot read,
BACKEND_ERROR for an error the backend reported; messages taken from a backend are capped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.domain import ExecutionSpec
from iop_wire.errors import IopError

__all__ = [
    "MESSAGE_LIMIT",
    "capped",
    "embeddings",
    "estimated_usage",
    "finish_reason",
    "json_object",
    "json_text",
    "model_names",
    "protocol_error",
]

MESSAGE_LIMIT = 1000
"""Characters of an error message taken from a backend (an HTML error page is cut here)."""

_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
    "function_call": pb.FINISH_REASON_TOOL_CALLS,
    "content_filter": pb.FINISH_REASON_CONTENT_FILTER,
}
_POOLING_FIX = (
    "the backend returned one vector per token, not one per input: start it with pooling"
    " (llama-cpp-python: --embedding true --kv_overrides llama.pooling_type=int:1 for mean pooling;"
    " vLLM: an embedding model with a pooler), or leave embedding out of the route's options.kinds"
)


def capped(text: str) -> str:
    """``text`` on one line, cut to MESSAGE_LIMIT characters."""
    text = " ".join(text.split())
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


def protocol_error(message: str) -> IopError:
    """The backend's answer could not be understood."""
    return IopError(pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR, capped(message))


def json_text(value: Any) -> str:
    """Text from a backend's JSON: a string, "" for null; TypeError for anything else."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"content is a {type(value).__name__}, not a string")
    return value


def json_object(data: bytes) -> dict[str, Any]:
    """One streamed JSON object (an SSE event's data, an NDJSON line); its ``error`` raised."""
    try:
        item = json.loads(data)
    except ValueError:
        raise protocol_error(f"the backend sent a line that is not JSON: {data[:120]!r}") from None
    if not isinstance(item, dict):
        raise protocol_error(f"the backend sent a JSON {type(item).__name__}, not an object")
    if "error" in item:
        error = item["error"]
        detail = error.get("message", error) if isinstance(error, dict) else error
        raise IopError(pb.ERROR_CODE_BACKEND_ERROR, capped(f"the backend reported an error mid-stream: {detail}"))
    return item


def finish_reason(name: Any) -> pb.FinishReason.ValueType:
    """OpenAI's and Ollama's finish reasons (``done_reason``); STOP for none or one unknown here."""
    return _FINISH.get(name, pb.FINISH_REASON_STOP) if isinstance(name, str) else pb.FINISH_REASON_STOP


def embeddings(vectors: Iterable[Any]) -> list[pb.Embedding]:
    """One ``Embedding`` per input from the backend's vectors, in order."""
    out = []
    for index, values in enumerate(vectors):
        if not isinstance(values, list):
            raise protocol_error(f"embedding {index} is a {type(values).__name__}, not a list of numbers")
        if values and isinstance(values[0], list):
            raise protocol_error(_POOLING_FIX)
        try:
            out.append(pb.Embedding(index=index, values=values))
        except TypeError as exc:
            raise protocol_error(f"embedding {index} is not a list of numbers: {exc}") from None
    return out


def model_names(document: Any, key: str, name: str) -> set[str]:
    """The names in a model list (``{"data": [{"id": ...}]}``, ``{"models": [{"name": ...}]}``);
    a document of another shape is not a model list, whatever its status said."""
    items = document.get(key) if isinstance(document, dict) else None
    if not isinstance(items, list) or not all(
        isinstance(item, dict) and isinstance(item.get(name), str) for item in items
    ):
        raise protocol_error(f"not a model list (expected {{{key!r}: [{{{name!r}: ...}}]}}): {str(document)[:200]}")
    return {item[name] for item in items}


def estimated_usage(spec: ExecutionSpec, completion_tokens: int) -> pb.Usage:
    """Usage for a backend that reported none: streamed chunks counted (one token each), the
    prompt estimated at ~4 characters a token."""
    return pb.Usage(
        prompt_tokens=(len(spec.prompt_text()) + 3) // 4, completion_tokens=completion_tokens, estimated=True
    )
