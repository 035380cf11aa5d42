"""The mock adapter: a deterministic backend for demos, benchmarks and tests (a product feature).

Text is a sequence of words drawn by a generator seeded from the request (its seed, or a hash
of model and prompt), so the same request always streams the same text. Speed, length, time
to first token and failures are set per route (``options``) and may be overridden per request
through metadata keys ``mock.<option>`` (for example ``mock.fail_after: "3"``). A run with a
continuation goes on exactly where the delivered tokens end: joined to them, its text is the
uninterrupted run's, byte for byte.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import Mapping
from typing import Any

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters.schema_values import MAX_CHARS, MAX_VALUES, bounded_value
from iop_node.domain import ExecutionSpec, refuse_continuation
from iop_node.ports import EventSink
from iop_node.settings import one_line
from iop_wire.errors import IopError

__all__ = ["MockAdapter", "MockOptions"]

_WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "an",
    "be",
    "this",
    "are",
    "which",
    "or",
    "his",
    "had",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "more",
    "if",
    "no",
    "out",
    "so",
    "said",
    "up",
    "time",
    "about",
    "into",
    "than",
    "them",
    "could",
    "model",
    "token",
    "stream",
    "node",
    "run",
    "cluster",
    "latency",
    "answer",
    "request",
    "signal",
    "window",
    "vector",
    "prompt",
    "reply",
)
_log = structlog.get_logger("iop.node.mock")
_YIELD_EVERY = 32  # at full speed, let other runs use the loop every this many tokens


class MockOptions(BaseModel):
    """Options of a mock route; any of them may be overridden per request with ``mock.<name>``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int = Field(16, ge=0)
    """Tokens generated when the request sets no smaller max_tokens."""
    tokens_per_second: float = Field(0.0, ge=0)
    """Pace of generation; 0 streams as fast as the connection takes it."""
    ttft: float = Field(0.0, ge=0)
    """Seconds before the first token."""
    fail_after: int | None = Field(None, ge=0)
    """Fail the run with BACKEND_ERROR after this many tokens."""
    stall_after: int | None = Field(None, ge=0)
    """Stop producing after this many tokens, until cancelled or past the deadline."""
    crash_after: int | None = Field(None, ge=0)
    """Raise an unexpected exception after this many tokens (a crashing backend)."""
    dimensions: int = Field(8, ge=1, le=4096)
    """Length of embedding vectors."""


class MockAdapter:
    """Serves every model routed to it with deterministic generated text."""

    name = "mock"

    def __init__(self, models: Mapping[str, MockOptions]) -> None:
        self._models = dict(models)

    def available(self, model: str) -> bool:
        return True

    async def aclose(self) -> None:
        """Nothing to release: runs end with their tasks."""

    def served(self, model: str) -> pb.ServedModel | None:
        """None: the mock model runs in the node."""
        return None

    async def start(self) -> None:
        """Nothing to start: the mock model runs in the node."""

    async def capabilities(self) -> list[pb.ModelInfo]:
        kinds = [pb.RUN_KIND_CHAT, pb.RUN_KIND_COMPLETION, pb.RUN_KIND_EMBEDDING, pb.RUN_KIND_COUNT_TOKENS]
        continuable = [pb.RUN_KIND_CHAT, pb.RUN_KIND_COMPLETION]
        return [
            pb.ModelInfo(name=name, kinds=kinds, available=True, continuable_kinds=continuable) for name in self._models
        ]

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> None:
        _refuse_unsupported(spec)
        options = _options(self._models[spec.request.model], spec.request.metadata)
        prompt = spec.prompt_text()
        prompt_tokens = _prompt_tokens(spec, prompt)
        if spec.kind == pb.RUN_KIND_COUNT_TOKENS:
            await sink.counted(prompt_tokens)
            return
        words = random.Random(_seed(spec, prompt))  # noqa: S311 - reproducible text, not secrets
        if not spec.request.HasField("continuation"):  # a continued attempt's usage is the whole run's
            sink.counting(prompt_tokens, token_per_delta=True)  # a word a token: exact if it ends early
        if options.ttft:
            await asyncio.sleep(options.ttft)
        if spec.kind == pb.RUN_KIND_EMBEDDING:
            await _embed(spec, options, words, sink)
            return
        limit = spec.sampling.max_tokens if spec.sampling.HasField("max_tokens") else None
        chosen = _chosen_tool(spec) if spec.kind == pb.RUN_KIND_CHAT else None
        if chosen is not None:
            refuse_continuation(spec, "the mock does not continue a tool call")
            index, tool = chosen
            arguments = _arguments(tool, words, spec, sink)
            text = _capped(json.dumps(arguments, ensure_ascii=False), spec, sink, f"tool {tool['name']!r}")
            call_id = _call_id(spec, prompt, index)
            await _call_tool(
                call_id, tool["name"], text, sink, options=options, limit=limit, prompt_tokens=prompt_tokens
            )
            return
        await _write(spec, words, sink, options=options, limit=limit, prompt_tokens=prompt_tokens)


