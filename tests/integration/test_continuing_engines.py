"""The vllm and ollama adapters continue a run cut on another node (a run.request with a Continuation).

What each adapter sends is checked against a small OpenAI-compatible server written here (aiohttp
on 127.0.0.1 port 0) that records the bodies it gets: no engine here honours vLLM's
``continue_final_message``. Whether a continued run joins to its delivered part is checked on
real engines with greedy sampling: two llama-cpp-python servers (completions, 20 cuts) and two
Ollama servers (chat and completions), all serving the suite's tiny model (tests/backends); the
20-cut test takes another GGUF from $IOP_CONTINUATION_MODEL (SmolLM2-135M for real text). Run with
``-s`` to see the figures (services/iop_node/README.md quotes them).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from backends.fixtures import require
from backends.servers import BackendServer, http_json, llama_server, ollama_server
from conftest import Pki, TextSink
from google.protobuf.struct_pb2 import Struct
from node_helpers import chat, client, collect, node_settings, running_node, text

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters.ollama import OllamaAdapter, OllamaOptions
from iop_node.adapters.vllm import VllmAdapter, VllmOptions
from iop_node.domain import ExecutionSpec
from iop_wire.continuation import Delivered
from iop_wire.errors import IopError

CUTS = 20
TOKENS = 40


def _spec(
    kind: pb.RunKind.ValueType,
    text: str,
    *,
    adapter: str = "vllm",
    max_tokens: int = TOKENS,
    continuation: pb.Continuation | None = None,
    openai_fields: dict[str, Any] | None = None,
) -> ExecutionSpec:
    request = pb.RunRequest(run_id="r1", model="tiny", kind=kind, stream=True)
    if kind == pb.RUN_KIND_CHAT:
        request.messages.append(pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text=text)]))
    else:
        request.prompt.append(text)
    if continuation is not None:
        request.continuation.CopyFrom(continuation)
    sampling = pb.Sampling(max_tokens=max_tokens, temperature=0, seed=7)
    return ExecutionSpec(request, adapter, "tiny", kind, sampling, openai_fields or {})


def _continued(spec: ExecutionSpec, deltas: list[str]) -> ExecutionSpec:
    """``spec`` with the Continuation a relay builds after forwarding ``deltas`` (iop_wire's Delivered)."""
    delivered = Delivered(spec.request)
    for piece in deltas:
        delivered.add(pb.RunDelta(text=piece))
    continuation = delivered.continuation()
    assert continuation is not None, delivered.why_not
    request = pb.RunRequest()
    request.CopyFrom(spec.request)
    request.continuation.CopyFrom(continuation)
    return ExecutionSpec(request, spec.adapter, spec.target_model, spec.kind, spec.sampling, spec.openai_fields)


def _vllm(url: str, *continued: str, **options: Any) -> contextlib.aclosing[VllmAdapter]:
    """A vllm adapter for ``url``'s "tiny"; ``continued`` its route's ``continuation`` (else the default)."""
    if continued:
        options["continuation"] = continued
    return contextlib.aclosing(VllmAdapter({"tiny": VllmOptions(base_url=url, target="tiny", **options)}))


async def _run(adapter: VllmAdapter | OllamaAdapter, spec: ExecutionSpec) -> TextSink:
    sink = TextSink()
    await adapter.execute(spec, sink)
    return sink


def _cuts(deltas: int) -> list[int]:
    """CUTS cut points spread over an answer of ``deltas`` deltas: after the first to before the last."""
    return sorted({1 + i * (deltas - 2) // (CUTS - 1) for i in range(CUTS)})


# -- what the vllm adapter sends, against a recording server ---------------------------------------


class Recorder:
    """An OpenAI-compatible server that keeps every request body and streams two tokens with usage.

    As vLLM does: with ``return_tokens_as_token_ids`` each chunk's logprobs name its token as
    "token_id:N" (chat: logprobs.content, completions: logprobs.tokens), and a chunk of a token whose
    character is not complete yet comes first, without text; POST /tokenize gives a prompt's ids."""

    PROMPT_TOKENS = 30
    PROMPT_IDS = (1, 2, 3)

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chat = request.path.endswith("/chat/completions")
        ids = body.get("return_tokens_as_token_ids")
        for index, word in enumerate(["", " a", " b"] if ids else [" a", " b"]):
            choice: dict[str, Any] = {"index": 0, **({"delta": {"content": word}} if chat else {"text": word})}
            choice["finish_reason"] = "length" if word == " b" else None
            if ids:
                token = f"token_id:{40 + index}"
                choice["logprobs"] = (
                    {"content": [{"token": token, "logprob": -0.5, "bytes": [], "top_logprobs": []}]}
                    if chat
                    else {"tokens": [token], "token_logprobs": [-0.5], "top_logprobs": None, "text_offset": [0]}
                )
            await response.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        usage = {"prompt_tokens": self.PROMPT_TOKENS, "completion_tokens": 2, "total_tokens": self.PROMPT_TOKENS + 2}
        await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def tokenize(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        return web.json_response({"count": 3, "max_model_len": 2048, "tokens": list(self.PROMPT_IDS)})

    @staticmethod
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny"}]})


@pytest.fixture
async def stack() -> AsyncIterator[contextlib.AsyncExitStack]:
    """Closes what a test enters into it (adapters), whether the test passes or not."""
    async with contextlib.AsyncExitStack() as exits:
        yield exits


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[Recorder, str]]:
    server = Recorder()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.answer)
    app.router.add_post("/v1/completions", server.answer)
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/tokenize", server.tokenize)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield server, f"http://127.0.0.1:{port}"
    await runner.cleanup()


_EARLIER = pb.Continuation(text="Once upon", completion_tokens=3, migration=2, continuation_prompt_tokens=4)


async def test_vllm_continues_a_chat_as_an_open_final_assistant_message(
    recorder: tuple[Recorder, str], stack: contextlib.AsyncExitStack
) -> None:
    server, url = recorder
    adapter = await stack.enter_async_context(_vllm(url, "chat", "completion"))
    [info] = await adapter.capabilities()
    assert list(info.continuable_kinds) == [pb.RUN_KIND_CHAT, pb.RUN_KIND_COMPLETION]
    sink = await _run(adapter, _spec(pb.RUN_KIND_CHAT, "tell me", max_tokens=10, continuation=_EARLIER))
    [body] = server.bodies
    assert body["messages"] == [
        {"role": "user", "content": "tell me"},
        {"role": "assistant", "content": "Once upon"},
    ]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 7  # the run's 10 less the 3 delivered
    assert sink.text == " a b" and sink.finish == pb.FINISH_REASON_LENGTH
    # the whole run: the backend's 30 prompt tokens less the 3 it re-read, 3 delivered + 2 now,
    # and the re-read added to the 4 earlier continuations re-read
    assert sink.usage == pb.Usage(prompt_tokens=27, completion_tokens=5, continuation_prompt_tokens=7)


async def test_vllm_continues_a_completion_after_the_delivered_text(
    recorder: tuple[Recorder, str], stack: contextlib.AsyncExitStack
) -> None:
    server, url = recorder
    adapter = await stack.enter_async_context(_vllm(url))
    [info] = await adapter.capabilities()
    assert list(info.continuable_kinds) == [pb.RUN_KIND_COMPLETION]  # the default
    sink = await _run(adapter, _spec(pb.RUN_KIND_COMPLETION, "Tell me a story.", continuation=_EARLIER))
    [body] = server.bodies
    assert body["prompt"] == "Tell me a story.Once upon" and body["max_tokens"] == TOKENS - 3
    assert "continue_final_message" not in body
    assert sink.usage == pb.Usage(prompt_tokens=27, completion_tokens=5, continuation_prompt_tokens=7)


async def test_vllm_refuses_to_continue_what_its_route_does_not(
    recorder: tuple[Recorder, str], stack: contextlib.AsyncExitStack
) -> None:
    server, url = recorder
    adapter = await stack.enter_async_context(_vllm(url))  # continues completions only
    with pytest.raises(IopError) as refused:
        await _run(adapter, _spec(pb.RUN_KIND_CHAT, "tell me", continuation=_EARLIER))
    assert refused.value.code == pb.ERROR_CODE_INVALID_ARGUMENT and refused.value.param == "continuation"
    nothing = await stack.enter_async_context(_vllm(url, continuation=()))
    [info] = await nothing.capabilities()
    assert not info.continuable_kinds
    with pytest.raises(IopError, match="cannot continue"):
        await _run(nothing, _spec(pb.RUN_KIND_COMPLETION, "Tell me", continuation=_EARLIER))
    shaped = _spec(
        pb.RUN_KIND_COMPLETION,
        "Tell me",
        continuation=_EARLIER,
        openai_fields={"response_format": {"type": "json_object"}},
    )
    with pytest.raises(IopError, match="constrained by response_format"):
        await _run(adapter, shaped)
    assert server.bodies == []


async def test_a_continuation_that_already_reached_max_tokens_ends_without_asking_the_backend(
    recorder: tuple[Recorder, str], stack: contextlib.AsyncExitStack
) -> None:
    server, url = recorder
    adapter = await stack.enter_async_context(_vllm(url))
    sink = await _run(adapter, _spec(pb.RUN_KIND_COMPLETION, "Tell me", max_tokens=3, continuation=_EARLIER))
    assert server.bodies == [] and sink.deltas == [] and sink.finish == pb.FINISH_REASON_LENGTH
    assert sink.usage is not None
    assert (sink.usage.completion_tokens, sink.usage.continuation_prompt_tokens) == (3, 4)


class OutputSink(TextSink):
    """Keeps the deltas an adapter writes as RunDelta (token ids, tool calls, logprobs) too."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[pb.RunDelta] = []

    async def output(self, delta: pb.RunDelta) -> None:
        self.outputs.append(delta)
        self.deltas.append(delta.text)


@pytest.mark.parametrize("kind", [pb.RUN_KIND_CHAT, pb.RUN_KIND_COMPLETION], ids=["chat", "completion"])
async def test_a_token_ids_route_streams_each_tokens_id_without_the_logprobs_it_asked_for(
    recorder: tuple[Recorder, str], stack: contextlib.AsyncExitStack, kind: pb.RunKind.ValueType
) -> None:
    server, url = recorder
    adapter = await stack.enter_async_context(_vllm(url, token_ids=True))
    sink = OutputSink()
    await adapter.execute(_spec(kind, "tell me"), sink)
    [body] = server.bodies
    assert body["return_tokens_as_token_ids"] is True
    assert body["logprobs"] == (True if kind == pb.RUN_KIND_CHAT else 0)
    # the textless first token's id goes with the next text; the client asked no logprobs, gets none
    assert [(d.text, list(d.token_ids), len(d.logprobs)) for d in sink.outputs] == [
        (" a", [40, 41], 0),
        (" b", [42], 0),
    ]
    # what a relay keeps of it continues from exact tokens: the prompt's ids (POST /tokenize) + the delivered
    delivered = Delivered(_spec(kind, "tell me").request)
    for delta in sink.outputs[:1]:
        delivered.add(delta)
    continuation = delivered.continuation()
    assert continuation is not None and list(continuation.token_ids) == [40, 41]
    if kind == pb.RUN_KIND_COMPLETION:
        await adapter.execute(_spec(kind, "tell me", continuation=continuation), OutputSink())
        tokenize, continued = server.bodies[1:]
        assert tokenize == {"model": "tiny", "prompt": "tell me"}
        assert continued["prompt"] == [*Recorder.PROMPT_IDS, 40, 41] and continued["max_tokens"] == TOKENS - 2


async def test_a_client_asking_logprobs_gets_them_as_text_not_token_ids(
    recorder: tuple[Recorder, str], stack: contextlib.AsyncExitStack
) -> None:
    server, url = recorder
    adapter = await stack.enter_async_context(_vllm(url, token_ids=True))
    await adapter.execute(_spec(pb.RUN_KIND_CHAT, "tell me", openai_fields={"logprobs": True}), OutputSink())
    [body] = server.bodies
    assert "return_tokens_as_token_ids" not in body
    # logprobs 0 on a completion asks for the chosen tokens' logprobs: not a "no" either
    await adapter.execute(_spec(pb.RUN_KIND_COMPLETION, "tell me", openai_fields={"logprobs": 0}), OutputSink())
    assert "return_tokens_as_token_ids" not in server.bodies[1]
    plain = await stack.enter_async_context(_vllm(url))  # the default: no ids asked
    await plain.execute(_spec(pb.RUN_KIND_CHAT, "tell me"), OutputSink())
    assert "return_tokens_as_token_ids" not in server.bodies[2] and "logprobs" not in server.bodies[2]


# -- llama-cpp-python: a completion cut after k tokens on server A goes on on server B ------------------

_PROMPT = "Once upon a time, in a small village by the sea,"


def _tokens(server: BackendServer, text: str) -> list[int]:
    tokens: list[int] = http_json(server.base_url + "/extras/tokenize", {"input": text})["tokens"]
    return tokens


def _same_tokens_at_the_cut(server: BackendServer, prompt: str, delivered: str, whole: str) -> bool:
    """Whether prompt + delivered re-tokenises to a prefix of prompt + the whole answer's tokens (the
    tokens the first server generated): the second server then reads what the first one had."""
    head, full = _tokens(server, prompt + delivered), _tokens(server, prompt + whole)
    return full[: len(head)] == head


async def _joins(a: VllmAdapter, b: VllmAdapter, spec: ExecutionSpec) -> tuple[list[str], list[int]]:
    """The uninterrupted answer on ``a``, and the cuts whose continuation on ``b`` joins to it exactly."""
    whole = await _run(a, spec)
    assert whole.finish == pb.FINISH_REASON_LENGTH
    joined = []
    for cut in _cuts(len(whole.deltas)):
        rest = await _run(b, _continued(spec, whole.deltas[:cut]))
        if "".join(whole.deltas[:cut]) + rest.text == whole.text:
            joined.append(cut)
            assert rest.finish == pb.FINISH_REASON_LENGTH and rest.usage is not None and whole.usage is not None
            assert rest.usage.completion_tokens == whole.usage.completion_tokens
    return whole.deltas, joined


@pytest.fixture
def two_llamas(tiny_gguf: Path, tmp_path: Path) -> Iterator[tuple[BackendServer, BackendServer]]:
    """Two llama-cpp-python servers of the model in $IOP_CONTINUATION_MODEL (a GGUF file, e.g.
    SmolLM2-135M-Instruct for real text), else the suite's tiny model."""
    require("llama")
    model = Path(os.environ.get("IOP_CONTINUATION_MODEL") or tiny_gguf)
    with (
        llama_server(model, workdir=tmp_path / "a") as first,
        llama_server(model, workdir=tmp_path / "b") as second,
    ):
        yield first, second


async def test_llama_cpp_completion_cut_anywhere_joins_to_the_uninterrupted_text(
    two_llamas: tuple[BackendServer, BackendServer], stack: contextlib.AsyncExitStack
) -> None:
    llama_backend = two_llamas[0]
    a, b = [await stack.enter_async_context(_vllm(server.base_url)) for server in two_llamas]
    # Greedy: temperature 0 and no repeat penalty. llama-cpp-python's default (repeat_penalty 1.1)
    # counts only the tokens generated in the request, so a continuation forgets the delivered ones.
    greedy = _spec(pb.RUN_KIND_COMPLETION, _PROMPT, openai_fields={"repeat_penalty": 1.0})
    deltas, joined = await _joins(a, b, greedy)
    cuts = _cuts(len(deltas))
    assert len(cuts) == CUTS
    whole = "".join(deltas)
    same = [cut for cut in cuts if _same_tokens_at_the_cut(llama_backend, _PROMPT, "".join(deltas[:cut]), whole)]
    # guaranteed: a cut whose delivered text re-tokenises to the tokens generated joins exactly
    assert set(same) <= set(joined), f"cuts re-tokenised alike that did not join: {sorted(set(same) - set(joined))}"
    _, penalised = await _joins(a, b, _spec(pb.RUN_KIND_COMPLETION, _PROMPT))
    print(
        f"\nllama-cpp-python completions, {CUTS} cuts: {len(joined)} join exactly"
        f" ({len(same)} re-tokenise alike at the cut); with its default repeat_penalty 1.1: {len(penalised)}"
    )
    for cut in sorted(set(cuts) - set(same)):  # the delivered end and what followed it, as tokenised
        print(f"  cut after {cut} deltas re-tokenises otherwise: {deltas[cut - 1]!r} + {deltas[cut]!r}")


async def test_a_node_continues_a_completion_cut_on_another_server_and_refuses_a_chat(
    pki: Pki, tmp_path: Path, llama_backend: BackendServer, llama_backend_fresh: BackendServer
) -> None:
    """Through a real node (router, route settings, metered sink): the run starts on one server's route
    and its continuation goes to the other's, as the control-plane re-places a cut run."""
    routes = [
        {"model": name, "adapter": "vllm", "target": "tiny", "options": {"base_url": server.base_url}}
        for name, server in (("tiny-a", llama_backend), ("tiny-b", llama_backend_fresh))
    ]
    greedy = Struct()
    greedy.update({"repeat_penalty": 1.0})
    request = pb.RunRequest(
        run_id="whole",
        model="tiny-a",
        kind=pb.RUN_KIND_COMPLETION,
        prompt=[_PROMPT],
        stream=True,
        sampling=pb.Sampling(max_tokens=24, temperature=0, seed=7),
        openai_fields=greedy,
    )
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        connection = await client(app, pki)
        capabilities = await connection.capabilities()
        [vllm] = [adapter for adapter in capabilities.adapters if adapter.name == "vllm"]
        assert [list(model.continuable_kinds) for model in vllm.models] == [[pb.RUN_KIND_COMPLETION]] * 2
        whole = await collect(await connection.open_run(request))
        delivered = Delivered(request)
        for event in [event for event in whole if event.HasField("delta")][:9]:
            delivered.add(event.delta)
        continuation = delivered.continuation()
        assert continuation is not None and continuation.completion_tokens == 9
        cut = pb.RunRequest()
        cut.CopyFrom(request)
        cut.run_id, cut.model = "rest", "tiny-b"
        cut.continuation.CopyFrom(continuation)
        rest = await collect(await connection.open_run(cut))
        assert continuation.text + text(rest) == text(whole)
        first, last = whole[-1].complete.usage, rest[-1].complete.usage
        assert first.completion_tokens == 24
        assert (last.prompt_tokens, last.completion_tokens) == (first.prompt_tokens, first.completion_tokens)
        assert last.continuation_prompt_tokens == 9
        refused = chat(model="tiny-b", continuation=continuation)
        error = (await collect(await connection.open_run(refused)))[-1].error
        assert (error.code, error.param) == (pb.ERROR_CODE_INVALID_ARGUMENT, "continuation")
        await connection.close()


# -- Ollama: chat and completions continue where the model's template leaves the answer open ----------

# ChatML as Ollama's library templates write it: the last message, when the assistant's, stays open.
OPEN_LAST_TEMPLATE = (
    "{{- range $i, $_ := .Messages }}{{- $last := eq (len (slice $.Messages $i)) 1 -}}"
    "<|im_start|>{{ .Role }}\n{{ .Content }}"
    '{{ if or (ne .Role "assistant") (not $last) }}<|im_end|>\n{{ end }}'
    '{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant\n{{ end }}{{- end }}'
)
OLLAMA_TOKENS = 30


@pytest.fixture
def open_ollamas(tiny_gguf: Path, tmp_path: Path) -> Iterator[tuple[BackendServer, BackendServer]]:
    """Two Ollama servers whose tiny model's template leaves a final assistant message open."""
    require("ollama")
    with (
        ollama_server(tiny_gguf, template=OPEN_LAST_TEMPLATE, workdir=tmp_path / "a") as first,
        ollama_server(tiny_gguf, template=OPEN_LAST_TEMPLATE, workdir=tmp_path / "b") as second,
    ):
        yield first, second


def _ollama(server: BackendServer, *continued: str) -> contextlib.aclosing[OllamaAdapter]:
    options = OllamaOptions(base_url=server.base_url, target="tiny", continuation=continued)
    return contextlib.aclosing(OllamaAdapter({"tiny": options}))


@pytest.mark.parametrize("kind", [pb.RUN_KIND_CHAT, pb.RUN_KIND_COMPLETION], ids=["chat", "completion"])
async def test_ollama_continues_where_the_template_leaves_the_answer_open(
    open_ollamas: tuple[BackendServer, BackendServer], kind: pb.RunKind.ValueType, stack: contextlib.AsyncExitStack
) -> None:
    a, b = [await stack.enter_async_context(_ollama(server, "chat", "completion")) for server in open_ollamas]
    [info] = await b.capabilities()
    assert list(info.continuable_kinds) == [pb.RUN_KIND_CHAT, pb.RUN_KIND_COMPLETION]
    spec = _spec(kind, "hello world", adapter="ollama", max_tokens=OLLAMA_TOKENS)
    whole = await _run(a, spec)
    assert whole.finish == pb.FINISH_REASON_LENGTH and whole.usage is not None
    cuts = _cuts(len(whole.deltas))
    for cut in cuts:
        rest = await _run(b, _continued(spec, whole.deltas[:cut]))
        assert "".join(whole.deltas[:cut]) + rest.text == whole.text, f"cut after {cut} deltas"
        assert rest.usage is not None and rest.usage.completion_tokens == whole.usage.completion_tokens == OLLAMA_TOKENS
        # Ollama counted the prompt with the re-read delivered tokens, taken out again
        assert rest.usage.prompt_tokens == whole.usage.prompt_tokens
        assert rest.usage.continuation_prompt_tokens == cut
    print(f"\nOllama {pb.RunKind.Name(kind)}: {len(cuts)} of {len(cuts)} cuts join exactly")


async def test_ollama_does_not_continue_by_default_as_a_closing_template_starts_a_new_answer(
    ollama_backend: BackendServer, stack: contextlib.AsyncExitStack
) -> None:
    spec = _spec(pb.RUN_KIND_CHAT, "hello world", adapter="ollama", max_tokens=OLLAMA_TOKENS)
    default = await stack.enter_async_context(_ollama(ollama_backend))
    [info] = await default.capabilities()
    assert not info.continuable_kinds
    with pytest.raises(IopError, match="cannot continue"):
        await _run(default, _continued(spec, ["x"]))
    # Why: the suite's own template closes every message, so the "continuation" is a new answer.
    forced = await stack.enter_async_context(_ollama(ollama_backend, "chat"))
    whole = await _run(forced, spec)
    for cut in (3, 10, 20):
        rest = await _run(forced, _continued(spec, whole.deltas[:cut]))
        assert "".join(whole.deltas[:cut]) + rest.text != whole.text
