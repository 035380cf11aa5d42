"""Backend failures, each with its IOP error code, through a real node; the node keeps serving.

The misbehaving backend is a small OpenAI-compatible server written here (aiohttp.web on
127.0.0.1 port 0) that fails on purpose in the way the model name asks; a real llama.cpp server
cannot be made to answer 500 or send a broken line on demand.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from conftest import Pki, assert_eventually
from node_helpers import chat, client, collect, kinds, node_settings, running_node, text

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.bootstrap import NodeApp
from iop_node.domain import RunStatus

_CHUNK = {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "ok "}}]}


_TOOL_CHUNKS = [
    {
        "choices": [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_7",
                            "type": "function",
                            "function": {"name": "lookup", "arguments": ""},
                        }
                    ]
                },
            }
        ]
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"q": 1}'}}]},
                "logprobs": {
                    "content": [
                        {
                            "token": "x",
                            "logprob": -0.5,
                            "bytes": [120],
                            "top_logprobs": [{"token": "x", "logprob": -0.5, "bytes": [120]}],
                        }
                    ]
                },
            }
        ]
    },
    {
        "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 8}},
    },
]
SEEN: list[dict[str, object]] = []


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    SEEN.append({"body": body, "authorization": request.headers.get("Authorization")})
    model = body["model"]
    if model == "slowstart":  # headers after longer than the idle timeout, within first_byte
        await asyncio.sleep(0.6)
    statuses = {"gone": 404, "boom": 500, "busy": 429, "picky": 400}
    if model in statuses:
        message = f"scripted {statuses[model]} for model {model!r}"
        return web.json_response({"error": {"message": message}}, status=statuses[model])
    if model == "stalljson":  # a plain JSON answer whose body stops halfway
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
        await response.prepare(request)
        await response.write(b'{"choices": [')
        await asyncio.sleep(30)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if model == "tools":
        for chunk in _TOOL_CHUNKS:
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response
    await response.write(b"data: " + json.dumps(_CHUNK).encode() + b"\n\n")
    if model == "garbled":
        await response.write(b"data: {this is not json\n\n")
    elif model in ("numeric", "surrogate"):  # content protobuf cannot carry: a number, half an emoji
        content = b"5" if model == "numeric" else b'"\\ud83d"'
        await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": %s}}]}\n\n' % content)
    elif model == "stall":
        await asyncio.sleep(30)
    elif model == "trickle":  # never idle for long, never done
        for _ in range(300):
            await asyncio.sleep(0.1)
            await response.write(b"data: " + json.dumps(_CHUNK).encode() + b"\n\n")
    elif model == "cutoff":
        pass  # ends without a finish_reason or [DONE]
    else:
        final = {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        }
        await response.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
    return response


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fine", "object": "model"}]})


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def _serve(port: int, tls: ssl.SSLContext | None = None) -> web.AppRunner:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
    return runner


MODELS = [
    *("fine", "gone", "boom", "busy", "picky", "garbled", "numeric", "surrogate"),
    *("cutoff", "stall", "tools", "slowstart"),
]


@pytest.fixture
async def scripted() -> AsyncIterator[int]:
    port = _free_port()
    runner = await _serve(port)
    yield port
    await runner.cleanup()


@pytest.fixture
async def node(pki: Pki, tmp_path: Path, scripted: int) -> AsyncIterator[NodeApp]:
    options = {
        "base_url": f"http://127.0.0.1:{scripted}",
        "api_key": "sk-test-key",
        "timeouts": {"idle": 0.3, "first_byte": 5},
        "health_interval": 0.1,
    }
    routes = [{"model": m, "adapter": "vllm", "options": options} for m in MODELS]
    routes.append({"model": "mock-small", "adapter": "mock"})
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        yield app


@pytest.mark.parametrize(
    ("model", "code", "retryable", "message"),
    [
        ("gone", pb.ERROR_CODE_MODEL_NOT_FOUND, False, "scripted 404 for model 'gone'"),
        ("boom", pb.ERROR_CODE_BACKEND_ERROR, False, "HTTP 500: scripted 500"),
        ("busy", pb.ERROR_CODE_RESOURCE_EXHAUSTED, True, "HTTP 429"),
        ("picky", pb.ERROR_CODE_INVALID_ARGUMENT, False, "HTTP 400"),
        ("garbled", pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR, False, "not JSON"),
        ("numeric", pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR, False, "content is a int, not a string"),
        ("surrogate", pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR, False, "surrogates not allowed"),
        ("cutoff", pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR, False, "without a finish_reason"),
        ("stall", pb.ERROR_CODE_UNAVAILABLE, True, "stalled, no data for 0.3 s"),
    ],
)
async def test_backend_failure_maps_to_its_code(  # noqa: PLR0917 - the case table's columns
    node: NodeApp, pki: Pki, model: str, code: int, retryable: bool, message: str
) -> None:
    connection = await client(node, pki)
    events = await collect(await connection.open_run(chat(model=model, run_id=f"r-{model}")))
    error = events[-1].error
    assert (error.code, error.retryable) == (code, retryable), error
    assert message in error.message
    assert (await node.store.get(f"r-{model}")).status is RunStatus.FAILED  # type: ignore[attr-defined]
    assert kinds(await collect(await connection.open_run(chat(model="fine"))))[-1] == "complete"
    assert kinds(await collect(await connection.open_run(chat())))[-1] == "complete"
    await connection.close()


async def test_healthy_backend_streams_with_usage(node: NodeApp, pki: Pki) -> None:
    connection = await client(node, pki)
    events = await collect(await connection.open_run(chat(model="fine")))
    assert kinds(events) == ["start", "delta", "complete"]
    assert text(events) == "ok "
    usage = events[-1].complete.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.estimated) == (3, 1, False)
    await connection.close()


async def test_backend_not_running_then_coming_back(pki: Pki, tmp_path: Path) -> None:
    port = _free_port()  # nothing listens here yet
    options = {"base_url": f"http://127.0.0.1:{port}", "health_interval": 0.1}
    routes = [{"model": "fine", "adapter": "vllm", "options": options}, {"model": "mock-small", "adapter": "mock"}]
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        connection = await client(app, pki)
        events = await collect(await connection.open_run(chat(model="fine")))
        assert events[-1].error.code == pb.ERROR_CODE_UNAVAILABLE and events[-1].error.retryable
        assert "cannot reach" in events[-1].error.message
        assert [m.available for m in app.node.status().models] == [False, True]
        capabilities = await connection.capabilities()
        vllm = next(a for a in capabilities.adapters if a.name == "vllm")
        assert not vllm.models[0].available
        assert kinds(await collect(await connection.open_run(chat())))[-1] == "complete"
        runner = await _serve(port)  # the backend starts: the health probe sees it
        try:
            await assert_eventually(lambda: app.node.status().models[0].available)
            assert kinds(await collect(await connection.open_run(chat(model="fine"))))[-1] == "complete"
        finally:
            await runner.cleanup()
        await connection.close()


async def test_openai_fields_pass_through_and_tool_calls_logprobs_usage_come_back(node: NodeApp, pki: Pki) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    request = chat(model="tools", sampling=pb.Sampling(temperature=0.2, seed=5, stop=["END"]))
    request.openai_fields.update(
        {"tools": tools, "tool_choice": "auto", "logprobs": True, "top_logprobs": 1, "user": "u-1"}
    )
    SEEN.clear()
    connection = await client(node, pki)
    events = await collect(await connection.open_run(request))
    sent = SEEN[-1]["body"]
    assert SEEN[-1]["authorization"] == "Bearer sk-test-key"
    assert sent["tools"] == tools and sent["tool_choice"] == "auto" and sent["logprobs"] is True  # type: ignore[index]
    assert sent["top_logprobs"] == 1 and sent["user"] == "u-1"  # type: ignore[index]
    assert (sent["temperature"], sent["seed"], sent["stop"]) == (0.2, 5, ["END"])  # type: ignore[index]
    assert sent["stream_options"] == {"include_usage": True}  # type: ignore[index]
    assert sent["messages"] == [{"role": "user", "content": "hello there"}]  # type: ignore[index]
    first, second = events[1].delta, events[2].delta
    assert (first.tool_calls[0].id, first.tool_calls[0].function_name) == ("call_7", "lookup")
    assert second.tool_calls[0].arguments == '{"q": 1}' and second.tool_calls[0].index == 0
    assert second.logprobs[0].token == "x" and second.logprobs[0].bytes == b"x"
    assert second.logprobs[0].top_logprobs[0].logprob == -0.5
    complete = events[-1].complete
    assert complete.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert (complete.usage.prompt_tokens, complete.usage.completion_tokens, complete.usage.cached_tokens) == (9, 4, 8)
    await connection.close()


async def test_first_byte_and_idle_timeouts_are_separate(node: NodeApp, pki: Pki) -> None:
    connection = await client(node, pki)
    events = await collect(await connection.open_run(chat(model="slowstart")))  # 0.6 s to headers, idle is 0.3 s
    assert kinds(events) == ["start", "delta", "complete"]
    await connection.close()


async def test_a_stream_past_the_total_timeout_is_cut(pki: Pki, tmp_path: Path, scripted: int) -> None:
    options = {"base_url": f"http://127.0.0.1:{scripted}", "timeouts": {"idle": 0.3, "total": 0.8}}
    routes = [{"model": "trickle", "adapter": "vllm", "options": options}, {"model": "mock-small", "adapter": "mock"}]
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        connection = await client(app, pki)
        events = await collect(await connection.open_run(chat(model="trickle")))
        assert kinds(events)[:3] == ["start", "delta", "delta"]  # chunks kept coming, 0.1 s apart
        error = events[-1].error
        assert (error.code, error.retryable) == (pb.ERROR_CODE_UNAVAILABLE, True)
        assert "the response took over 0.8 s" in error.message
        assert kinds(await collect(await connection.open_run(chat())))[-1] == "complete"
        await connection.close()


async def test_an_https_backend_verified_with_the_routes_ca(pki: Pki, tmp_path: Path) -> None:
    backend = pki.config("backend", None)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(backend.cert, backend.key)  # type: ignore[arg-type]
    port = _free_port()
    runner = await _serve(port, tls)
    url = f"https://127.0.0.1:{port}"
    routes = [
        {"model": "fine", "adapter": "vllm", "options": {"base_url": url, "ca": str(backend.ca)}},
        # another base URL, so another pool (routes with the same one share the first one's)
        {
            "model": "fine-untrusted",
            "adapter": "vllm",
            "target": "fine",
            "options": {"base_url": f"https://localhost:{port}"},
        },
    ]
    try:
        async with running_node(node_settings(pki, tmp_path, routes)) as app:
            connection = await client(app, pki)
            events = await collect(await connection.open_run(chat(model="fine")))
            assert kinds(events) == ["start", "delta", "complete"] and text(events) == "ok "
            events = await collect(await connection.open_run(chat(model="fine-untrusted")))
            error = events[-1].error  # the system's CAs do not know the test CA
            assert error.code == pb.ERROR_CODE_UNAVAILABLE and "certificate verify failed" in error.message
            await connection.close()
    finally:
        await runner.cleanup()


async def test_timeouts_fail_the_run_but_leave_the_backend_up(pki: Pki, tmp_path: Path, scripted: int) -> None:
    options = {"base_url": f"http://127.0.0.1:{scripted}", "timeouts": {"first_byte": 0.3, "idle": 0.3}}
    routes = [{"model": m, "adapter": "vllm", "options": options} for m in ("slowstart", "stalljson", "fine")]
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        connection = await client(app, pki)
        error = (await collect(await connection.open_run(chat(model="slowstart"))))[-1].error
        assert (error.code, error.retryable) == (pb.ERROR_CODE_UNAVAILABLE, True)
        assert "no response within 0.3 s" in error.message
        assert all(model.available for model in app.node.status().models)  # slow is not down
        whole = chat(model="stalljson")
        whole.stream = False
        error = (await collect(await connection.open_run(whole)))[-1].error
        assert (error.code, error.retryable) == (pb.ERROR_CODE_UNAVAILABLE, True)
        assert "stalled, no data for 0.3 s" in error.message
        assert all(model.available for model in app.node.status().models)
        assert kinds(await collect(await connection.open_run(chat(model="fine"))))[-1] == "complete"
        await connection.close()


def _connections_to(port: int) -> int:
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for row in rows if row.split()[2] == f"0100007F:{port:04X}" and row.split()[3] == "01")


async def test_finished_streams_keep_their_backend_connection_alive(node: NodeApp, pki: Pki, scripted: int) -> None:
    connection = await client(node, pki)
    for _ in range(5):
        assert kinds(await collect(await connection.open_run(chat(model="fine"))))[-1] == "complete"
    assert _connections_to(scripted) == 1  # one pooled keep-alive connection served all five
    await connection.close()


async def test_a_closed_backend_fails_requests_without_starting_a_health_probe(scripted: int) -> None:
    from iop_node.adapters.http import Backend, HttpOptions
    from iop_wire.errors import IopError

    backend = Backend(HttpOptions(base_url=f"http://127.0.0.1:{scripted}"), health_path="/v1/models", name="vllm t")
    assert (await backend.get_json("/v1/models"))["data"][0]["id"] == "fine"
    await backend.aclose()
    with pytest.raises(IopError, match="the client is closed") as caught:
        await backend.get_json("/v1/models")
    assert caught.value.code == pb.ERROR_CODE_UNAVAILABLE
    assert backend._probe is None  # nothing left running after shutdown
