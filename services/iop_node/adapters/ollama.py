"""The ollama adapter: Ollama's native API.

Chat runs stream NDJSON from /api/chat, completion runs from /api/generate, embedding runs use
/api/embed; /api/tags lists the models. Sampling maps to Ollama options (temperature, top_p,
top_k, seed, stop, num_predict, presence/frequency penalty), ``done_reason`` to the finish reason,
``prompt_eval_count`` / ``eval_count`` to usage (streamed lines counted where it is missing)
and the reported durations to timings. Ollama cannot count tokens without generating (it has no
tokenize endpoint): RUN_KIND_COUNT_TOKENS is refused.

A run cut on another node continues here (``Continuation``, for the kinds in the route's
``continuation``) through /api/chat with the delivered text as a final assistant message, which
Ollama continues where the model's TEMPLATE leaves the last assistant message open; a completion
goes there as its one user message, as /api/generate would have templated it. ``num_predict`` is
what the run has left, and usage is the whole run's (continuing.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters.continuing import (
    check_continuable,
    continuable_kinds,
    limit_reached,
    remaining_tokens,
    whole_run_usage,
)
from iop_node.adapters.http import KINDS, Backends, BackendTime, Endpoint, HttpOptions, check_kind
from iop_node.adapters.shapes import (
    embeddings,
    estimated_usage,
    finish_reason,
    json_object,
    json_text,
    model_names,
    protocol_error,
)
from iop_node.domain import ROLE_NAMES, ExecutionSpec, cannot_count
from iop_node.ports import EventSink
from iop_wire.errors import IopError

__all__ = ["OllamaAdapter", "OllamaOptions"]

_OPTION_NAMES = {  # every field of Sampling
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "max_tokens": "num_predict",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop": "stop",
}


class OllamaOptions(HttpOptions):
    """A route served by an Ollama server."""

    base_url: str = Field("http://127.0.0.1:11434", pattern=r"^https?://")
    """The Ollama server."""
    keep_alive: str | None = None
    """How long Ollama keeps the model loaded after a run (Ollama's ``keep_alive``, e.g. "10m")."""
    continuation: tuple[Literal["chat", "completion"], ...] = ()
    """The run kinds this model can continue from output delivered elsewhere (a run cut on a lost
    node). Ollama continues a final assistant message only where the model's TEMPLATE leaves it
    open (the library's templates that test ``$last``, e.g. qwen2.5's); a template that closes every
    message starts a new answer instead, so none by default: set [chat, completion] for a model
    whose template is of the first sort."""


def _tag_names(document: Any) -> set[str]:
    return model_names(document, "models", "name")


def _listed(target: str, names: set[str]) -> bool:
    """Whether /api/tags lists ``target`` (as ``name`` or ``name:latest``)."""
    return target in names or (":" not in target and f"{target}:latest" in names)


class OllamaAdapter:
    """Relays runs to Ollama servers, one pooled client per base URL."""

    name = "ollama"

    def __init__(self, models: Mapping[str, OllamaOptions]) -> None:
        self._options = dict(models)
        self._backends = Backends(self._options, kind="ollama", list_path="/api/tags", list_models=_tag_names)
        self.available = self._backends.available
        self.aclose = self._backends.aclose

    def served(self, model: str) -> pb.ServedModel | None:
        """None: the Ollama server is run by someone else (a route with engine: ollama wraps this adapter)."""
        return None

    async def start(self) -> None:
        """Nothing to start: the server is someone else's."""

    async def capabilities(self) -> list[pb.ModelInfo]:
        infos = []
        for model, options in self._options.items():
            backend = self._backends[model].backend
            served = await backend.served()
            up = backend.available and (served is None or _listed(options.target or model, served))
            kinds = [KINDS[kind] for kind in options.kinds]
            continuable = continuable_kinds(options.continuation, options.kinds)
            infos.append(pb.ModelInfo(name=model, kinds=kinds, available=up, continuable_kinds=continuable))
        return infos

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> None:
        model = spec.request.model
        options = self._options[model]
        if spec.kind == pb.RUN_KIND_COUNT_TOKENS:
            raise cannot_count(spec, "Ollama has no tokenize endpoint")
        check_kind(spec, options)
        if spec.request.HasField("continuation"):
            check_continuable(spec, options.continuation)
        endpoint = self._backends[model]
        spent = limit_reached(spec)
        if spent is not None:
            await sink.complete(pb.FINISH_REASON_LENGTH, spent)
            return
        request = None if spec.kind == pb.RUN_KIND_EMBEDDING else _request_body(spec, options)
        try:
            if request is None:
                await _embed(endpoint, spec, sink)
            else:
                await _generate(endpoint, spec, sink, *request)
        except IopError as exc:
            endpoint.failed(spec.request.run_id, exc)
            raise


async def _generate(endpoint: Endpoint, spec: ExecutionSpec, sink: EventSink, path: str, body: dict[str, Any]) -> None:
    final: dict[str, Any] | None = None
    lines_with_text = 0
    # the final object says "done":true (Go's encoder writes no spaces; a "done" inside a
    # string would be escaped)
    timing = BackendTime()
    async with contextlib.aclosing(endpoint.post_lines(path, body, last=_is_done, timing=timing)) as lines:
        async for line in lines:
            item = json_object(line)
            try:
                message = item.get("message") or {}
                text = json_text(message.get("content") if "message" in item else item.get("response"))
            except (AttributeError, TypeError) as exc:
                raise protocol_error(f"unexpected line shape ({exc}): {line[:120]!r}") from None
            if text:
                lines_with_text += 1
                await sink.delta(text)
            if item.get("done"):
                final = item
                break
    if final is None:
        raise protocol_error("the backend's stream ended without a done line")
    usage = whole_run_usage(spec, _usage(final) or estimated_usage(spec, lines_with_text))
    await sink.complete(finish_reason(final.get("done_reason")), usage, _timings(final, timing))


def _request_body(spec: ExecutionSpec, options: OllamaOptions) -> tuple[str, dict[str, Any]]:
    request = spec.request
    body: dict[str, Any] = {"model": spec.target_model, "stream": request.stream, "options": _sampling(spec.sampling)}
    if options.keep_alive is not None:
        body["keep_alive"] = options.keep_alive
    response_format = spec.openai_fields.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_object":
        body["format"] = "json"
    elif isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        body["format"] = (response_format.get("json_schema") or {}).get("schema", "json")
    if spec.openai_fields.get("tools"):
        body["tools"] = spec.openai_fields["tools"]
    if request.HasField("continuation"):
        left = remaining_tokens(spec)
        if left is not None:  # the run's limit counts the delivered tokens too
            body["options"]["num_predict"] = left
        if spec.kind == pb.RUN_KIND_COMPLETION:  # the router let one prompt through
            body["messages"] = [{"role": "user", "content": request.prompt[0]}]
        else:
            body["messages"] = [_message(message) for message in request.messages]
        body["messages"].append({"role": "assistant", "content": request.continuation.text})
        return "/api/chat", body
    if spec.kind == pb.RUN_KIND_COMPLETION:
        body["prompt"] = "\n".join(request.prompt)
        return "/api/generate", body
    body["messages"] = [_message(message) for message in request.messages]
    return "/api/chat", body


def _sampling(sampling: pb.Sampling) -> dict[str, Any]:
    """The set sampling fields under Ollama's option names."""
    return {
        _OPTION_NAMES[field.name]: list(value) if field.name == "stop" else value
        for field, value in sampling.ListFields()
    }


def _message(message: pb.ChatMessage) -> dict[str, Any]:
    result: dict[str, Any] = {"role": ROLE_NAMES[message.role], "content": "".join(p.text for p in message.content)}
    images = [_image(p.image_url.url) for p in message.content if p.WhichOneof("part") == "image_url"]
    if images:
        result["images"] = images
    if message.tool_calls:
        result["tool_calls"] = [
            {"function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in message.tool_calls
        ]
    return result


def _image(url: str) -> str:
    """Ollama takes base64 image data, not URLs: a data: URL is unwrapped, anything else refused."""
    if url.startswith("data:") and "," in url:
        return url.split(",", 1)[1]
    raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, "the ollama adapter needs images as data: URLs")


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, "tool call arguments must be a JSON text") from None