async def _write(
    spec: ExecutionSpec,
    words: random.Random,
    sink: EventSink,
    *,
    options: MockOptions,
    limit: int | None,
    prompt_tokens: int,
) -> None:
    """The answer's text (words, or JSON when ``response_format`` asks), a token a delta."""
    structured = _structured(spec, words, sink)
    if structured is not None:
        refuse_continuation(spec, "the mock does not continue a structured (response_format) answer")
    pieces = _fragments(structured) if structured is not None else None
    planned = options.tokens if pieces is None else len(pieces)
    count = planned if limit is None else min(limit, planned)
    interval = 1.0 / options.tokens_per_second if options.tokens_per_second else 0.0
    faulty = (options.fail_after, options.stall_after, options.crash_after) != (None, None, None)
    # A continuation goes on exactly: the text is a function of the request, so the tokens
    # delivered before are drawn again and skipped, and the rest is what the run would have said.
    delivered = spec.request.continuation.completion_tokens
    if pieces is None:
        for _ in range(min(delivered, count)):
            words.choice(_WORDS)
    for index in range(delivered, count):
        if faulty:
            await _inject(options, index)
        await sink.delta(words.choice(_WORDS) + " " if pieces is None else pieces[index])
        if interval:
            await asyncio.sleep(interval)
        elif index % _YIELD_EVERY == _YIELD_EVERY - 1:
            await asyncio.sleep(0)
    if faulty:
        await _inject(options, count)
    reason = pb.FINISH_REASON_LENGTH if limit is not None and limit <= planned else pb.FINISH_REASON_STOP
    if pieces is not None and limit is not None and limit == planned:
        reason = pb.FINISH_REASON_STOP  # the whole structured answer fitted
    usage = pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=count)
    if spec.request.HasField("continuation"):  # this attempt re-read the delivered tokens
        usage.continuation_prompt_tokens = spec.request.continuation.continuation_prompt_tokens + delivered
    await sink.complete(reason, usage)


_UNSUPPORTED = ("functions", "function_call", "logprobs", "top_logprobs")
"""OpenAI request fields the mock cannot honour; set to anything but their off value, the run is refused."""
_OFF: dict[str, object] = {"logprobs": False}
_FRAGMENT = 8
"""Characters of a streamed tool call's arguments (or a structured answer) a token: one delta each."""
_MAX_TEXT = 2 * MAX_CHARS + 64 * MAX_VALUES
"""Characters of a tool call's arguments or a structured answer at most: the value's strings, names and
constants are bounded by MAX_CHARS, this also bounds the rest of its JSON (numbers, punctuation)."""


def _prompt_tokens(spec: ExecutionSpec, prompt: str) -> int:
    """The mock's count of the prompt: a word a token, the tools' definitions included."""
    tools = spec.openai_fields.get("tools")
    return len(prompt.split()) + (len(json.dumps(tools).split()) if tools else 0)


def _tools(spec: ExecutionSpec) -> list[dict[str, Any]]:
    """The request's function tools (each a ``function`` object with a name, ``parameters`` an object if
    given); INVALID_ARGUMENT otherwise."""
    functions = []
    for index, tool in enumerate(spec.openai_fields.get("tools") or []):
        function = (
            tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        )
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            message = f"tools[{index}] is not a function tool with a name: the mock calls function tools only"
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, message, param=f"tools[{index}]")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            message = f"tools[{index}].function.parameters is not a JSON schema object"
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, message, param=f"tools[{index}].function.parameters")
        functions.append(function)
    return functions


