"""The vllm and ollama adapters against real servers: llama-cpp-python's OpenAI-compatible
server and Ollama, both serving the tiny model the suite generates (tests/backends).

The tiny model's text is random words: these tests assert protocol and shape, not text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from backends.servers import BackendServer, llama_server
from conftest import Pki, assert_eventually
from node_helpers import chat, client, collect, kinds, node_settings, running_node, text

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.bootstrap import NodeApp
from iop_node.domain import RunStatus


def _established(port: int) -> int:
    """TCP connections on this machine to 127.0.0.1:``port`` in state ESTABLISHED (from /proc)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state = fields[2], fields[3]
        if remote == f"0100007F:{port:04X}" and state == "01":
            count += 1
    return count


def _routes(llama: BackendServer | None = None, ollama: BackendServer | None = None) -> list[dict[str, object]]:
    routes: list[dict[str, object]] = [{"model": "mock-small", "adapter": "mock"}]
    if llama is not None:
        options = {"base_url": llama.base_url, "health_interval": 0.2}
        routes.append({"model": "tiny-chat", "adapter": "vllm", "target": "tiny", "options": options})
    if ollama is not None:
        options = {"base_url": ollama.base_url, "health_interval": 0.2}
        routes.append({"model": "tiny", "adapter": "ollama", "options": options})
        routes.append({"model": "absent", "adapter": "ollama", "target": "no-such-model", "options": options})
    return routes


@pytest.fixture
async def llama_node(pki: Pki, tmp_path: Path, llama_backend: BackendServer) -> AsyncIterator[NodeApp]:
    async with running_node(node_settings(pki, tmp_path, _routes(llama=llama_backend))) as app:
        yield app


@pytest.fixture
async def ollama_node(pki: Pki, tmp_path: Path, ollama_backend: BackendServer) -> AsyncIterator[NodeApp]:
    async with running_node(node_settings(pki, tmp_path, _routes(ollama=ollama_backend))) as app:
        yield app


# -- vllm adapter against llama-cpp-python --------------------------------------------------------


async def test_vllm_streams_and_counts_usage_on_the_node(llama_node: NodeApp, pki: Pki) -> None:
    connection = await client(llama_node, pki)
    events = await collect(await connection.open_run(chat(model="tiny-chat", sampling=pb.Sampling(max_tokens=12))))
    assert kinds(events)[0] == "start" and kinds(events)[-1] == "complete"
    assert events[0].start.model == "tiny" and events[0].start.adapter == "vllm"
    assert kinds(events).count("delta") >= 2 and text(events)
    complete = events[-1].complete
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH
    # llama-cpp-python sends no usage chunk in streams: the node counts its chunks (one token
    # each), and says the count is its own
    assert complete.usage.estimated and complete.usage.completion_tokens == 12
    assert complete.usage.prompt_tokens > 0
    await connection.close()


async def test_vllm_non_streaming_uses_the_backends_usage(llama_node: NodeApp, pki: Pki) -> None:
    connection = await client(llama_node, pki)
    request = chat(model="tiny-chat", sampling=pb.Sampling(max_tokens=7))
    request.stream = False
    events = await collect(await connection.open_run(request))
    assert kinds(events) == ["start", "delta", "complete"]
    usage = events[-1].complete.usage
    assert not usage.estimated and usage.completion_tokens == 7 and usage.prompt_tokens > 0
    await connection.close()


async def test_vllm_capabilities_come_from_v1_models(llama_node: NodeApp, pki: Pki) -> None:
    connection = await client(llama_node, pki)
    capabilities = await connection.capabilities()
    vllm = next(a for a in capabilities.adapters if a.name == "vllm")
    assert [(m.name, m.available) for m in vllm.models] == [("tiny-chat", True)]
    await connection.close()


async def test_vllm_stop_sequence_and_max_tokens(llama_node: NodeApp, pki: Pki) -> None:
    connection = await client(llama_node, pki)
    free = text(
        await collect(await connection.open_run(chat(model="tiny-chat", sampling=pb.Sampling(max_tokens=16, seed=1))))
    )
    words = free.split()
    assert len(words) >= 4
    stop = words[3]
    stopped = await collect(
        await connection.open_run(chat(model="tiny-chat", sampling=pb.Sampling(max_tokens=16, seed=1, stop=[stop])))
    )
    assert stopped[-1].complete.finish_reason == pb.FINISH_REASON_STOP
    assert stop not in text(stopped) and free.startswith(text(stopped))
    await connection.close()