async def _embed(endpoint: Endpoint, spec: ExecutionSpec, sink: EventSink) -> None:
    body = {"model": spec.target_model, "input": list(spec.request.prompt)}
    document = await endpoint.post_json("/api/embed", body)
    try:
        vectors = list(document["embeddings"])
    except (KeyError, TypeError) as exc:
        raise protocol_error(f"embed answer without embeddings: {exc}") from None
    await sink.output(pb.RunDelta(embeddings=embeddings(vectors)))
    await sink.complete(pb.FINISH_REASON_STOP, pb.Usage(prompt_tokens=document.get("prompt_eval_count") or 0))


def _usage(final: dict[str, Any]) -> pb.Usage | None:
    if "eval_count" not in final and "prompt_eval_count" not in final:
        return None
    return pb.Usage(prompt_tokens=final.get("prompt_eval_count") or 0, completion_tokens=final.get("eval_count") or 0)


def _timings(final: dict[str, Any], timing: BackendTime) -> pb.Timings | None:
    """Ollama's nanosecond durations: loading + prompt evaluation is the time to first token. The
    generation is Ollama's time as the node's client saw it (its HTTP and JSON work included, as
    for any other backend), or its own total_duration when that is unknown."""
    timings = timing.timings()
    if "total_duration" not in final:
        return timings
    timings = timings or pb.Timings()
    timings.time_to_first_token.FromNanoseconds(
        int(final.get("load_duration", 0)) + int(final.get("prompt_eval_duration", 0))
    )
    if not timings.HasField("generation"):
        timings.generation.FromNanoseconds(int(final["total_duration"]))
    return timings


def _is_done(line: bytes) -> bool:
    """The stream's final object."""
    return b'"done":true' in line
