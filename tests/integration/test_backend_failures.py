"""Backend failures, each with its IOP error code, through a real node; the node keeps serving.

The misbehaving backend is a small OpenAI-compatible server written here (aiohttp.web on
127.0.0.1 port 0) that fails on purpose in the way the model name asks; a real llama.cpp server
cannot be made to answer 500 or send a broken line on demand. Healthy runs get generous
timeouts; only a run whose timeout is the point gets a short one (2 busy cores can stall a
loop for a few hundred milliseconds).
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import structlog
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
MODEL_LISTS: list[float] = []  # when GET /v1/models was answered
HELD: dict[str, asyncio.Event] = {}  # model "held" streams until the test sets HELD["release"]


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    SEEN.append({"body": body, "authorization": request.headers.get("Authorization")})
    model = body["model"]
    if model == "slowstart":  # headers after longer than the idle timeout, within first_byte
        await asyncio.sleep(1.0)
    refusal = _refusal(model)
    if refusal is not None:
        return refusal
    if model == "stalljson":  # a plain JSON answer whose body stops halfway
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
        await response.prepare(request)
        await response.write(b'{"choices": [')
        await asyncio.sleep(30)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if model == "tools":
        for chunk in _TOOL_CHUNKS:
            await _event(response, chunk)
        await response.write(b"data: [DONE]\n\n")
        return response
    await _event(response, _CHUNK)
    await _STREAM_ENDS.get(model, _usage_and_done)(response)
    return response


def _refusal(model: str) -> web.Response | None:
    statuses = {"gone": 404, "boom": 500, "busy": 429, "picky": 400}
    if model in statuses:
        message = f"scripted {statuses[model]} for model {model!r}"
        return web.json_response({"error": {"message": message}}, status=statuses[model])
    if model == "htmlerror":  # a proxy's error page, far longer than a message should be
        page = "<html><body>" + "<p>Internal Server Error</p>\n" * 2000 + "</body></html>"
        return web.Response(text=page, status=502, content_type="text/html")
    return None


async def _event(response: web.StreamResponse, chunk: object) -> None:
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")


async def _usage_and_done(response: web.StreamResponse) -> None:
    final = {
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    await response.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")


async def _garbled(response: web.StreamResponse) -> None:
    await response.write(b"data: {this is not json\n\n")


async def _uncarriable(response: web.StreamResponse, content: bytes) -> None:
    """Content protobuf cannot carry: a number, half an emoji."""
    await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": %s}}]}\n\n' % content)


async def _stall(response: web.StreamResponse) -> None:
    await asyncio.sleep(30)


async def _trickle(response: web.StreamResponse) -> None:
    """Never idle for long, never done."""
    for _ in range(300):
        await asyncio.sleep(0.1)
        await _event(response, _CHUNK)


async def _cutoff(response: web.StreamResponse) -> None:
    """Ends without a finish_reason or [DONE]."""


async def _no_usage(response: web.StreamResponse, *, held: bool = False) -> None:
    """Three tokens in all, a finish chunk and no usage (llama.cpp's way); ``held`` until released."""
    if held:
        await HELD["release"].wait()
    for _ in range(2):
        await _event(response, _CHUNK)
    final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    await response.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")


_STREAM_ENDS: dict[str, Callable[[web.StreamResponse], Awaitable[None]]] = {
    "garbled": _garbled,
    "numeric": functools.partial(_uncarriable, content=b"5"),
    "surrogate": functools.partial(_uncarriable, content=b'"\\ud83d"'),
    "stall": _stall,
    "trickle": _trickle,
    "cutoff": _cutoff,
    "nousage": _no_usage,
    "held": functools.partial(_no_usage, held=True),
}


async def _models(request: web.Request) -> web.Response:
    MODEL_LISTS.append(time.monotonic())
    return web.json_response({"object": "list", "data": [{"id": "fine", "object": "model"}]})


async def _embeddings(request: web.Request) -> web.Response:
    body = await request.json()
    vector = [[0.25, 0.5], [0.75, 1.0]] if body["model"] == "pertoken" else [0.25, 0.5]
    data = [{"object": "embedding", "index": i, "embedding": vector} for i, _ in enumerate(body["input"])]
    return web.json_response({"object": "list", "data": data, "usage": {"prompt_tokens": 2, "total_tokens": 2}})


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def _serve(port: int, tls: ssl.SSLContext | None = None) -> web.AppRunner:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/embeddings", _embeddings)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
    return runner


MODELS = [
    *("fine", "gone", "boom", "busy", "picky", "garbled", "numeric", "surrogate"),
    *("cutoff", "stall", "tools", "slowstart", "nousage"),
]


@pytest.fixture
async def scripted() -> AsyncIterator[int]:
    port = _free_port()
    runner = await _serve(port)
    yield port
    await runner.cleanup()


_GENEROUS = {"first_byte": 30, "idle": 30}
_SHORT = {"stall": {"first_byte": 30, "idle": 0.3}, "slowstart": {"first_byte": 30, "idle": 0.5}}


@pytest.fixture
async def node(pki: Pki, tmp_path: Path, scripted: int) -> AsyncIterator[NodeApp]:
    options = {"base_url": f"http://127.0.0.1:{scripted}", "api_key": "sk-test-key", "health_interval": 0.1}
    routes = [
        {"model": m, "adapter": "vllm", "options": {**options, "timeouts": _SHORT.get(m, _GENEROUS)}} for m in MODELS
    ]
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
    events = await collect(await connection.open_run(chat(model="slowstart")))  # 1 s to headers, idle is 0.5 s
    assert kinds(events) == ["start", "delta", "complete"]
    await connection.close()


async def test_a_stream_past_the_total_timeout_is_cut(pki: Pki, tmp_path: Path, scripted: int) -> None:
    options = {"base_url": f"http://127.0.0.1:{scripted}", "timeouts": {"idle": 30, "total": 0.8}}
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
        # the same server without the route's CA: its own pool, verified with the system's CAs
        {"model": "fine-untrusted", "adapter": "vllm", "target": "fine", "options": {"base_url": url}},
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
    url = f"http://127.0.0.1:{scripted}"
    short = {"base_url": url, "timeouts": {"first_byte": 0.3, "idle": 0.3}}
    routes = [{"model": m, "adapter": "vllm", "options": short} for m in ("slowstart", "stalljson")]
    routes.append({"model": "fine", "adapter": "vllm", "options": {"base_url": url, "timeouts": _GENEROUS}})
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
    from iop_node.adapters.http import Backends, HttpOptions
    from iop_node.adapters.shapes import model_names
    from iop_wire.errors import IopError

    backends = Backends(
        {"m": HttpOptions(base_url=f"http://127.0.0.1:{scripted}")},
        kind="vllm",
        list_path="/v1/models",
        list_models=lambda document: model_names(document, "data", "id"),
    )
    endpoint = backends["m"]
    assert (await endpoint.get_json("/v1/models"))["data"][0]["id"] == "fine"
    await backends.aclose()
    with pytest.raises(IopError, match="the client is closed") as caught:
        await endpoint.get_json("/v1/models")
    assert caught.value.code == pb.ERROR_CODE_UNAVAILABLE
    assert endpoint.backend._probe is None  # nothing left running after shutdown


def _vllm(model: str, port: int, **options: object) -> dict[str, object]:
    return {"model": model, "adapter": "vllm", "options": {"base_url": f"http://127.0.0.1:{port}", **options}}


async def test_routes_sharing_a_base_url_each_send_their_own_key(pki: Pki, tmp_path: Path, scripted: int) -> None:
    routes = [
        {**_vllm("fine-a", scripted, api_key="key-A"), "target": "fine"},
        {**_vllm("fine-b", scripted, api_key="key-B"), "target": "fine"},
        {**_vllm("fine-open", scripted), "target": "fine"},
    ]
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        connection = await client(app, pki)
        sent = []
        for model in ("fine-b", "fine-a", "fine-open", "fine-b"):
            SEEN.clear()
            assert kinds(await collect(await connection.open_run(chat(model=model))))[-1] == "complete"
            sent.append(SEEN[-1]["authorization"])
        assert sent == ["Bearer key-B", "Bearer key-A", None, "Bearer key-B"]
        assert _connections_to(scripted) == 1  # one pool (same base URL, same CA), each request its own key
        await connection.close()


async def test_a_base_url_ending_in_v1_works(pki: Pki, tmp_path: Path, scripted: int) -> None:
    routes = [_vllm("fine", scripted), {**_vllm("fine-v1", scripted), "target": "fine"}]
    routes[1]["options"]["base_url"] += "/v1/"  # type: ignore[index]
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        connection = await client(app, pki)
        events = await collect(await connection.open_run(chat(model="fine-v1")))
        assert kinds(events) == ["start", "delta", "complete"]
        vllm = next(a for a in (await connection.capabilities()).adapters if a.name == "vllm")
        assert [(m.name, m.available) for m in vllm.models] == [("fine", True), ("fine-v1", True)]
        await connection.close()


async def test_streamed_chunks_are_counted_when_the_backend_sends_no_usage(node: NodeApp, pki: Pki) -> None:
    connection = await client(node, pki)
    request = chat(model="nousage", text="x" * 40)  # "user: " + 40 characters: ~12 tokens
    events = await collect(await connection.open_run(request))
    assert kinds(events) == ["start", "delta", "delta", "delta", "complete"]
    usage = events[-1].complete.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.estimated) == (12, 3, True)
    await connection.close()