async def test_vllm_completion_and_embeddings(
    pki: Pki, tmp_path: Path, llama_backend: BackendServer, llama_embedding_backend: BackendServer
) -> None:
    routes = _routes(llama=llama_backend)
    routes.append(
        {
            "model": "tiny-embed",
            "adapter": "vllm",
            "target": "tiny",
            "options": {"base_url": llama_embedding_backend.base_url},
        }
    )
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        connection = await client(app, pki)
        completion = pb.RunRequest(
            run_id="c",
            model="tiny-chat",
            kind=pb.RUN_KIND_COMPLETION,
            prompt=["Once upon"],
            stream=True,
            sampling=pb.Sampling(max_tokens=5),
        )
        events = await collect(await connection.open_run(completion))
        assert kinds(events)[-1] == "complete" and text(events)
        embed = pb.RunRequest(run_id="e", model="tiny-embed", kind=pb.RUN_KIND_EMBEDDING, prompt=["one", "two words"])
        events = await collect(await connection.open_run(embed))
        vectors = events[1].delta.embeddings
        assert [v.index for v in vectors] == [0, 1] and len(vectors[0].values) == 64
        await connection.close()


async def test_vllm_cancel_closes_the_backend_connection(
    llama_node: NodeApp, pki: Pki, llama_backend: BackendServer
) -> None:
    connection = await client(llama_node, pki)
    stream = await connection.open_run(chat(model="tiny-chat", run_id="long", sampling=pb.Sampling(max_tokens=4000)))
    assert kinds([await anext(stream), await anext(stream)]) == ["start", "delta"]
    streaming = _established(llama_backend.port)
    assert streaming >= 1
    await stream.cancel("enough of that")
    final = await collect(stream)
    assert final[-1].error.code == pb.ERROR_CODE_CANCELLED
    await assert_eventually(lambda: _established(llama_backend.port) == streaming - 1)
    record = await llama_node.store.get("long")  # type: ignore[attr-defined]
    assert record.status is RunStatus.CANCELLED and record.error_message == "enough of that"
    await connection.close()


async def test_vllm_backend_killed_mid_stream(pki: Pki, tmp_path: Path, llama_backend_fresh: BackendServer) -> None:
    async with running_node(node_settings(pki, tmp_path, _routes(llama=llama_backend_fresh))) as app:
        connection = await client(app, pki)
        stream = await connection.open_run(chat(model="tiny-chat", sampling=pb.Sampling(max_tokens=4000)))
        assert kinds([await anext(stream), await anext(stream)]) == ["start", "delta"]
        llama_backend_fresh.kill()
        final = (await collect(stream))[-1]
        assert final.error.code == pb.ERROR_CODE_UNAVAILABLE and final.error.retryable
        assert not app.node.status().models[1].available  # marked down until a probe sees it back
        assert kinds(await collect(await connection.open_run(chat())))[-1] == "complete"
        await connection.close()


async def test_vllm_model_list_reads_never_interrupt_a_stream(pki: Pki, tmp_path: Path, tiny_gguf: Path) -> None:
    """llama-cpp-python as started by default (interrupt_requests true) ends a running stream when
    any other request arrives, GET /v1/models included; the node reads the list only when idle."""
    with llama_server(tiny_gguf, interrupt_requests=True, workdir=tmp_path / "llama") as llama:
        options = {"base_url": llama.openai_url, "health_interval": 0.2}  # written the OpenAI way, with /v1
        routes = [
            {"model": "tiny-chat", "adapter": "vllm", "target": "tiny", "options": options},
            {"model": "tiny-dev", "adapter": "vllm", "target": "tiny", "options": {**options, "developer_role": True}},
        ]
        async with running_node(node_settings(pki, tmp_path, routes)) as app:
            connection = await client(app, pki)
            assert [m.available for a in (await connection.capabilities()).adapters for m in a.models] == [True, True]
            failed = await collect(await connection.open_run(_developer_chat("tiny-dev")))  # a failed run: list stale
            assert failed[-1].error.code == pb.ERROR_CODE_BACKEND_ERROR
            stream = await connection.open_run(chat(model="tiny-chat", sampling=pb.Sampling(max_tokens=300)))
            assert kinds([await anext(stream), await anext(stream)]) == ["start", "delta"]
            for _ in range(3):  # capability requests mid-stream are answered from the list as last read
                models = [m for a in (await connection.capabilities()).adapters for m in a.models]
                assert [m.available for m in models] == [True, True]
            rest = await collect(stream)
            complete = rest[-1].complete  # an interrupted stream would end without a finish_reason
            assert complete.finish_reason == pb.FINISH_REASON_LENGTH
            assert complete.usage.completion_tokens == 300 == 1 + kinds(rest).count("delta")
            await connection.close()


def _developer_chat(model: str) -> pb.RunRequest:
    request = chat(model=model)
    request.messages.insert(0, pb.ChatMessage(role=pb.ROLE_DEVELOPER, content=[pb.ContentPart(text="Be brief.")]))
    request.sampling.max_tokens = 4
    return request


