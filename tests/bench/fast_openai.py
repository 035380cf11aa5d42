"""A fast OpenAI-compatible streaming server for relay benchmarks: canned chunks, no model.

    python fast_openai.py PORT [TOKENS_PER_SECOND] [--uvicorn]

POST /v1/chat/completions answers ``max_tokens`` SSE chunks, as fast as the socket takes them
or, given TOKENS_PER_SECOND, one chunk at a time at that pace per stream (as real backends emit
tokens), then a usage chunk and ``data: [DONE]``; with ``"stream": false``, one JSON
chat.completion of ``max_tokens`` tokens at once (given TOKENS_PER_SECOND, once they would have
taken that long). GET /v1/models lists one model. HTTP/1.1
keep-alive.

By default the HTTP is a bare asyncio server (a lower bound on any backend's HTTP cost); with
``--uvicorn`` the same answers come from a FastAPI app on uvicorn (uvloop, httptools), the stack
vLLM, SGLang and llama-cpp-python serve their OpenAI APIs with.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

_CHUNK = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "fast",
        "choices": [{"index": 0, "delta": {"content": "tok "}, "logprobs": None, "finish_reason": None}],
    }
).encode()
_MODELS = json.dumps({"object": "list", "data": [{"id": "fast", "object": "model"}]}).encode()


def _chunked(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def _answer_bytes(count: int) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "fast",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "tok " * count}, "finish_reason": "length"}
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": count, "total_tokens": count + 5},
        }
    ).encode()


def _final(count: int) -> dict[str, object]:
    return {
        "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": count, "total_tokens": count + 5},
    }


def _whole(writer: asyncio.StreamWriter, count: int) -> None:
    answer = _answer_bytes(count)
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer)
    )


async def _answer(writer: asyncio.StreamWriter, body: dict[str, object], pace: float) -> None:
    count = int(body.get("max_tokens") or 16)  # type: ignore[call-overload]
    if body.get("stream") is False:
        if pace:  # as long as the tokens would take
            await asyncio.sleep(count / pace)
        _whole(writer, count)
        await writer.drain()
        return
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    loop = asyncio.get_running_loop()
    due = loop.time()
    for index in range(count):
        _chunked(writer, b"data: " + _CHUNK + b"\n\n")
        if pace:  # one token every 1/pace s, on a schedule (not drifting with the send's cost)
            await writer.drain()
            due += 1 / pace
            await asyncio.sleep(max(0.0, due - loop.time()))
        elif index % 64 == 0:
            await writer.drain()
    _chunked(writer, b"data: " + json.dumps(_final(count)).encode() + b"\n\ndata: [DONE]\n\n")
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pace: float) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = json.loads(await reader.readexactly(length)) if length else {}
            if head.startswith(b"GET"):
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(_MODELS), _MODELS)
                )
            else:
                await _answer(writer, body, pace)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def main(port: int, pace: float) -> None:
    server = await asyncio.start_server(lambda r, w: _handle(r, w, pace), "127.0.0.1", port)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


def _fastapi_app(pace: float) -> Any:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(_MODELS, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        count = int(body.get("max_tokens") or 16)
        if body.get("stream") is False:
            if pace:
                await asyncio.sleep(count / pace)
            return Response(_answer_bytes(count), media_type="application/json")

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(count):
                yield b"data: " + _CHUNK + b"\n\n"
                if pace:
                    await asyncio.sleep(1 / pace)
            yield b"data: " + json.dumps(_final(count)).encode() + b"\n\ndata: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def serve_uvicorn(port: int, pace: float) -> None:
    import uvicorn

    sock = socket.create_server(("127.0.0.1", port))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(_fastapi_app(pace), loop="uvloop", http="httptools", log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    arguments = [argument for argument in sys.argv[1:] if argument != "--uvicorn"]
    port, pace = int(arguments[0]) if arguments else 0, float(arguments[1]) if len(arguments) > 1 else 0.0
    if "--uvicorn" in sys.argv:
        serve_uvicorn(port, pace)
    else:
        asyncio.run(main(port, pace))
