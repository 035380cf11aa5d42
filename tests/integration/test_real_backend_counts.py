"""Token counts and top_k against real servers (tests/backends, the tiny model): through the vllm
adapter to llama-cpp-python, a count by chat is the prompt's usage a chat of the same conversation
reports, a route that asks it for vLLM's /tokenize is refused saying the backend cannot count, and
top_k reaches the sampler; through the ollama adapter to Ollama, top_k reaches it as its option and
a count is refused. Skipped (failed with IOP_BACKENDS_REQUIRED=1) when tests/backends/install.sh has
not run."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from backends.servers import BackendServer
from conftest import Pki
from node_helpers import chat, client, collect, kinds, node_settings, running_node, text

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture
async def connection(pki: Pki, tmp_path: Path, llama_backend: BackendServer) -> AsyncIterator[Connection]:
    options = {"base_url": llama_backend.base_url, "health_interval": 0.2}
    routes = [
        {"model": "counted", "adapter": "vllm", "target": "tiny", "options": {**options, "count_tokens": "chat"}},
        {"model": "asks-vllm", "adapter": "vllm", "target": "tiny", "options": {**options, "count_tokens": "tokenize"}},
    ]
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        connection = await client(app, pki)
        yield connection
        await connection.close()


def _conversation(request: pb.RunRequest, *, tools: bool) -> pb.RunRequest:
    request.messages.insert(0, pb.ChatMessage(role=pb.ROLE_SYSTEM, content=[pb.ContentPart(text="be brief")]))
    if tools:
        request.openai_fields.update({"tools": TOOLS})
    return request


async def _prompt_usage(connection: Connection, *, tools: bool) -> int:
    """The prompt tokens llama-cpp-python reports for a chat of the conversation."""
    request = _conversation(chat(model="counted", sampling=pb.Sampling(max_tokens=2)), tools=tools)
    request.stream = False  # its streams carry no usage
    events = await collect(await connection.open_run(request))
    assert kinds(events)[-1] == "complete" and not events[-1].complete.usage.estimated
    return events[-1].complete.usage.prompt_tokens


async def _count(connection: Connection, model: str, *, tools: bool) -> list[pb.RunEvent]:
    request = _conversation(chat(model=model, kind=pb.RUN_KIND_COUNT_TOKENS), tools=tools)
    return await collect(await connection.open_run(request))


@pytest.mark.parametrize("tools", [False, True], ids=["chat", "chat-with-tools"])
async def test_a_count_by_chat_is_the_prompt_usage_of_the_same_chat(connection: Connection, tools: bool) -> None:
    events = await _count(connection, "counted", tools=tools)
    assert kinds(events) == ["start", "complete"]
    complete = events[-1].complete
    assert complete.counted_tokens == await _prompt_usage(connection, tools=tools) > 0
    assert complete.usage == pb.Usage()


async def test_a_server_without_vllms_tokenize_cannot_count(connection: Connection) -> None:
    error = (await _count(connection, "asks-vllm", tools=False))[-1].error
    assert error.code == pb.ERROR_CODE_INVALID_ARGUMENT and error.param == "model"
    assert "the backend of model 'asks-vllm' cannot count tokens" in error.message and "/tokenize" in error.message
    events = await _count(connection, "counted", tools=False)
    assert kinds(events)[-1] == "complete", "the backend is still up"


async def test_top_k_1_samples_greedily_whatever_the_temperature(connection: Connection) -> None:
    async def answer(sampling: pb.Sampling) -> str:
        events = await collect(await connection.open_run(chat(model="counted", sampling=sampling)))
        assert kinds(events)[-1] == "complete"
        return text(events)

    greedy = await answer(pb.Sampling(max_tokens=12, temperature=0))
    hot = [await answer(pb.Sampling(max_tokens=12, temperature=2, seed=seed)) for seed in (1, 2, 3)]
    assert any(sample != greedy for sample in hot), "at temperature 2 the tiny model's samples differ"
    assert all(
        [await answer(pb.Sampling(max_tokens=12, temperature=2, seed=seed, top_k=1)) == greedy for seed in (1, 2, 3)]
    )


async def test_ollama_takes_top_k_as_its_option_and_cannot_count(
    pki: Pki, tmp_path: Path, ollama_backend: BackendServer
) -> None:
    routes = [{"model": "tiny", "adapter": "ollama", "options": {"base_url": ollama_backend.base_url}}]
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        connection = await client(app, pki)

        async def answer(sampling: pb.Sampling) -> str:
            events = await collect(await connection.open_run(chat(model="tiny", sampling=sampling)))
            assert kinds(events)[-1] == "complete", events[-1]
            return text(events)

        greedy = await answer(pb.Sampling(max_tokens=12, temperature=0))
        hot = [await answer(pb.Sampling(max_tokens=12, temperature=2, seed=seed)) for seed in (1, 2, 3)]
        assert any(sample != greedy for sample in hot), "at temperature 2 the tiny model's samples differ"
        for seed in (1, 2, 3):
            assert await answer(pb.Sampling(max_tokens=12, temperature=2, seed=seed, top_k=1)) == greedy
        refused = await collect(await connection.open_run(chat(model="tiny", kind=pb.RUN_KIND_COUNT_TOKENS)))
        assert refused[-1].error.code == pb.ERROR_CODE_INVALID_ARGUMENT and refused[-1].error.param == "model"
        await connection.close()