async def test_each_backend_failure_leaves_one_log_line(node: NodeApp, pki: Pki) -> None:
    connection = await client(node, pki)
    with structlog.testing.capture_logs() as logs:
        for model in ("boom", "garbled", "gone"):
            await collect(await connection.open_run(chat(model=model, run_id=f"log-{model}")))
    failed = [(e["run_id"], e["status"], e["code"]) for e in logs if e["event"] == "backend request failed"]
    assert failed == [
        ("log-boom", 500, "BACKEND_ERROR"),
        ("log-garbled", None, "BACKEND_PROTOCOL_ERROR"),
        ("log-gone", 404, "MODEL_NOT_FOUND"),
    ]
    line = next(e for e in logs if e["event"] == "backend request failed")
    assert line["log_level"] == "warning" and line["backend"].startswith("vllm http://127.0.0.1:")
    assert "sk-test-key" not in str(logs)
    await connection.close()


async def test_error_messages_from_a_backend_are_capped(pki: Pki, tmp_path: Path, scripted: int) -> None:
    async with running_node(node_settings(pki, tmp_path, [_vllm("htmlerror", scripted)])) as app:
        connection = await client(app, pki)
        error = (await collect(await connection.open_run(chat(model="htmlerror"))))[-1].error
        assert error.code == pb.ERROR_CODE_BACKEND_ERROR and "answered HTTP 502: <html>" in error.message
        assert len(error.message) <= 1000 and "\n" not in error.message
        await connection.close()


