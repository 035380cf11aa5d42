"""The OpenAI-compatible HTTP API: FastAPI routes over the control-plane connection pool.

(The Files and Batch APIs go to the worker instead: :mod:`iop_edge.files`, :mod:`iop_edge.batches`;
the web console is :mod:`iop_edge.console`, OpenAI's usage API :mod:`iop_edge.usage_api`.)

Each request is checked (:mod:`iop_wire.openai.requests`), authenticated (an API key, unless
``auth: none``), limited (the key's rpm, tpm and concurrency; the edge's ``max_in_flight``),
submitted as one run (one per prompt for completions) whose caller is the key, and answered in
OpenAI's shapes (:mod:`iop_wire.openai.responses`). A streaming answer starts only once the run has
produced its first output or ended, so a run refused before any output (unknown model, queue
full, no node) gets its proper status, not a 200 stream with an error in it; after that, an
error is a final ``data: {"error": ...}`` event. A client that goes away, streaming or not,
cancels its run.

Headers: ``x-request-id`` is the run id; ``x-iop-overhead-ms`` is the time spent inside IOP:
for a whole answer, the time from the request's arrival to its answer's head leaving (as
the answer is handed to the server) minus the run's
``generation`` time, which is the backend's own time (for an HTTP backend, as the node's client
saw it: from its request written to the response's last byte read; so the node's own work on
the backend's answer counts as IOP's); for a stream, the time from the request's arrival to the
run's ``start`` event (the node has sent its backend request by then), as headers leave before
the rest is known.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.telemetry import TelemetryConfig
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from iop_edge.access import JSON, authenticate, caller_of, error_response, read_body
from iop_edge.admin import AdminLinks
from iop_edge.batches import BatchRoutes
from iop_edge.console import Console
from iop_edge.edge import Edge
from iop_edge.files import FileRoutes
from iop_edge.head import ARRIVED
from iop_edge.keys import ApiKey, LimitExceeded
from iop_edge.messages_api import MessagesRoutes
from iop_edge.responses_api import ResponsesRoutes
from iop_edge.shared import Held
from iop_edge.usage_api import UsageRoutes
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import ConnectionClosed, IopError
from iop_wire.framing import DEFAULT_MAX_FRAME_SIZE
from iop_wire.openai import requests as parse
from iop_wire.openai import responses as shape
from iop_wire.openai.errors import ApiError, from_event, from_iop
from iop_wire.runs import RunStream

__all__ = ["Api", "Call", "Chunks", "Edge", "build_app"]


@dataclass(slots=True)
class Call:
    """One request being served."""

    route: str
    received: float
    """When the request's first byte was read (perf_counter)."""
    run_id: str
    key: ApiKey | None
    lease: Held | None = None
    requested: str = ""
    """The model the request named."""
    model: str = ""
    """The model once a run of it started (a model the platform serves): the metrics' label, so a
    client naming random models adds no series."""
    tokens: int = 0


def build_app(edge: Edge) -> FastAPI:
    """The FastAPI application (no docs pages: this is an API server)."""
    # No OpenTelemetry hooks: deciding per request whether any provider is set costs ~10 us of
    # environment lookups; the edge's own metrics are on /metrics.
    telemetry = TelemetryConfig(tracing=False, metrics=False, logs=False, operation_spans=False)
    app = FastAPI(title="IOP edge", docs_url=None, redoc_url=None, openapi_url=None, telemetry=telemetry)
    api = Api(edge)
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/embeddings", api.embeddings, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.model, methods=["GET"])
    responses = ResponsesRoutes(api, edge)
    responses.register(app)
    app.state.responses = responses  # its store's writes awaited (and its own store closed) at shutdown
    MessagesRoutes(api).register(app)
    FileRoutes(edge).register(app)
    BatchRoutes(edge).register(app)
    UsageRoutes(edge).register(app)
    if edge.admin is None:
        edge.admin = AdminLinks(edge.settings)
    console = Console(edge, edge.admin)
    console.register(app)
    app.state.console = console
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/ready", api.ready, methods=["GET"])
    app.add_api_route("/metrics", api.prometheus, methods=["GET"])

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> Response:
        error = ApiError(404, f"Invalid URL ({request.method} {request.url.path})", code="unknown_url")
        return Response(error.content(), status_code=404, media_type=JSON)

    @app.exception_handler(405)
    async def _wrong_method(request: Request, exc: Exception) -> Response:
        error = ApiError(405, f"Method not allowed ({request.method} {request.url.path})", code="method_not_allowed")
        return Response(error.content(), status_code=405, media_type=JSON)

    return app