def _chosen_tool(spec: ExecutionSpec) -> tuple[int, dict[str, Any]] | None:
    """The function to call now and its index in ``tools``: the one ``tool_choice`` names, else the
    first; None when there are no tools, tool_choice is ``none``, or the conversation ends with a tool's
    result (time to answer)."""
    tools = _tools(spec)
    choice = spec.openai_fields.get("tool_choice")
    choice = "auto" if choice is None else choice  # unset or null
    name = _named(choice)
    if not tools and choice not in ("auto", "none"):
        message = f"tool_choice {json.dumps(choice)[:80]} is only allowed when tools are given"
        raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, message, param="tool_choice")
    if not tools or choice == "none":
        return None
    messages = spec.request.messages
    if messages and messages[-1].role == pb.ROLE_TOOL:
        return None
    if name is not None:
        found = next(((index, tool) for index, tool in enumerate(tools) if tool["name"] == name), None)
        if found is None:
            message = f"tool_choice names {name!r}, which is not one of the request's tools"
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, message, param="tool_choice")
        return found
    return 0, tools[0]


def _named(choice: Any) -> str | None:
    """The function ``tool_choice`` names (``{"type": "function", "function": {"name": X}}``, or the
    Responses API's ``{"type": "function", "name": X}``); None for auto, none and required;
    INVALID_ARGUMENT for anything else."""
    if choice in ("auto", "none", "required"):
        return None
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        named = choice.get("function")
        name = (named if isinstance(named, dict) else choice).get("name")
        if isinstance(name, str) and name:
            return name
    message = f"tool_choice {json.dumps(choice)[:80]} is not auto, none, required or a function with a name"
    raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, message, param="tool_choice")


def _arguments(tool: dict[str, Any], words: random.Random, spec: ExecutionSpec, sink: EventSink) -> dict[str, Any]:
    """A call's arguments: always a JSON object, as OpenAI's are. No ``parameters`` (or ``{}``) means
    no parameters: ``{}``. A schema whose value is not an object (``{"type": "string"}``, say) is
    made as ``{"type": "object"}`` is: ``{}`` too, with the run record saying so."""
    parameters = tool.get("parameters") or {"type": "object", "properties": {}}
    value = _made(parameters, words, spec, sink, f"tool {tool['name']!r}")
    if isinstance(value, dict):
        return value
    _log.warning("tool parameters are not an object schema", run_id=spec.request.run_id, tool=tool["name"])
    sink.annotate("tool_parameters", f"tool {tool['name']!r}: not an object schema, arguments {{}}")
    return {}


def _call_id(spec: ExecutionSpec, prompt: str, index: int) -> str:
    """The call's id: from the request's seed (or its prompt's hash), the number of messages (each turn
    of a conversation has one more) and the tool's index, so a turn's id is not an earlier turn's."""
    key = f"{_seed(spec, prompt)}\0{len(spec.request.messages)}\0{index}".encode()
    return f"call_{hashlib.blake2b(key, digest_size=12).hexdigest()}"


def _capped(text: str, spec: ExecutionSpec, sink: EventSink, what: str) -> str:
    """``text`` cut at _MAX_TEXT characters (then no longer valid JSON; logged and in the run record as
    ``schema_bounded``): a backstop behind schema_values' bounds, whatever JSON adds to them."""
    if len(text) <= _MAX_TEXT:
        return text
    _log.warning("schema value cut", run_id=spec.request.run_id, what=what, chars=len(text), kept=_MAX_TEXT)
    sink.annotate("schema_bounded", f"{what}: text")
    return text[:_MAX_TEXT]


async def _call_tool(
    call_id: str,
    name: str,
    arguments: str,
    sink: EventSink,
    *,
    options: MockOptions,
    limit: int | None,
    prompt_tokens: int,
) -> None:
    """One call ``call_id`` of the tool ``name`` with ``arguments`` (JSON text), streamed as OpenAI streams
    a call: the id and name first, then the arguments a fragment (a token) at a time."""
    pieces = _fragments(arguments)
    count = len(pieces) if limit is None else min(limit, len(pieces))
    interval = 1.0 / options.tokens_per_second if options.tokens_per_second else 0.0
    head = pb.ToolCallDelta(index=0, id=call_id, function_name=name, arguments="")
    await sink.output(pb.RunDelta(tool_calls=[head]))
    for index in range(count):
        await _inject(options, index)
        await sink.output(pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, arguments=pieces[index])]))
        if interval:
            await asyncio.sleep(interval)
        elif index % _YIELD_EVERY == _YIELD_EVERY - 1:
            await asyncio.sleep(0)
    await _inject(options, count)
    reason = pb.FINISH_REASON_TOOL_CALLS if count == len(pieces) else pb.FINISH_REASON_LENGTH
    await sink.complete(reason, pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=count))


