"""Counting tokens (RUN_KIND_COUNT_TOKENS), top_k and streamed tool calls through a real node, each
adapter against a scripted server (aiohttp on 127.0.0.1 port 0) that records what it was sent and
answers as vLLM (POST /tokenize), llama-cpp-python (a call's id and name in every fragment) and
Ollama (/api/chat) do; the cli adapter with a real program."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from conftest import Pki
from node_helpers import chat, client, collect, kinds, node_settings, running_node

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.bootstrap import NodeApp
from iop_wire.connection import Connection

SEEN: list[tuple[str, dict[str, Any]]] = []
TOOLS: list[Any] = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def _fragment(arguments: str) -> dict[str, Any]:
    """A chunk as llama-cpp-python streams a tool call: id, type and name repeated in every fragment."""
    call = {"index": 0, "id": "call__0_lookup", "type": "function", "function": {"name": "lookup", "arguments": ""}}
    call["function"]["arguments"] = arguments  # type: ignore[index]
    return {"choices": [{"index": 0, "delta": {"role": None, "content": None, "tool_calls": [call]}}]}


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    SEEN.append(("chat", body))
    if not body["stream"]:  # a count by chat: one token, the prompt's usage
        choice = {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
        usage = {"prompt_tokens": 17, "completion_tokens": 1, "total_tokens": 18}
        return web.json_response({"choices": [choice], "usage": usage})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunks: list[dict[str, Any]]
    if body["model"] == "repeats":
        chunks = [_fragment(piece) for piece in ('{"q', '": ', "1}", "")]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    else:
        chunks = [{"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}]
    for chunk in chunks:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


async def _tokenize(request: web.Request) -> web.Response:
    body = await request.json()
    SEEN.append(("tokenize", body))
    if body["model"] == "elsewhere":
        return web.json_response({"detail": "Not Found"}, status=404)
    if body["model"] == "nonsense":
        return web.json_response({"count": "many"})
    return web.json_response({"count": 42, "max_model_len": 2048, "tokens": list(range(42))})


async def _ollama_chat(request: web.Request) -> web.Response:
    body = await request.json()
    SEEN.append(("ollama", body))
    lines = [
        {"model": body["model"], "message": {"role": "assistant", "content": "ok"}, "done": False},
        {"model": body["model"], "done": True, "done_reason": "stop", "prompt_eval_count": 3, "eval_count": 1},
    ]
    return web.Response(text="".join(json.dumps(line) + "\n" for line in lines), content_type="application/x-ndjson")


async def _models(request: web.Request) -> web.Response:
    names = ["counted", "by-chat", "uncounted", "elsewhere", "nonsense", "repeats"]
    return web.json_response({"object": "list", "data": [{"id": name, "object": "model"} for name in names]})


async def _tags(request: web.Request) -> web.Response:
    return web.json_response({"models": [{"name": "llm:latest"}]})


@pytest.fixture
async def scripted() -> AsyncIterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/api/chat", _ollama_chat)
    app.router.add_get("/api/tags", _tags)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port
    await runner.cleanup()


@pytest.fixture
async def node(pki: Pki, tmp_path: Path, scripted: int) -> AsyncIterator[NodeApp]:
    url = f"http://127.0.0.1:{scripted}"

    def vllm(model: str, **options: Any) -> dict[str, Any]:
        return {"model": model, "adapter": "vllm", "options": {"base_url": url, **options}}

    routes = [
        vllm("counted", count_tokens="tokenize"),
        vllm("by-chat", count_tokens="chat"),
        vllm("uncounted"),
        vllm("elsewhere", count_tokens="tokenize"),
        vllm("nonsense", count_tokens="tokenize"),
        vllm("repeats"),
        {"model": "llm", "adapter": "ollama", "options": {"base_url": url}},
        {"model": "program", "adapter": "cli", "options": {"argv": [sys.executable, "-c", "print('hi')"]}},
        {"model": "mock-small", "adapter": "mock"},
    ]
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        yield app


@pytest.fixture
async def connection(node: NodeApp, pki: Pki) -> AsyncIterator[Connection]:
    connection = await client(node, pki)
    yield connection
    await connection.close()


def _count(model: str, *, tools: bool = True) -> pb.RunRequest:
    request = chat(model=model, kind=pb.RUN_KIND_COUNT_TOKENS)
    request.messages.insert(0, pb.ChatMessage(role=pb.ROLE_SYSTEM, content=[pb.ContentPart(text="be brief")]))
    if tools:
        request.openai_fields.update({"tools": TOOLS})
    return request


async def _counted(connection: Connection, request: pb.RunRequest) -> int:
    events = await collect(await connection.open_run(request))
    assert kinds(events) == ["start", "complete"], events[-1]
    complete = events[-1].complete
    assert complete.finish_reason == pb.FINISH_REASON_STOP and complete.usage == pb.Usage(), "counting is not billed"
    return complete.counted_tokens


async def _refused(connection: Connection, request: pb.RunRequest) -> pb.Error:
    events = await collect(await connection.open_run(request))
    assert kinds(events)[-1] == "error" and "delta" not in kinds(events)
    error = events[-1].error
    assert error.code == pb.ERROR_CODE_INVALID_ARGUMENT, error
    return error


async def test_vllm_counts_with_tokenize_sending_the_messages_and_tools(connection: Connection) -> None:
    SEEN.clear()
    assert await _counted(connection, _count("counted")) == 42
    (path, sent), *_ = SEEN
    assert path == "tokenize" and sent["model"] == "counted" and sent["tools"] == TOOLS
    assert sent["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


async def test_vllm_counts_by_chat_with_one_token_and_reads_its_prompt_tokens(connection: Connection) -> None:
    SEEN.clear()
    request = _count("by-chat")
    request.sampling.max_tokens = 500
    request.openai_fields.update({"max_completion_tokens": 500, "n": 2})
    assert await _counted(connection, request) == 17
    (path, sent), *_ = SEEN
    assert path == "chat" and sent["max_tokens"] == 1 and sent["stream"] is False
    assert "max_completion_tokens" not in sent and "n" not in sent and sent["tools"] == TOOLS


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("uncounted", "the backend of model 'uncounted' cannot count tokens: its route sets no count_tokens"),
        ("elsewhere", "the backend of model 'elsewhere' cannot count tokens: vllm http://"),
        ("llm", "the backend of model 'llm' cannot count tokens: Ollama has no tokenize endpoint"),
        ("program", "the backend of model 'program' cannot count tokens: it is a program (cli adapter)"),
    ],
)
async def test_a_route_that_cannot_count_refuses_naming_the_model(
    connection: Connection, model: str, words: str
) -> None:
    error = await _refused(connection, _count(model))
    assert error.param == "model" and error.message.startswith(words), error.message


async def test_a_count_that_is_not_a_count_is_a_protocol_error(connection: Connection) -> None:
    events = await collect(await connection.open_run(_count("nonsense")))
    assert events[-1].error.code == pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR
    assert "not a count" in events[-1].error.message


async def test_the_mock_counts_and_a_count_without_messages_or_with_a_continuation_is_refused(
    connection: Connection,
) -> None:
    assert await _counted(connection, _count("mock-small", tools=False)) == len(
        ["system:", "be", "brief", "user:", "hello", "there"]
    )
    empty = _count("mock-small")
    del empty.messages[:]
    error = await _refused(connection, empty)
    assert error.param == "messages" and "counting tokens needs at least one message" in error.message
    continued = _count("mock-small")
    continued.continuation.CopyFrom(pb.Continuation(text="x", completion_tokens=1))
    assert (await _refused(connection, continued)).param == "continuation"


async def test_routes_advertise_counting_only_where_they_can(connection: Connection) -> None:
    adapters = {adapter.name: adapter for adapter in (await connection.capabilities()).adapters}
    counts = {
        model.name: pb.RUN_KIND_COUNT_TOKENS in model.kinds for adapter in adapters.values() for model in adapter.models
    }
    assert counts == {
        "counted": True,
        "by-chat": True,
        "uncounted": False,
        "elsewhere": True,  # as configured: its refusal says what the server answered
        "nonsense": True,
        "repeats": False,
        "llm": False,
        "program": False,
        "mock-small": True,
    }


async def test_top_k_goes_to_vllm_and_ollama_and_the_cli_adapter_refuses_it(connection: Connection) -> None:
    SEEN.clear()
    for model in ("uncounted", "llm"):
        events = await collect(await connection.open_run(chat(model=model, sampling=pb.Sampling(top_k=5, top_p=0.5))))
        assert kinds(events)[-1] == "complete", events[-1]
    (_, to_vllm), (_, to_ollama) = SEEN
    assert (to_vllm["top_k"], to_vllm["top_p"]) == (5, 0.5)
    assert to_ollama["options"] == {"top_k": 5, "top_p": 0.5}
    error = await _refused(connection, chat(model="program", sampling=pb.Sampling(top_k=5)))
    assert error.param == "top_k" and "cannot take top_k" in error.message
    assert kinds(await collect(await connection.open_run(chat(model="program"))))[-1] == "complete"
    mock = await collect(await connection.open_run(chat(model="mock-small", sampling=pb.Sampling(top_k=5))))
    assert kinds(mock)[-1] == "complete"


async def test_a_call_whose_id_and_name_come_in_every_fragment_streams_them_once(connection: Connection) -> None:
    request = chat(model="repeats")
    request.openai_fields.update({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}})
    events = await collect(await connection.open_run(request))
    fragments = [call for event in events if event.HasField("delta") for call in event.delta.tool_calls]
    assert [(f.index, f.id, f.function_name, f.arguments) for f in fragments] == [
        (0, "call__0_lookup", "lookup", '{"q'),
        (0, "", "", '": '),
        (0, "", "", "1}"),
    ], "the empty last fragment is dropped"
    assert events[-1].complete.finish_reason == pb.FINISH_REASON_TOOL_CALLS