class Api:
    """The route handlers, and the steps of serving a run that other APIs' routes (Responses, Messages) share."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.settings = edge.settings
        self.metrics = edge.metrics

    # -- inference ----------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self.serve(request, "chat.completions", self._chat)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self.serve(request, "completions", self._completions)

    async def embeddings(self, request: Request) -> Response:
        """POST /v1/embeddings."""
        return await self.serve(request, "embeddings", self._embeddings)

    async def serve(
        self,
        request: Request,
        route: str,
        handle: Callable[[Request, Call, dict[str, Any]], Awaitable[Response]],
        *,
        errors: Callable[[ApiError, str], Response] = error_response,
        x_api_key: bool = False,
    ) -> Response:
        """One inference request: the edge's and the key's limits, the body read and parsed, then
        ``handle``; an :class:`ApiError` anywhere becomes ``errors(error, run_id)`` (OpenAI's shape
        unless told otherwise). ``x_api_key``: the key may come in an ``x-api-key`` header too."""
        call = Call(route, request.scope.get(ARRIVED) or time.perf_counter(), secrets.token_hex(12), None)
        edge = self.edge
        streaming = False
        try:
            if edge.in_flight >= self.settings.http.max_in_flight:
                self.metrics.refused.labels("in_flight").inc()
                message = f"this edge is serving {edge.in_flight} requests, its limit; retry shortly"
                raise ApiError(429, message, code="too_many_requests", retry_after=1.0)
            edge.in_flight += 1
            self.metrics.in_flight.inc()
            try:
                call.key = authenticate(self.edge.keys, request, x_api_key=x_api_key)
                await self.admit(call)  # before the body: one still arriving holds its key's slot too
                data = parse.parse_body(await self._body(request, call.route))
                response = await handle(request, call, data)
                streaming = isinstance(response, _EventStream)
            finally:
                if not streaming:  # a stream's own end releases these
                    self.finished(call)
        except ApiError as error:
            response = errors(error, call.run_id)
        if not streaming:
            self.metrics.requests.labels(route, call.model, str(response.status_code)).inc()
        response.headers["x-request-id"] = call.run_id
        return response

    def finished(self, call: Call) -> None:
        self.edge.in_flight -= 1
        self.metrics.in_flight.dec()
        if call.lease is not None:
            call.lease.release(call.tokens)
            call.lease = None
        if call.key is not None and self.edge.usage is not None:
            self.edge.usage.record(call.key.name, call.tokens)

    async def _chat(self, request: Request, call: Call, data: dict[str, Any]) -> Response:
        chat = parse.chat_request(data, call.run_id)
        run = self.prepared(call, chat.request)
        run.stream = chat.stream
        stream = await self.open(call, run)
        if chat.stream:
            return await self._chat_stream(request, call, stream, chat.include_usage)
        outcome = shape.Outcome()
        start, complete = await self.collect(request, call, stream, outcome)
        model = start.model or run.model
        body = shape.chat_body(call.run_id, int(time.time()), model, outcome, complete)
        return self.json(call, body, complete)

    async def _completions(self, request: Request, call: Call, data: dict[str, Any]) -> Response:
        completion = parse.completion_request(data, call.run_id)
        runs = [self.prepared(call, run) for run in completion.requests]
        if completion.stream:
            if len(runs) > 1:
                raise ApiError(400, "stream with more than one prompt is not supported", param="prompt")
            stream = await self.open(call, runs[0])
            return await self._completion_stream(request, call, stream, completion.include_usage)
        streams = await self._open_all(call, runs)
        outcomes = [shape.Outcome() for _ in runs]
        results = await asyncio.gather(
            *(self.collect(request, call, s, o) for s, o in zip(streams, outcomes, strict=True)),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                for stream in streams:
                    stream.cancel_nowait("another prompt of the request failed")
                raise result
        starts = [result[0] for result in results if not isinstance(result, BaseException)]
        completes = [result[1] for result in results if not isinstance(result, BaseException)]
        prompts = [run.prompt[0] for run in runs]
        texts = [
            (prompt if completion.echo else "") + "".join(o.text) for prompt, o in zip(prompts, outcomes, strict=True)
        ]
        body = shape.completion_body(call.run_id, int(time.time()), starts[0].model or runs[0].model, texts, completes)
        return self.json(call, body, completes[-1])

    async def _embeddings(self, request: Request, call: Call, data: dict[str, Any]) -> Response:
        embedding = parse.embedding_request(data, call.run_id)
        run = self.prepared(call, embedding.request)
        outcome = shape.Outcome()
        start, complete = await self.collect(request, call, await self.open(call, run), outcome)
        body = shape.embedding_body(
            start.model or run.model,
            outcome.embeddings,
            complete.usage,
            as_base64=embedding.base64,
            dimensions=embedding.dimensions,
        )
        return self.json(call, body, complete)

    # -- runs ---------------------------------------------------------------------------------

    async def admit(self, call: Call) -> None:
        """The key's limits taken for the request (429 over them); released when it ends."""
        if call.key is None:
            return
        limits = self.edge.limits
        try:
            call.lease = self.edge.limiter.acquire(call.key) if limits is None else await limits.acquire(call.key)
        except LimitExceeded as exc:
            self.metrics.refused.labels(exc.limit).inc()
            raise ApiError(429, exc.message, code="rate_limit_exceeded", retry_after=exc.retry_after) from None

    def prepared(self, call: Call, run: pb.RunRequest) -> pb.RunRequest:
        """The run with its caller (the key) and deadline."""
        key = call.key
        run.caller.id = caller_of(key)
        if key is not None:
            run.caller.api_key_id = key.key_id
        run.deadline.FromNanoseconds(time.time_ns() + int(self.settings.request_timeout * 1e9))
        run.metadata["request_id"] = call.run_id
        return run

    async def open(self, call: Call, run: pb.RunRequest) -> RunStream:
        """The run submitted (413 in the request's terms when it is more than a run carries)."""
        call.requested = run.model
        try:
            stream = await self.edge.upstream.open_run(run)
        except IopError as exc:
            if exc.reason == pb.ERROR_REASON_TOO_LARGE:  # open_run: more than one frame carries
                raise _too_large(run) from None
            raise from_iop(exc) from None
        except ConnectionClosed:
            message = f"the control-plane at {self.edge.upstream.address} is not reachable"
            raise ApiError(503, message, code="service_unavailable", retry_after=1.0) from None
        return stream

    async def _open_all(self, call: Call, runs: list[pb.RunRequest]) -> list[RunStream]:
        """Every run submitted, or none: those opened before one that fails are cancelled."""
        streams: list[RunStream] = []
        try:
            for run in runs:
                streams.append(await self.open(call, run))  # noqa: PERF401 - those opened before a failure are cancelled
        except BaseException:
            for stream in streams:
                stream.cancel_nowait("another prompt of the request could not start")
            raise
        return streams

    async def collect(
        self, request: Request, call: Call, stream: RunStream, outcome: shape.Outcome
    ) -> tuple[pb.RunStart, pb.RunComplete]:
        """A run's events gathered until it ends; the run is cancelled if the client goes away first."""
        async with self._departure(request, call, stream):
            start, end = await shape.gather(stream, outcome)
        if start.ByteSize():
            call.model = call.requested
        if end is None:
            raise ApiError(502, "the run ended without a result", code="backend_error")
        if end.HasField("error"):
            raise from_event(end)
        call.tokens += end.complete.usage.prompt_tokens + end.complete.usage.completion_tokens
        return start, end.complete

    async def _opening(self, request: Request, call: Call, stream: RunStream) -> tuple[list[pb.RunEvent], float | None]:
        """Events up to the first output (or the end): the HTTP status depends on them."""
        events: list[pb.RunEvent] = []
        started_at = None
        async with self._departure(request, call, stream):
            async for event in stream:
                events.append(event)
                kind = event.WhichOneof("event")
                if kind == "start":
                    started_at = time.perf_counter()
                    call.model = call.requested
                elif kind == "error":
                    raise from_event(event)
                if kind in ("delta", "complete"):
                    return events, started_at
        raise ApiError(502, "the run ended without a result", code="backend_error")

    @contextlib.asynccontextmanager
    async def _departure(self, request: Request, call: Call, stream: RunStream) -> AsyncIterator[None]:
        """While inside, a client that goes away cancels this task: the run is cancelled, 499.

        One watcher task per request rather than a race per event: a run's events are read at
        the cost of reading them.
        """
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            await _disconnected(request.receive)
            gone = True
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            yield
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
            stream.cancel_nowait("the client went away")
            self.metrics.cancelled.labels(call.route).inc()
            raise ApiError(499, "the client closed the request", code="cancelled") from None
        finally:
            watcher.cancel()

    async def _chat_stream(self, request: Request, call: Call, stream: RunStream, include_usage: bool) -> Response:
        def chunks(start: pb.RunStart) -> Chunks:
            model = start.model or call.model
            return shape.ChatStream(call.run_id, int(time.time()), model, include_usage=include_usage)

        return await self.stream(request, call, stream, chunks)

    async def _completion_stream(
        self, request: Request, call: Call, stream: RunStream, include_usage: bool
    ) -> Response:
        def chunks(start: pb.RunStart) -> Chunks:
            model = start.model or call.model
            return shape.CompletionStream(call.run_id, int(time.time()), model, include_usage=include_usage)

        return await self.stream(request, call, stream, chunks)

    async def stream(
        self, request: Request, call: Call, stream: RunStream, chunks: Callable[[pb.RunStart], Chunks]
    ) -> Response:
        """A streaming answer of ``stream``, once its first output (or its end) is known: a run refused
        before any output is the request's error status; after that, ``chunks`` (made from the run's
        start) shape every event, its errors included."""
        events, started_at = await self._opening(request, call, stream)
        start = next((event.start for event in events if event.HasField("start")), pb.RunStart())
        return _Streamed(self, call, stream, opening=events, started_at=started_at, chunks=chunks(start)).response()

    def json(self, call: Call, body: dict[str, Any], complete: pb.RunComplete) -> Response:
        return _Answer(shape.json_bytes(body), call.received, complete.timings.generation.ToNanoseconds() / 1e9)

    def _error(self, call: Call, error: ApiError) -> Response:
        return error_response(error, call.run_id)

    # -- checks -------------------------------------------------------------------------------

    def _authenticate(self, request: Request) -> ApiKey | None:
        return authenticate(self.edge.keys, request)

    async def _body(self, request: Request, route: str) -> bytes:
        http = self.settings.http
        try:
            return await read_body(request, http.max_body_bytes, http.body_timeout)
        except ApiError as error:
            if error.status == 499:
                self.metrics.cancelled.labels(route).inc()
            else:
                self.metrics.refused.labels("body_timeout" if error.status == 408 else "body_size").inc()
            raise

    # -- models, health, metrics --------------------------------------------------------------

    async def _models(self) -> dict[str, pb.ModelInfo]:
        try:
            return self.edge.upstream.models(await self.edge.upstream.capabilities())
        except IopError as exc:
            raise from_iop(exc) from None
        except (ConnectionClosed, TimeoutError):
            raise ApiError(
                503, "the control-plane did not answer", code="service_unavailable", retry_after=1.0
            ) from None

    def _model_object(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.edge.started, "owned_by": "iop"}

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the models available across the platform's ready nodes."""
        try:
            self._authenticate(request)
            models = await self._models()
        except ApiError as error:
            return self._error(Call("models", time.perf_counter(), "", None), error)
        body = {"object": "list", "data": [self._model_object(name) for name in sorted(models)]}
        return Response(shape.json_bytes(body), media_type=JSON)

    async def model(self, request: Request, model_id: str) -> Response:
        """GET /v1/models/{id}."""
        try:
            self._authenticate(request)
            models = await self._models()
            if model_id not in models:
                message = f"The model '{model_id}' does not exist or you do not have access to it."
                raise ApiError(404, message, param="model", code="model_not_found")
        except ApiError as error:
            return self._error(Call("model", time.perf_counter(), "", None), error)
        return Response(shape.json_bytes(self._model_object(model_id)), media_type=JSON)

    async def health(self) -> Response:
        """GET /health: the process serves HTTP."""
        return Response(b'{"status":"ok"}', media_type=JSON)

    async def ready(self) -> Response:
        """GET /ready: the control-plane is reachable and serves at least one model; the body also
        counts the connections up to the worker (files and batches need one; null: none configured)."""
        upstream = self.edge.upstream
        reason = ""
        models: dict[str, pb.ModelInfo] = {}
        if not upstream.connected:
            reason = f"no connection to the control-plane at {upstream.address}"
        else:
            try:
                models = upstream.models(await upstream.capabilities())
            except (IopError, ConnectionClosed, TimeoutError) as exc:
                reason = f"the control-plane did not answer: {exc}"
            if not reason and not models:
                reason = "no model is served: no node is ready"
        body = {"status": "not ready" if reason else "ready", "reason": reason or None, "models": len(models)}
        body["control_plane_connections"] = upstream.connected
        worker = self.edge.worker
        body["worker_connections"] = worker.connected if worker is not None and worker.address else None
        return Response(shape.json_bytes(body), status_code=503 if reason else 200, media_type=JSON)

    async def prometheus(self) -> Response:
        """GET /metrics: Prometheus exposition of the edge (and its wire connections)."""
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class _Answer(Response):
    """A whole answer whose x-iop-overhead-ms is measured as its head leaves: the rendering of the
    answer and the way out through the framework count as IOP's time too."""

    def __init__(self, body: bytes, received: float, backend: float) -> None:
        super().__init__(body, media_type=JSON)
        self.received, self.backend = received, backend
        """When the request's first byte was read; the backend's own time (seconds)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        overhead = (time.perf_counter() - self.received - self.backend) * 1000
        self.raw_headers.append((b"x-iop-overhead-ms", b"%.3f" % max(overhead, 0.0)))
        await super().__call__(scope, receive, send)


class Chunks(Protocol):
    """How one API shapes a run's events as SSE bytes (chat completions, Responses, Messages)."""

    def first(self) -> bytes:
        """What goes before the first delta (may be empty)."""
        ...

    def delta(self, delta: pb.RunDelta) -> bytes:
        """One delta's events."""
        ...

    def last(self, complete: pb.RunComplete) -> bytes:
        """The events that end a run that completed."""
        ...

    def error(self, error: ApiError) -> bytes:
        """The events that end a run that failed after the stream started."""
        ...

    def cancelled(self) -> None:
        """The client left mid-stream (the run is being cancelled): keep what must outlive the stream
        (Responses stores its answer), or nothing."""
        ...


