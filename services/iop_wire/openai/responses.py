"""Run events out as OpenAI responses: whole bodies, and stream chunks as SSE ``data:`` lines.

Shapes follow OpenAI's API reference (``CreateChatCompletionResponse``,
``CreateChatCompletionStreamResponse``, ``CreateCompletionResponse``,
``CreateEmbeddingResponse``); the end-to-end tests validate every body and chunk against the
official OpenAPI document. Chunks are encoded as they come, one ``data:`` event each.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from typing import Any

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.openai.errors import ApiError

__all__ = [
    "DONE",
    "ChatStream",
    "CompletionStream",
    "Outcome",
    "chat_body",
    "collect_delta",
    "completion_body",
    "embedding_body",
    "gather",
    "json_bytes",
    "sse",
    "usage_body",
]

DONE = b"data: [DONE]\n\n"
_FINISH = {
    pb.FINISH_REASON_UNSPECIFIED: "stop",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
    pb.FINISH_REASON_CONTENT_FILTER: "content_filter",
}
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def json_bytes(payload: dict[str, Any]) -> bytes:
    """A JSON body, compact."""
    return _dumps(payload).encode()


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + _dumps(payload).encode() + b"\n\n"


def usage_body(usage: pb.Usage) -> dict[str, Any]:
    """OpenAI's CompletionUsage."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(complete: pb.RunComplete) -> str:
    return _FINISH.get(complete.finish_reason, "stop")


@dataclass(slots=True)
class Outcome:
    """A run's output gathered for a non-streaming answer."""

    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Tool calls by index, their arguments empty till :meth:`calls` joins :attr:`arguments` into them."""
    arguments: dict[int, list[str]] = field(default_factory=dict)
    """Each tool call's argument fragments (joined once, at the end: ``+=`` per fragment is quadratic)."""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    embeddings: list[pb.Embedding] = field(default_factory=list)

    def calls(self) -> list[dict[str, Any]]:
        """The tool calls in index order, each with its arguments whole (chat completions' shape)."""
        for index, pieces in self.arguments.items():
            self.tool_calls[index]["function"]["arguments"] = "".join(pieces)
        return [self.tool_calls[index] for index in sorted(self.tool_calls)]