async def _unreadable(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HELLO THERE, THIS IS NOT HTTP\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client hangs up
    except ConnectionError:
        pass
    finally:
        writer.close()


async def test_an_unreadable_answer_is_a_protocol_error_and_leaves_the_backend_up(pki: Pki, tmp_path: Path) -> None:
    server = await asyncio.start_server(_unreadable, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running_node(node_settings(pki, tmp_path, [_vllm("odd", port)])) as app:
            connection = await client(app, pki)
            error = (await collect(await connection.open_run(chat(model="odd"))))[-1].error
            assert (error.code, error.retryable) == (pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR, False)
            assert "unreadable HTTP response" in error.message
            assert app.node.status().models[0].available  # a server that answers is not down
            await connection.close()
    finally:
        server.close()


async def test_a_server_answering_404_to_everything_is_not_up(pki: Pki, tmp_path: Path) -> None:
    port = _free_port()
    static = subprocess.Popen(  # noqa: ASYNC220 - starts at once; the file server: HTML 404 for GET, 501 for POST
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await assert_eventually(lambda: _listening(port))
        with structlog.testing.capture_logs() as logs:
            async with running_node(node_settings(pki, tmp_path, [_vllm("fine", port, health_interval=0.05)])) as app:
                connection = await client(app, pki)
                vllm = next(a for a in (await connection.capabilities()).adapters if a.name == "vllm")
                assert not vllm.models[0].available
                error = (await collect(await connection.open_run(chat(model="fine"))))[-1].error
                assert error.code == pb.ERROR_CODE_BACKEND_ERROR and "HTTP 501" in error.message
                assert len(error.message) <= 1000
                await asyncio.sleep(0.3)  # several health probes: each reads a 404 page, not a model list
                assert not app.node.status().models[0].available
                await connection.close()
        events = [e["event"] for e in logs]
        assert "backend down" in events and "backend up" not in events
    finally:
        static.terminate()
        static.wait()


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


async def test_developer_role_goes_as_system_unless_the_route_says_the_backend_knows_it(
    pki: Pki, tmp_path: Path, scripted: int
) -> None:
    routes = [
        {**_vllm("plain", scripted), "target": "fine"},
        {**_vllm("knows", scripted, developer_role=True), "target": "fine"},
    ]
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        connection = await client(app, pki)
        for model, role in (("plain", "system"), ("knows", "developer")):
            request = chat(model=model)
            request.messages.insert(
                0, pb.ChatMessage(role=pb.ROLE_DEVELOPER, content=[pb.ContentPart(text="be brief")])
            )
            assert kinds(await collect(await connection.open_run(request)))[-1] == "complete"
            assert SEEN[-1]["body"]["messages"][0] == {"role": role, "content": "be brief"}  # type: ignore[index]
        await connection.close()


async def test_routes_advertise_the_kinds_they_declare_and_refuse_others(
    pki: Pki, tmp_path: Path, scripted: int
) -> None:
    routes = [
        {**_vllm("chat-only", scripted, kinds=["chat", "completion"]), "target": "fine"},
        {**_vllm("embed", scripted), "target": "fine"},
        {**_vllm("pertoken", scripted)},
    ]
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        connection = await client(app, pki)
        vllm = next(a for a in (await connection.capabilities()).adapters if a.name == "vllm")
        assert list(vllm.models[0].kinds) == [pb.RUN_KIND_CHAT, pb.RUN_KIND_COMPLETION]
        assert pb.RUN_KIND_EMBEDDING in vllm.models[1].kinds
        SEEN.clear()
        refused = await collect(await connection.open_run(_embed_request("chat-only")))
        assert refused[-1].error.code == pb.ERROR_CODE_INVALID_ARGUMENT
        assert "serves chat, completion runs, not embedding" in refused[-1].error.message
        events = await collect(await connection.open_run(_embed_request("embed")))
        assert [list(v.values) for v in events[1].delta.embeddings] == [[0.25, 0.5], [0.25, 0.5]]
        error = (await collect(await connection.open_run(_embed_request("pertoken"))))[-1].error
        assert error.code == pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR
        assert "one vector per token" in error.message and "pooling" in error.message
        await connection.close()


def _embed_request(model: str) -> pb.RunRequest:
    return pb.RunRequest(run_id=f"e-{model}", model=model, kind=pb.RUN_KIND_EMBEDDING, prompt=["one", "two"])


async def test_the_model_list_is_not_read_while_a_run_is_in_flight(pki: Pki, tmp_path: Path, scripted: int) -> None:
    routes = [_vllm("fine", scripted), {**_vllm("held", scripted)}, {**_vllm("boom", scripted)}]
    HELD["release"] = asyncio.Event()
    MODEL_LISTS.clear()
    async with running_node(node_settings(pki, tmp_path, routes)) as app:
        connection = await client(app, pki)
        await connection.capabilities()  # idle: the list is read
        assert len(MODEL_LISTS) >= 1
        await collect(await connection.open_run(chat(model="boom")))  # a failed run: read it again when idle
        stream = await connection.open_run(chat(model="held"))
        assert kinds([await anext(stream), await anext(stream)]) == ["start", "delta"]
        before = len(MODEL_LISTS)
        for _ in range(3):
            vllm = next(a for a in (await connection.capabilities()).adapters if a.name == "vllm")
            assert vllm.models[0].available  # from the list as last read
        assert len(MODEL_LISTS) == before  # no request reached the server while the run streamed
        HELD["release"].set()
        assert kinds(await collect(stream))[-1] == "complete"
        await connection.capabilities()
        assert len(MODEL_LISTS) == before + 1  # idle again: the stale list is read at once
        await connection.close()