def _structured(spec: ExecutionSpec, words: random.Random, sink: EventSink) -> str | None:
    """The answer as JSON text when ``response_format`` asks for JSON (an object made from the schema
    for ``json_schema``); None for plain text."""
    wanted = spec.openai_fields.get("response_format")
    if not isinstance(wanted, dict) or wanted.get("type") in (None, "text"):
        return None
    kind = wanted.get("type")
    if kind == "json_object":
        return json.dumps({"answer": " ".join(words.choice(_WORDS) for _ in range(4))})
    schema = wanted.get("json_schema") if kind == "json_schema" else None
    if not isinstance(schema, dict):
        message = f"response_format {json.dumps(wanted)[:80]} is not text, json_object or json_schema with a schema"
        raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, message, param="response_format")
    value = _made(schema.get("schema") or {}, words, spec, sink, "response_format")
    return _capped(json.dumps(value, ensure_ascii=False), spec, sink, "response_format")


def _made(schema: Any, words: random.Random, spec: ExecutionSpec, sink: EventSink, what: str) -> Any:
    """A value for ``schema`` (schema_values.py); where one of its bounds cut it, one log line and the
    bound in the run record (``schema_bounded``): the client asked for more than the mock makes."""
    value, bound = bounded_value(schema, words, _WORDS)
    if bound:
        _log.warning(
            "schema value bounded", run_id=spec.request.run_id, model=spec.request.model, what=what, bound=bound
        )
        sink.annotate("schema_bounded", f"{what}: {bound}")
    return value


def _fragments(text: str) -> list[str]:
    return [text[start : start + _FRAGMENT] for start in range(0, len(text), _FRAGMENT)] or [""]


def _refuse_unsupported(spec: ExecutionSpec) -> None:
    """INVALID_ARGUMENT naming the first field the mock would otherwise ignore: a client must not think it worked."""
    fields = spec.openai_fields
    for name in _UNSUPPORTED:
        if name in fields and fields[name] not in (None, [], _OFF.get(name)):
            raise IopError(
                pb.ERROR_CODE_INVALID_ARGUMENT,
                f"model {spec.request.model!r} (mock adapter) does not support {name}",
                param=name,
            )
    if int(fields.get("n") or 1) != 1:
        raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, "n > 1 is not supported: send one run per choice", param="n")


def _options(base: MockOptions, metadata: Mapping[str, str]) -> MockOptions:
    overrides: dict[str, Any] = {k.removeprefix("mock."): v for k, v in metadata.items() if k.startswith("mock.")}
    if not overrides:
        return base
    try:
        return base.model_validate({**base.model_dump(), **overrides})
    except ValidationError as exc:
        raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, f"metadata {one_line(exc, 'mock')}") from None


def _seed(spec: ExecutionSpec, prompt: str) -> int:
    if spec.sampling.HasField("seed"):
        return spec.sampling.seed
    digest = hashlib.blake2b(f"{spec.request.model}\0{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


async def _inject(options: MockOptions, produced: int) -> None:
    """The configured failure, once ``produced`` tokens are out."""
    if options.fail_after == produced:
        raise IopError(pb.ERROR_CODE_BACKEND_ERROR, f"mock backend failed after {produced} tokens (fail_after)")
    if options.crash_after == produced:
        raise RuntimeError(f"mock backend crashed after {produced} tokens (crash_after)")
    if options.stall_after == produced:
        await asyncio.Event().wait()


async def _embed(spec: ExecutionSpec, options: MockOptions, numbers: random.Random, sink: EventSink) -> None:
    prompt = spec.request.prompt
    vectors = [
        pb.Embedding(index=i, values=[numbers.uniform(-1, 1) for _ in range(options.dimensions)])
        for i in range(len(prompt))
    ]
    await sink.output(pb.RunDelta(embeddings=vectors))
    prompt_tokens = sum(len(text.split()) for text in prompt)
    await sink.complete(pb.FINISH_REASON_STOP, pb.Usage(prompt_tokens=prompt_tokens))