async def test_vllm_sends_the_developer_role_as_system_by_default(llama_node: NodeApp, pki: Pki) -> None:
    connection = await client(llama_node, pki)
    events = await collect(await connection.open_run(_developer_chat("tiny-chat")))
    assert kinds(events)[-1] == "complete", events[-1]  # llama-cpp-python answers 500 to "developer"
    await connection.close()


async def test_vllm_one_vector_per_token_names_the_fix(pki: Pki, tmp_path: Path, tiny_gguf: Path) -> None:
    with llama_server(tiny_gguf, embedding=True, pooling=False, workdir=tmp_path / "llama") as llama:
        routes = [{"model": "tiny-embed", "adapter": "vllm", "target": "tiny", "options": {"base_url": llama.base_url}}]
        async with running_node(node_settings(pki, tmp_path, routes)) as app:
            connection = await client(app, pki)
            embed = pb.RunRequest(run_id="e", model="tiny-embed", kind=pb.RUN_KIND_EMBEDDING, prompt=["two words"])
            error = (await collect(await connection.open_run(embed)))[-1].error
            assert error.code == pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR
            assert "one vector per token" in error.message and "pooling_type" in error.message
            await connection.close()


# -- ollama adapter against Ollama -----------------------------------------------------------------


async def test_ollama_streams_chat_with_usage_done_reason_and_timings(
    ollama_node: NodeApp, pki: Pki, ollama_backend: BackendServer
) -> None:
    connection = await client(ollama_node, pki)
    before = _established(ollama_backend.port)
    events = await collect(await connection.open_run(chat(model="tiny", sampling=pb.Sampling(max_tokens=10, seed=3))))
    assert kinds(events)[0] == "start" and kinds(events)[-1] == "complete"
    assert events[0].start.adapter == "ollama" and kinds(events).count("delta") >= 2
    complete = events[-1].complete
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH  # done_reason "length"
    assert not complete.usage.estimated
    assert complete.usage.completion_tokens == 10 and complete.usage.prompt_tokens > 0
    assert complete.timings.generation.ToNanoseconds() > 0 and complete.timings.HasField("time_to_first_token")
    for _ in range(2):  # the done line ends each stream; its connection is kept for the next one
        again = await collect(await connection.open_run(chat(model="tiny", sampling=pb.Sampling(max_tokens=5))))
        assert kinds(again)[-1] == "complete", again[-1]
    assert _established(ollama_backend.port) == before + 1
    await connection.close()


async def test_ollama_tags_generate_and_unknown_model(ollama_node: NodeApp, pki: Pki) -> None:
    connection = await client(ollama_node, pki)
    capabilities = await connection.capabilities()
    ollama = {m.name: m.available for a in capabilities.adapters if a.name == "ollama" for m in a.models}
    assert ollama == {"tiny": True, "absent": False}
    completion = pb.RunRequest(
        run_id="g",
        model="tiny",
        kind=pb.RUN_KIND_COMPLETION,
        prompt=["Once"],
        stream=True,
        sampling=pb.Sampling(max_tokens=4),
    )
    events = await collect(await connection.open_run(completion))
    assert kinds(events)[-1] == "complete" and events[-1].complete.usage.completion_tokens == 4
    embed = pb.RunRequest(run_id="oe", model="tiny", kind=pb.RUN_KIND_EMBEDDING, prompt=["one", "two words"])
    vectors = (await collect(await connection.open_run(embed)))[1].delta.embeddings
    assert [v.index for v in vectors] == [0, 1] and len(vectors[0].values) == 64
    missing = await collect(await connection.open_run(chat(model="absent")))
    assert missing[-1].error.code == pb.ERROR_CODE_MODEL_NOT_FOUND and "not found" in missing[-1].error.message
    await connection.close()


async def test_ollama_cancel_mid_stream(ollama_node: NodeApp, pki: Pki, ollama_backend: BackendServer) -> None:
    connection = await client(ollama_node, pki)
    stream = await connection.open_run(chat(model="tiny", run_id="o-long", sampling=pb.Sampling(max_tokens=4000)))
    assert kinds([await anext(stream), await anext(stream)]) == ["start", "delta"]
    streaming = _established(ollama_backend.port)
    await stream.cancel("stop generating")
    assert (await collect(stream))[-1].error.code == pb.ERROR_CODE_CANCELLED
    await assert_eventually(lambda: _established(ollama_backend.port) == streaming - 1)
    assert (
        kinds(await collect(await connection.open_run(chat(model="tiny", sampling=pb.Sampling(max_tokens=3)))))[-1]
        == "complete"
    )
    await connection.close()