def collect_delta(outcome: Outcome, delta: pb.RunDelta) -> None:
    """Add a delta to what a non-streaming answer will hold."""
    if delta.text:
        outcome.text.append(delta.text)
    for fragment in delta.tool_calls:
        call = outcome.tool_calls.setdefault(
            fragment.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        call["id"] = call["id"] or fragment.id
        call["function"]["name"] = call["function"]["name"] or fragment.function_name
        outcome.arguments.setdefault(fragment.index, []).append(fragment.arguments)
    outcome.logprobs.extend(_logprob(token) for token in delta.logprobs)
    outcome.embeddings.extend(delta.embeddings)


async def gather(events: AsyncIterable[pb.RunEvent], outcome: Outcome) -> tuple[pb.RunStart, pb.RunEvent | None]:
    """A run's outputs added to ``outcome`` until its end: (its start, the complete or error event;
    None when the events stopped without one)."""
    start = pb.RunStart()
    async for event in events:
        kind = event.WhichOneof("event")
        if kind == "delta":
            collect_delta(outcome, event.delta)
        elif kind == "start":
            start = event.start
        elif kind in ("complete", "error"):
            return start, event
    return start, None


def chat_body(run_id: str, created: int, model: str, outcome: Outcome, complete: pb.RunComplete) -> dict[str, Any]:
    """A whole chat completion."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(outcome.text), "refusal": None}
    if outcome.tool_calls:
        message["tool_calls"] = outcome.calls()
        message["content"] = message["content"] or None
    return {
        "id": f"chatcmpl-{run_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": {"content": outcome.logprobs, "refusal": None} if outcome.logprobs else None,
                "finish_reason": finish_reason(complete),
            }
        ],
        "usage": usage_body(complete.usage),
    }


def completion_body(
    run_id: str, created: int, model: str, texts: list[str], completes: list[pb.RunComplete]
) -> dict[str, Any]:
    """A whole text completion: one choice per prompt."""
    prompt = sum(complete.usage.prompt_tokens for complete in completes)
    generated = sum(complete.usage.completion_tokens for complete in completes)
    return {
        "id": f"cmpl-{run_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason(complete)}
            for index, (text, complete) in enumerate(zip(texts, completes, strict=True))
        ],
        "usage": usage_body(pb.Usage(prompt_tokens=prompt, completion_tokens=generated)),
    }


def embedding_body(
    model: str, embeddings: list[pb.Embedding], usage: pb.Usage, *, as_base64: bool, dimensions: int | None
) -> dict[str, Any]:
    """An embeddings answer; vectors cut to ``dimensions`` (and renormalised) when asked."""
    data = []
    for embedding in sorted(embeddings, key=lambda item: item.index):
        values = list(embedding.values)
        if dimensions is not None and dimensions < len(values):
            values = values[:dimensions]
            norm = sum(value * value for value in values) ** 0.5 or 1.0
            values = [value / norm for value in values]
        vector: Any = values
        if as_base64:
            vector = base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
        data.append({"object": "embedding", "index": embedding.index, "embedding": vector})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    }


class ChatStream:
    """Chat completion chunks of one run, as SSE events."""

    __slots__ = ("_head", "include_usage", "run_id")

    def __init__(self, run_id: str, created: int, model: str, *, include_usage: bool) -> None:
        self.run_id = run_id
        self.include_usage = include_usage
        self._head = {"id": f"chatcmpl-{run_id}", "object": "chat.completion.chunk", "created": created, "model": model}

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        payload = {**self._head, "choices": [choice]}
        if self.include_usage:
            payload["usage"] = None
        return sse(payload)

    def first(self) -> bytes:
        """The role chunk OpenAI sends first."""
        delta = {"role": "assistant", "content": "", "refusal": None}
        return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})

    def delta(self, delta: pb.RunDelta) -> bytes:
        """A chunk with new content, tool-call fragments or logprobs."""
        body: dict[str, Any] = {}
        if delta.text:
            body["content"] = delta.text
        if delta.tool_calls:
            body["tool_calls"] = [_tool_call_delta(fragment) for fragment in delta.tool_calls]
        logprobs = (
            {"content": [_logprob(token) for token in delta.logprobs], "refusal": None} if delta.logprobs else None
        )
        return self._chunk({"index": 0, "delta": body, "logprobs": logprobs, "finish_reason": None})

    def last(self, complete: pb.RunComplete) -> bytes:
        """The finish_reason chunk, the usage chunk when asked, then [DONE]."""
        end = self._chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason(complete)})
        if self.include_usage:
            end += sse({**self._head, "choices": [], "usage": usage_body(complete.usage)})
        return end + DONE

    def error(self, error: ApiError) -> bytes:
        """A failure after the stream started: a last ``data: {"error": ...}`` event (no [DONE])."""
        return sse({"error": error.body()})

    def cancelled(self) -> None:
        """The client left mid-stream: nothing is kept of a chat stream."""


class CompletionStream:
    """Text completion chunks of one run, as SSE events."""

    __slots__ = ("_head", "include_usage")

    def __init__(self, run_id: str, created: int, model: str, *, include_usage: bool) -> None:
        self.include_usage = include_usage
        self._head = {"id": f"cmpl-{run_id}", "object": "text_completion", "created": created, "model": model}

    def _chunk(self, text: str, finish: str | None) -> bytes:
        payload: dict[str, Any] = {
            **self._head,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
        }
        return sse(payload)

    def first(self) -> bytes:
        """Nothing: text completions send no role chunk."""
        return b""

    def delta(self, delta: pb.RunDelta) -> bytes:
        """A chunk with new text."""
        return self._chunk(delta.text, None)

    def last(self, complete: pb.RunComplete) -> bytes:
        """The finish_reason chunk, the usage chunk when asked, then [DONE]."""
        end = self._chunk("", finish_reason(complete))
        if self.include_usage:
            end += sse({**self._head, "choices": [], "usage": usage_body(complete.usage)})
        return end + DONE

    def error(self, error: ApiError) -> bytes:
        """A failure after the stream started: a last ``data: {"error": ...}`` event (no [DONE])."""
        return sse({"error": error.body()})

    def cancelled(self) -> None:
        """The client left mid-stream: nothing is kept of a completion stream."""


def _tool_call_delta(fragment: pb.ToolCallDelta) -> dict[str, Any]:
    call: dict[str, Any] = {"index": fragment.index}
    if fragment.id:
        call["id"] = fragment.id
        call["type"] = "function"
    function: dict[str, str] = {}
    if fragment.function_name:
        function["name"] = fragment.function_name
    if fragment.arguments or not fragment.function_name:
        function["arguments"] = fragment.arguments
    call["function"] = function
    return call


def _logprob(token: pb.TokenLogprob) -> dict[str, Any]:
    return {
        "token": token.token,
        "logprob": token.logprob,
        "bytes": list(token.bytes) if token.bytes else list(token.token.encode()),
        "top_logprobs": [
            {
                "token": top.token,
                "logprob": top.logprob,
                "bytes": list(top.bytes) if top.bytes else list(top.token.encode()),
            }
            for top in token.top_logprobs
        ],
    }