class _Streamed:
    """One streaming answer: the events already read, then the rest of the run, as SSE chunks."""

    def __init__(
        self,
        api: Api,
        call: Call,
        stream: RunStream,
        *,
        opening: list[pb.RunEvent],
        started_at: float | None,
        chunks: Chunks,
    ) -> None:
        self.api, self.call, self.stream, self.opening, self.chunks = api, call, stream, opening, chunks
        self.overhead = ((started_at or time.perf_counter()) - call.received) * 1000
        self.started = False
        self.status = "200"
        self.previous: float | None = None
        """When the last token left (inter-token latency)."""

    def response(self) -> _EventStream:
        headers = {"x-iop-overhead-ms": f"{self.overhead:.3f}", "cache-control": "no-cache"}
        return _EventStream(self.body(), headers, self.abandon)

    def abandon(self) -> None:
        """The client left before the body started: end the run and the request here."""
        if not self.started:
            self._cancelled()
            self._ended()

    async def body(self) -> AsyncIterator[bytes]:
        self.started = True
        self.api.metrics.streams.inc()
        try:
            async for chunk in self._chunks():
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            self._cancelled()
            raise
        finally:
            self.api.metrics.streams.dec()
            self._ended()

    async def _chunks(self) -> AsyncIterator[bytes]:
        """SSE bytes of the run's events; events that arrived together leave in one write."""
        stream = self.stream
        pending = list(self.opening)
        out = [self.chunks.first()]
        while True:
            try:
                event = pending.pop(0) if pending else stream.next_nowait()
                if event is None:
                    event = await anext(stream)
            except StopAsyncIteration:
                yield b"".join(out) + self.chunks.error(ApiError(502, "the run ended without a result"))
                return
            if self._chunk(event, out):
                yield b"".join(out)
                return
            if not pending and not stream.buffered:
                yield b"".join(out)
                out.clear()

    def _chunk(self, event: pb.RunEvent, out: list[bytes]) -> bool:
        """Add ``event``'s SSE bytes to ``out``; True when it ended the stream."""
        call, chunks, metrics = self.call, self.chunks, self.api.metrics
        kind = event.WhichOneof("event")
        if kind == "delta":
            now = time.perf_counter()
            if self.previous is None:
                metrics.ttft.labels(call.model).observe(now - call.received)
            else:
                metrics.inter_token.labels(call.model).observe(now - self.previous)
            self.previous = now
            out.append(chunks.delta(event.delta))
        elif kind == "complete":
            usage = event.complete.usage
            call.tokens += usage.prompt_tokens + usage.completion_tokens
            out.append(chunks.last(event.complete))
            return True
        elif kind == "error":
            error = from_event(event)
            self.status = str(error.status)
            out.append(chunks.error(error))
            return True
        return False

    def _cancelled(self) -> None:
        self.status = "499"
        self.stream.cancel_nowait("the client went away")
        self.api.metrics.cancelled.labels(self.call.route).inc()
        self.chunks.cancelled()

    def _ended(self) -> None:
        self.api.metrics.requests.labels(self.call.route, self.call.model, self.status).inc()
        self.api.finished(self.call)


class _EventStream(Response):
    """A text/event-stream response that stops its body (cancelling the run) when the client goes away.

    Starlette's StreamingResponse notices a disconnect only when its next write fails (ASGI 2.4);
    a stream waiting for a slow token would hold its run for as long. Here a second task waits
    for ``http.disconnect`` and cancels the body at once.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str], abandon: Callable[[], None]) -> None:
        self.body_iterator = body
        self.abandon = abandon
        """Called once the response is over, in case the body never started."""
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self._send(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not sending.done():
                sending.cancel()
            gone.cancel()
            await asyncio.gather(sending, gone, return_exceptions=True)
            self.abandon()

    async def _send(self, send: Send) -> None:
        async with contextlib.aclosing(self.body_iterator) as chunks:  # type: ignore[type-var]
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client went away mid-write
                return


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone away (the request body was read before)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _too_large(run: pb.RunRequest) -> ApiError:
    """413 for a request the platform cannot carry, in the request's terms (not the wire's frames)."""
    message = (
        f"the request is too large: {run.ByteSize()} bytes once encoded, over the {DEFAULT_MAX_FRAME_SIZE} "
        "bytes one request may carry to a model; send a shorter request"
    )
    return ApiError(413, message, code="request_too_large")
