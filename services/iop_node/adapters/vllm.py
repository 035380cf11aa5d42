"""The vllm adapter: any OpenAI-compatible server (vLLM, llama.cpp's, SGLang, TGI, LM Studio, ...).

Chat runs go to /v1/chat/completions, completion runs to /v1/completions, embedding runs to
/v1/embeddings; streamed (SSE) or not as the client asked. OpenAI fields the client sent
(tools, tool_choice, response_format, logprobs, ...) pass through untouched, and so does sampling
(``top_k`` too); tool-call deltas and logprobs come back as run events, a call's id and name in its
first fragment only, as OpenAI streams them (llama-cpp-python repeats both in every fragment).
Usage is asked for (``stream_options.include_usage``); a server that sends none (llama.cpp's) has
its streamed chunks counted, one token each. The ``developer`` role goes out as ``system`` unless
the route says the server knows it. The served models come from GET /v1/models, read while no run
of this node is in flight there. A route with ``count_tokens`` counts a conversation's tokens
(RUN_KIND_COUNT_TOKENS): vLLM's POST /tokenize, or any server's usage for a chat of one token.

A run cut on another node continues here (``Continuation``, for the kinds in the route's
``continuation``): a completion by appending the delivered text to the prompt, a chat by sending
it as a final assistant message with vLLM's ``continue_final_message``; ``max_tokens`` is what the
run has left, and usage is the whole run's (continuing.py). A route with ``token_ids`` (vLLM)
streams each token's id and continues a completion from the prompt's and the delivered token ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Literal

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters.continuing import (
    check_continuable,
    continuable_kinds,
    limit_reached,
    remaining_tokens,
    whole_run_usage,
)
from iop_node.adapters.http import KINDS, Backends, BackendTime, Endpoint, HttpOptions, HttpStatusError, check_kind
from iop_node.adapters.shapes import (
    embeddings,
    estimated_usage,
    finish_reason,
    json_object,
    json_text,
    model_names,
    protocol_error,
)
from iop_node.domain import ROLE_NAMES, ExecutionSpec, cannot_count, refuse_continuation
from iop_node.ports import EventSink
from iop_wire.errors import IopError

__all__ = ["VllmAdapter", "VllmOptions"]


class VllmOptions(HttpOptions):
    """A route served by an OpenAI-compatible server."""

    developer_role: bool = False
    """Send the ``developer`` role as it is; false (the default) sends it as ``system``, which every
    server knows (llama-cpp-python answers HTTP 500 to ``developer``)."""
    continuation: tuple[Literal["chat", "completion"], ...] = ("completion",)
    """The run kinds the server can continue from output delivered elsewhere (a run cut on a lost
    node): ``completion`` on any server (the delivered text goes after the prompt); ``chat`` only
    where the server continues a final assistant message on ``continue_final_message`` (vLLM,
    SGLang), not llama-cpp-python, which ignores the field and starts a new answer. [] continues
    nothing: such runs end NODE_LOST when their node is lost."""
    token_ids: bool = False
    """vLLM only: stream each token's id (asked as the chosen token's logprob with
    ``return_tokens_as_token_ids``, for streams whose client asked no logprobs), so that a relay
    keeps the ids of what it delivered, and continue a completion from exact tokens (the prompt's
    ids from vLLM's POST /tokenize, then the delivered ids) rather than from re-tokenised text. Off
    by default: other servers send no ids, and it adds a logprob to every chunk."""
    count_tokens: Literal["tokenize", "chat"] | None = None
    """How the server counts a conversation's tokens (RUN_KIND_COUNT_TOKENS): ``tokenize``, vLLM's
    POST /tokenize with the messages and tools (its chat template applied, nothing generated);
    ``chat``, any server: the conversation sent as a chat completion of one token, whose
    ``usage.prompt_tokens`` is the count (exact, for a prefill and a token; llama-cpp-python, whose
    /extras/tokenize/count reads raw text, without the chat template or the tools). None (the
    default, but an engine's: ``vllm`` tokenize, ``llama.cpp`` chat): refused, and not advertised."""


def _model_ids(document: Any) -> set[str]:
    return model_names(document, "data", "id")


class VllmAdapter:
    """Relays runs to OpenAI-compatible servers, one pooled client per base URL."""

    name = "vllm"

    def __init__(self, models: Mapping[str, VllmOptions]) -> None:
        self._options = dict(models)
        self._backends = Backends(self._options, kind="vllm", list_path="/v1/models", list_models=_model_ids)
        self.available = self._backends.available
        self.aclose = self._backends.aclose

    def served(self, model: str) -> pb.ServedModel | None:
        """None: the server is run by someone else (a route with an engine wraps this adapter)."""
        return None

    async def start(self) -> None:
        """Nothing to start: the server is someone else's."""

    async def capabilities(self) -> list[pb.ModelInfo]:
        infos = []
        for model, options in self._options.items():
            backend = self._backends[model].backend
            served = await backend.served()
            up = backend.available and (served is None or (options.target or model) in served)
            kinds = [KINDS[kind] for kind in options.kinds]
            if options.count_tokens is not None:
                kinds.append(pb.RUN_KIND_COUNT_TOKENS)
            continuable = continuable_kinds(options.continuation, options.kinds)
            infos.append(pb.ModelInfo(name=model, kinds=kinds, available=up, continuable_kinds=continuable))
        return infos

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> None:
        options = self._options[spec.request.model]
        counting = spec.kind == pb.RUN_KIND_COUNT_TOKENS
        if counting and options.count_tokens is None:
            raise cannot_count(spec, "its route sets no count_tokens")
        if not counting:
            _check(spec, options)
        endpoint = self._backends[spec.request.model]
        spent = limit_reached(spec)
        if spent is not None:
            await sink.complete(pb.FINISH_REASON_LENGTH, spent)
            return
        try:
            if counting:
                await sink.counted(await _count(endpoint, spec, options))
            elif spec.kind == pb.RUN_KIND_EMBEDDING:
                await _embed(endpoint, spec, sink)
            elif spec.request.stream:
                await _stream(endpoint, spec, sink, options)
            else:
                await _whole(endpoint, spec, sink, options)
        except IopError as exc:
            endpoint.failed(spec.request.run_id, exc)
            raise


def _check(spec: ExecutionSpec, options: VllmOptions) -> None:
    if int(spec.openai_fields.get("n") or 1) != 1:
        raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, "n > 1 is not supported: send one run per choice", param="n")
    check_kind(spec, options)
    if spec.request.HasField("continuation"):
        check_continuable(spec, options.continuation)
        if spec.openai_fields.get("continue_final_message"):
            refuse_continuation(spec, "the request continues its own final message")


async def _count(endpoint: Endpoint, spec: ExecutionSpec, options: VllmOptions) -> int:
    """The conversation's tokens as the server counts them, the way the route's ``count_tokens`` says."""
    if options.count_tokens == "tokenize":
        messages = [_message(message, developer=options.developer_role) for message in spec.request.messages]
        body: dict[str, Any] = {"model": spec.target_model, "messages": messages}
        if tools := spec.openai_fields.get("tools"):
            body["tools"] = tools
        try:
            document = await endpoint.post_json("/tokenize", body)
        except HttpStatusError as exc:
            if exc.status in (404, 405):  # no such endpoint: not vLLM
                raise cannot_count(spec, f"{exc.message} (POST /tokenize is vLLM's)") from None
            raise
        count = document.get("count") if isinstance(document, dict) else None
    else:
        _, body = _request_body(spec, options, stream=False)
        for name in ("max_completion_tokens", "n", "logprobs", "top_logprobs"):
            body.pop(name, None)
        body["max_tokens"] = 1
        document = await endpoint.post_json("/v1/chat/completions", body)
        usage = document.get("usage") if isinstance(document, dict) else None
        count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < 2**32:
        raise protocol_error(f"the backend's count of tokens is not a count: {str(document)[:200]}")
    return count


async def _stream(endpoint: Endpoint, spec: ExecutionSpec, sink: EventSink, options: VllmOptions) -> None:
    path, body = _request_body(spec, options, stream=True, token_prompt=await _token_prompt(endpoint, spec, options))
    ids = _streams_token_ids(spec, options)
    named: dict[int, tuple[str, str]] = {}  # each tool call's id and name, as its first fragment said them
    held: list[int] = []  # ids of tokens whose text is still to come (a character split over tokens)
    finish: str | None = None
    usage: pb.Usage | None = None
    chunks = 0  # chunks with output: one token each where the server sends no usage
    timing = BackendTime()
    async with contextlib.aclosing(endpoint.post_lines(path, body, last=_is_done, timing=timing)) as lines:
        async for line in lines:
            if not line.startswith(b"data:"):
                continue  # SSE comments and other fields
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json_object(data)
            try:
                usage = _usage(chunk.get("usage")) or usage
                output, finished = _output(chunk)
                if isinstance(output, pb.RunDelta) and output.tool_calls:
                    output = _first_mentions(output, named)
                if ids:
                    output, held = _with_token_ids(chunk, output, held)
            except (AttributeError, KeyError, TypeError, ValueError) as exc:  # ValueError: not UTF-8 either
                raise protocol_error(f"unexpected chunk shape ({exc}): {data[:120]!r}") from None
            if output:
                chunks += 1
                await _send(sink, output)
            finish = finished or finish
    if finish is None:
        raise protocol_error("the backend's stream ended without a finish_reason")
    usage = whole_run_usage(spec, usage or estimated_usage(spec, chunks))
    await sink.complete(finish_reason(finish), usage, timing.timings())


async def _whole(endpoint: Endpoint, spec: ExecutionSpec, sink: EventSink, options: VllmOptions) -> None:
    path, body = _request_body(spec, options, stream=False, token_prompt=await _token_prompt(endpoint, spec, options))
    timing = BackendTime()
    document = await endpoint.post_json(path, body, timing=timing)
    try:
        choice = document["choices"][0]
        message = choice.get("message") or {}
        text = json_text(message.get("content") if "message" in choice else choice.get("text"))
        calls = [_tool_call(i, call) for i, call in enumerate(message.get("tool_calls") or [])]
        output = _delta(text, calls, _logprobs(choice.get("logprobs")))
        finish = finish_reason(choice.get("finish_reason"))
        usage = whole_run_usage(spec, _usage(document.get("usage")))
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:  # ValueError: not UTF-8 either
        raise protocol_error(f"unexpected answer shape ({exc}): {str(document)[:200]}") from None
    await _send(sink, output)
    await sink.complete(finish, usage, timing.timings())


async def _embed(endpoint: Endpoint, spec: ExecutionSpec, sink: EventSink) -> None:
    body = {**spec.openai_fields, "model": spec.target_model, "input": list(spec.request.prompt)}
    body["encoding_format"] = "float"  # the node carries floats; base64 would be decoded here for nothing
    timing = BackendTime()
    document = await endpoint.post_json("/v1/embeddings", body, timing=timing)
    try:
        items = sorted(document["data"], key=lambda item: item["index"])
        vectors = [item["embedding"] for item in items]
    except (KeyError, TypeError) as exc:
        raise protocol_error(f"embeddings answer without data[].index and .embedding: {exc}") from None
    await sink.output(pb.RunDelta(embeddings=embeddings(vectors)))
    await sink.complete(pb.FINISH_REASON_STOP, _usage(document.get("usage")), timing.timings())


def _streams_token_ids(spec: ExecutionSpec, options: VllmOptions) -> bool:
    """Whether this run's stream asks for token ids: the route says the server gives them, and the
    client asked no logprobs (which would then come back as "token_id:N" instead of text)."""
    asked = spec.openai_fields.get("logprobs")
    return options.token_ids and spec.request.stream and (asked is None or asked is False)  # 0 asks, for completions


async def _token_prompt(endpoint: Endpoint, spec: ExecutionSpec, options: VllmOptions) -> list[int] | None:
    """For a completion continued from token ids on a ``token_ids`` route: the prompt's ids (vLLM's
    POST /tokenize, which adds the special tokens a text prompt gets), then the delivered ids, so
    that the server reads exactly the tokens the lost one had. None otherwise: the prompt goes as text."""
    continuation = spec.request.continuation
    if not (options.token_ids and spec.kind == pb.RUN_KIND_COMPLETION and continuation.token_ids):
        return None
    document = await endpoint.post_json("/tokenize", {"model": spec.target_model, "prompt": spec.request.prompt[0]})
    tokens = document.get("tokens") if isinstance(document, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(token, int) for token in tokens):
        raise protocol_error(f"/tokenize answered without a list of token ids: {str(document)[:200]}")
    return [*tokens, *continuation.token_ids]


def _request_body(
    spec: ExecutionSpec, options: VllmOptions, *, stream: bool, token_prompt: list[int] | None = None
) -> tuple[str, dict[str, Any]]:
    """The path and JSON body for a chat or completion run: the client's OpenAI fields, then ours."""
    body: dict[str, Any] = dict(spec.openai_fields)
    body["model"] = spec.target_model
    body["stream"] = stream
    if stream:
        body["stream_options"] = {**body.get("stream_options", {}), "include_usage": True}
    for field, value in spec.sampling.ListFields():  # set fields only; stop only when not empty
        body[field.name] = list(value) if field.name == "stop" else value
    request = spec.request
    continued = request.HasField("continuation")
    left = remaining_tokens(spec)
    if continued and left is not None:  # the run's limit counts the delivered tokens too
        body["max_tokens"] = left
    if stream and _streams_token_ids(spec, options):
        body["return_tokens_as_token_ids"] = True
        body["logprobs"] = True if spec.kind == pb.RUN_KIND_CHAT else 0  # the chosen token's only
    if spec.kind == pb.RUN_KIND_COMPLETION:
        body["prompt"] = request.prompt[0] if len(request.prompt) == 1 else list(request.prompt)
        if token_prompt is not None:
            body["prompt"] = token_prompt
        elif continued:  # the router let one prompt through
            body["prompt"] += request.continuation.text
        return "/v1/completions", body
    body["messages"] = [_message(message, developer=options.developer_role) for message in request.messages]
    if continued:  # the answer so far, left open for the server to go on with
        body["messages"].append({"role": "assistant", "content": request.continuation.text})
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    return "/v1/chat/completions", body


def _message(message: pb.ChatMessage, *, developer: bool) -> dict[str, Any]:
    """A ChatMessage in OpenAI's shape, its content always there; ``developer`` false sends that role as ``system``."""
    role = "system" if message.role == pb.ROLE_DEVELOPER and not developer else ROLE_NAMES[message.role]
    result: dict[str, Any] = {"role": role}
    parts = [_part(part) for part in message.content]
    if len(parts) == 1 and parts[0]["type"] == "text":
        result["content"] = parts[0]["text"]
    else:  # "" for none (an assistant's tool calls): llama-cpp-python's chat templates read every message's content
        result["content"] = parts or ""
    if message.name:
        result["name"] = message.name
    if message.tool_calls:
        result["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type or "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        result["tool_call_id"] = message.tool_call_id
    return result


def _part(part: pb.ContentPart) -> dict[str, Any]:
    kind = part.WhichOneof("part")
    if kind == "image_url":
        image = {"url": part.image_url.url, **({"detail": part.image_url.detail} if part.image_url.detail else {})}
        return {"type": "image_url", "image_url": image}
    if kind == "input_audio":
        return {
            "type": "input_audio",
            "input_audio": {"data": part.input_audio.data, "format": part.input_audio.format},
        }
    return {"type": "text", "text": part.text}


def _is_done(line: bytes) -> bool:
    """The SSE stream's final line."""
    return line.startswith(b"data:") and line[5:].strip() == b"[DONE]"


def _output(chunk: dict[str, Any]) -> tuple[str | pb.RunDelta, str | None]:
    """One SSE chunk's output (text alone, or a delta with tool-call fragments or logprobs) and finish_reason."""
    choices = chunk.get("choices") or ()
    if not choices:
        return "", None
    choice = choices[0]
    delta = choice.get("delta")
    text = json_text(delta.get("content") if delta is not None else choice.get("text"))
    calls = [_tool_call(call.get("index", i), call) for i, call in enumerate((delta or {}).get("tool_calls") or ())]
    logprobs = _logprobs(choice.get("logprobs")) if choice.get("logprobs") else []
    return _delta(text, calls, logprobs), choice.get("finish_reason")


def _first_mentions(output: pb.RunDelta, named: dict[int, tuple[str, str]]) -> str | pb.RunDelta:
    """``output`` with each tool call's id and name only where they first come, as OpenAI streams them:
    a server that repeats both in every fragment (llama-cpp-python) would have a client that joins the
    fragments read the name many times. Fragments left with nothing are dropped (a delta too)."""
    calls = []
    for call in output.tool_calls:
        said = named.get(call.index)
        if said is None:
            named[call.index] = (call.id, call.function_name)
        else:
            if call.id == said[0]:
                call.id = ""
            if call.function_name == said[1]:
                call.function_name = ""
            named[call.index] = (said[0] or call.id, said[1] or call.function_name)
        if call.id or call.function_name or call.arguments:
            calls.append(call)
    return _delta(output.text, calls, list(output.logprobs))


def _with_token_ids(
    chunk: dict[str, Any], output: str | pb.RunDelta, held: list[int]
) -> tuple[str | pb.RunDelta, list[int]]:
    """``output`` with the ids of its tokens, read from the logprobs a ``token_ids`` stream asked for
    ("token_id:N"; chat: logprobs.content[].token, completions: logprobs.tokens[]), which are
    dropped: the client asked none. Ids of a chunk without text are held for the next text."""
    choices = chunk.get("choices") or ()
    logprobs = (choices[0].get("logprobs") if choices else None) or {}
    tokens = [item["token"] for item in logprobs.get("content") or ()] or logprobs.get("tokens") or ()
    held = held + [int(token.removeprefix("token_id:")) for token in tokens]
    text, calls = (output, ()) if isinstance(output, str) else (output.text, output.tool_calls)
    if not text and not calls:
        return "", held
    return pb.RunDelta(text=text, tool_calls=calls, token_ids=held), []


def _delta(text: str, calls: list[pb.ToolCallDelta], logprobs: list[pb.TokenLogprob]) -> str | pb.RunDelta:
    """``text`` alone (the fast path), or a delta carrying the tool-call fragments and logprobs too."""
    if not calls and not logprobs:
        return text
    return pb.RunDelta(text=text, tool_calls=calls, logprobs=logprobs)


async def _send(sink: EventSink, output: str | pb.RunDelta) -> None:
    if isinstance(output, pb.RunDelta):
        await sink.output(output)
    elif output:
        await sink.delta(output)


def _tool_call(index: int, call: dict[str, Any]) -> pb.ToolCallDelta:
    function = call.get("function") or {}
    return pb.ToolCallDelta(
        index=index,
        id=call.get("id") or "",
        function_name=function.get("name") or "",
        arguments=function.get("arguments") or "",
    )


def _logprobs(logprobs: Any) -> list[pb.TokenLogprob]:
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("content"), list):
        return []
    return [
        pb.TokenLogprob(
            token=item.get("token", ""),
            logprob=item.get("logprob", 0.0),
            bytes=bytes(item.get("bytes") or ()),
            top_logprobs=[
                pb.TopLogprob(
                    token=top.get("token", ""), logprob=top.get("logprob", 0.0), bytes=bytes(top.get("bytes") or ())
                )
                for top in item.get("top_logprobs") or ()
            ],
        )
        for item in logprobs["content"]
    ]


def _usage(usage: Any) -> pb.Usage | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or {}
    return pb.Usage(
        prompt_tokens=usage.get("prompt_tokens") or 0,
        completion_tokens=usage.get("completion_tokens") or 0,
        cached_tokens=(details.get("cached_tokens") if isinstance(details, dict) else 0) or 0,
    )
