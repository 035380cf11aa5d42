"""What the HTTP adapters (vllm, ollama) share: options, a route's way to its backend, the
backend's health and model list, and the one place where failures become IOP errors.

    client error (httperrors)            IOP error                 the backend
    ConnectError, ConnectTimeout         UNAVAILABLE (retryable)   marked down
    ConnectionLost                       UNAVAILABLE (retryable)   marked down
    ServerDisconnected                   UNAVAILABLE (retryable)   up (a reused connection's close race)
    ReadTimeout, PoolTimeout             UNAVAILABLE (retryable)   up (slow or busy is not down)
    ClientClosed                         UNAVAILABLE (retryable)   up
    ProtocolError                        BACKEND_PROTOCOL_ERROR    up
    HTTP 404 / 400, 422 / 429            MODEL_NOT_FOUND / INVALID_ARGUMENT / RESOURCE_EXHAUSTED (retryable)
    HTTP 5xx and any other status        BACKEND_ERROR
    not JSON, another shape, no end      BACKEND_PROTOCOL_ERROR (shapes.py)

A backend marked down reports its models unavailable until a health probe reads a well-formed
model list from it again. The model list is fetched only while none of this node's runs are in
flight to that backend: llama-cpp-python ends a running stream when another request arrives,
or serves the new one after it; either way a run must not pay for a look at the list.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, FilePath, field_validator

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters import httperrors as errors
from iop_node.adapters.http11 import DEFAULT_MAX_LINE, header_lines
from iop_node.adapters.httpclient import HttpClient, Response
from iop_node.adapters.shapes import capped, protocol_error
from iop_node.domain import ExecutionSpec, RunKind
from iop_wire.errors import IopError

__all__ = [
    "KINDS",
    "Backend",
    "BackendTime",
    "Backends",
    "Endpoint",
    "HttpOptions",
    "HttpStatusError",
    "Timeouts",
    "check_kind",
]

_log = structlog.get_logger("iop.node.http")
_STATUS_CODES = {
    404: pb.ERROR_CODE_MODEL_NOT_FOUND,
    400: pb.ERROR_CODE_INVALID_ARGUMENT,
    422: pb.ERROR_CODE_INVALID_ARGUMENT,
    429: pb.ERROR_CODE_RESOURCE_EXHAUSTED,
}
# client error class -> (IOP code, marks the backend down, words before the client's message)
_CLIENT_ERRORS: dict[type[errors.HttpError], tuple[pb.ErrorCode.ValueType, bool, str]] = {
    errors.HttpError: (pb.ERROR_CODE_UNAVAILABLE, False, ""),
    errors.ConnectError: (pb.ERROR_CODE_UNAVAILABLE, True, "cannot reach {url}: "),
    errors.ConnectTimeout: (pb.ERROR_CODE_UNAVAILABLE, True, "cannot reach {url}: "),
    errors.ConnectionLost: (pb.ERROR_CODE_UNAVAILABLE, True, "connection lost: "),
    errors.ServerDisconnected: (pb.ERROR_CODE_UNAVAILABLE, False, ""),
    errors.ProtocolError: (pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR, False, "unreadable HTTP response: "),
}
KINDS: dict[str, RunKind] = {
    "chat": pb.RUN_KIND_CHAT,
    "completion": pb.RUN_KIND_COMPLETION,
    "embedding": pb.RUN_KIND_EMBEDDING,
}
_KIND_NAMES = {kind: name for name, kind in KINDS.items()}
_TAIL_WAIT = 0.2  # seconds to wait for a response's end after its final marker
_MAX_BODY = 256 * 1024 * 1024  # bytes of a JSON answer (embeddings of many inputs are large)
_MAX_ERROR_BODY = 64 * 1024  # bytes of an error answer read for its message


class Timeouts(BaseModel):
    """Seconds allowed for each phase of a backend request."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    connect: float = Field(5.0, gt=0)
    """To open the TCP connection."""
    first_byte: float = Field(120.0, gt=0)
    """From sending the request to the response's first byte (covers the backend's queue and prefill)."""
    idle: float = Field(60.0, gt=0)
    """Between two chunks of a streamed response."""
    total: float = Field(1800.0, gt=0)
    """For the whole request."""
    pool: float = Field(30.0, gt=0)
    """Waiting for a free connection when all ``max_connections`` are busy."""


class HttpOptions(BaseModel):
    """Options every HTTP-backed route has."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    base_url: str = Field(pattern=r"^https?://")
    """The backend's address, e.g. http://10.0.0.5:8000 (a trailing /v1 is accepted and dropped);
    routes with the same one share its health and model list, and a connection pool per ``ca``."""
    target: str = ""
    """The backend's model name: set by the node from the route's ``target`` (or ``model``)."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer``, this route's own; never logged."""
    ca: FilePath | None = None
    """A CA bundle (PEM) to verify an https backend's certificate with, instead of the system's."""
    timeouts: Timeouts = Timeouts()
    """Connect, first byte, idle, total and pool timeouts, this route's own."""
    health_interval: float = Field(2.0, gt=0)
    """Seconds between health probes while the backend is down."""
    max_connections: int = Field(256, ge=1)
    """Connections kept to the backend at most (routes sharing a pool: the largest of theirs)."""
    max_line_bytes: int = Field(DEFAULT_MAX_LINE, ge=1024)
    """Longest streamed line (one SSE event or NDJSON object) read from the backend."""
    models_refresh: float = Field(60.0, gt=0)
    """Seconds between looks at the backend's model list (only while none of its runs are in flight)."""
    kinds: tuple[Literal["chat", "completion", "embedding"], ...] = Field(
        ("chat", "completion", "embedding"), min_length=1
    )
    """The run kinds this route serves and advertises (an embedding-less server: [chat, completion])."""

    @field_validator("base_url")
    @classmethod
    def _normalise_url(cls, url: str) -> str:
        url = url.rstrip("/")
        return url.removesuffix("/v1").rstrip("/")

    @field_validator("api_key")
    @classmethod
    def _sendable_key(cls, key: str | None) -> str | None:
        if key is not None:
            try:
                header_lines({"Authorization": f"Bearer {key}"})
            except ValueError:
                raise ValueError(
                    "has a character an HTTP header cannot carry (CR, LF, another control character,"
                    " or one outside latin-1)"
                ) from None
        return key


class HttpStatusError(IopError):
    """The backend answered a request with an error status."""

    def __init__(self, code: pb.ErrorCode.ValueType, message: str, *, status: int) -> None:
        super().__init__(code, message)
        self.status = status


def check_kind(spec: ExecutionSpec, options: HttpOptions) -> None:
    """INVALID_ARGUMENT for a run of a kind the route does not declare (``options.kinds``)."""
    kind = _KIND_NAMES.get(spec.kind, "unknown")
    if kind not in options.kinds:
        raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, f"this model serves {', '.join(options.kinds)} runs, not {kind}")


class Backend:
    """One backend server (a base URL): its health, its model list, this node's runs in flight to it."""

    def __init__(
        self,
        url: str,
        *,
        name: str,
        list_path: str,
        list_models: Callable[[Any], set[str]],
        health_interval: float,
        models_refresh: float,
    ) -> None:
        self.url = url
        self.name = name
        self.available = True
        self.in_flight = 0
        """Run requests of this node under way to the server."""
        self.models: set[str] | None = None
        """The model list as last read; None before the first read."""
        self.lister: Endpoint | None = None
        """The endpoint (a route's credentials and pool) the list and health probes go through."""
        self._list_path = list_path
        self._list_models = list_models
        self._health_interval = health_interval
        self._models_refresh = models_refresh
        self._listed_at = -1e9
        self._listing = False
        self._closed = False
        self._probe: asyncio.Task[None] | None = None

    def error(self, exc: errors.HttpError) -> IopError:
        """The IOP error for a client error, marking the backend down where the table says so."""
        code, down, words = next(_CLIENT_ERRORS[kind] for kind in type(exc).__mro__ if kind in _CLIENT_ERRORS)
        reason = str(exc) or type(exc).__name__
        if down:
            self.mark_down(reason)
        return IopError(code, f"{self.name}: {words.format(url=self.url)}{reason}")

    def stale(self) -> None:
        """Read the model list again at the next chance (after a failed run)."""
        self._listed_at = -1e9

    async def served(self) -> set[str] | None:
        """The served model names: read again when due and idle, else as last read (None: unknown)."""
        due = time.monotonic() - self._listed_at > self._models_refresh
        if due and not self.in_flight and not self._listing and not self._closed:
            with contextlib.suppress(IopError, errors.NotSent):
                await self._read_list()
        return self.models

    async def _read_list(self) -> None:
        """GET the model list, unless a run starts first; a list that cannot be read marks the backend down."""
        assert self.lister is not None
        self._listing = True
        try:
            document = await self.lister.get_json(self._list_path, only_if=lambda: not self.in_flight)
            self.models = self._list_models(document)
        except IopError as exc:
            self.mark_down(exc.message)
            raise
        finally:
            self._listing = False
        self._listed_at = time.monotonic()
        if not self.available:
            _log.info("backend up", backend=self.name, url=self.url)
        self.available = True

    def mark_down(self, reason: str) -> None:
        """Report the backend's models unavailable until a health probe reads its model list."""
        if self._closed:
            return  # shutting down: nothing to probe for
        if self.available:
            _log.warning("backend down", backend=self.name, url=self.url, reason=capped(reason))
        self.available = False
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        while not self.available:
            await asyncio.sleep(self._health_interval)
            if self.in_flight:
                continue  # runs are going: a probe could interrupt them
            with contextlib.suppress(IopError, errors.NotSent):
                await self._read_list()

    async def aclose(self) -> None:
        """Stop probing."""
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()


@dataclass(slots=True)
class BackendTime:
    """A backend's own time for one request, as the node's HTTP client sees it: from the request
    written to the response's last byte read. The edge subtracts it from a request's time to tell
    IOP's overhead (x-iop-overhead-ms), so the node's own work on the stream is not hidden in it."""

    seconds: float | None = None
    """None: the response did not end (or was not read to its end)."""

    def timings(self) -> pb.Timings | None:
        """Timings with ``generation`` the backend's time; None when unknown (the node measures it then)."""
        if self.seconds is None:
            return None
        timings = pb.Timings()
        timings.generation.FromNanoseconds(int(self.seconds * 1e9))
        return timings


class Endpoint:
    """A route's way to its backend: a pool for its TLS settings, its own key, timeouts and line cap."""

    def __init__(self, backend: Backend, client: HttpClient, options: HttpOptions) -> None:
        self.backend = backend
        self.client = client
        self.timeouts = options.timeouts
        self.max_line = options.max_line_bytes
        self._auth = header_lines({"Authorization": f"Bearer {options.api_key}"}) if options.api_key else b""

    async def get_json(self, path: str, *, only_if: Callable[[], bool] | None = None) -> Any:
        """GET ``path`` and return its JSON body; with ``only_if`` (a model list, a probe) NotSent when
        it says no, and the connect timeout for the head."""
        async with await self._open("GET", path, None, only_if=only_if) as response:
            return await self._json(response)

    async def post_json(self, path: str, body: dict[str, Any], *, timing: BackendTime | None = None) -> Any:
        """POST ``body`` to ``path`` and return the JSON answer (the backend's time in ``timing``)."""
        self.backend.in_flight += 1
        try:
            async with await self._open("POST", path, body) as response:
                document = await self._json(response)
                if timing is not None:
                    timing.seconds = response.server_seconds
                return document
        finally:
            self.backend.in_flight -= 1

    async def post_lines(
        self, path: str, body: dict[str, Any], *, last: Callable[[bytes], bool], timing: BackendTime | None = None
    ) -> AsyncGenerator[bytes, None]:
        """POST ``body`` and yield the response's non-empty lines as they arrive.

        ``last`` recognizes the stream's final line ([DONE], a done object): before that line is
        yielded, the few bytes left of the body are read, so that the connection can go back to
        the pool when the caller stops there. Leaving the iteration anywhere else (a cancel, an
        error) closes the connection at once, so the backend sees it. The backend's time is in
        ``timing`` by the time the final line is yielded.
        """
        backend = self.backend
        backend.in_flight += 1
        try:
            async with await self._open("POST", path, body) as response:
                lines = response.lines(self.max_line)
                try:
                    while True:
                        try:
                            line = await anext(lines)
                        except StopAsyncIteration:
                            return
                        except errors.HttpError as exc:
                            raise backend.error(exc) from None
                        if last(line):
                            await _read_to_end(response)
                            if timing is not None:
                                timing.seconds = response.server_seconds
                        yield line
                finally:
                    await lines.aclose()
        finally:
            backend.in_flight -= 1

    async def _open(
        self, method: str, path: str, body: dict[str, Any] | None, *, only_if: Callable[[], bool] | None = None
    ) -> Response:
        """Send the request; the response once its head is in and its status is a success."""
        timeouts = self.timeouts
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        since = asyncio.get_running_loop().time()
        head_timeout = timeouts.connect if only_if is not None else min(timeouts.first_byte, timeouts.total)
        try:
            response = await self.client.request(
                method,
                path,
                data,
                connect_timeout=timeouts.connect,
                head_timeout=head_timeout,
                pool_timeout=timeouts.pool,
                head=self._auth,
                only_if=only_if,
            )
        except errors.NotSent:
            raise  # not a failure: the caller changed its mind
        except errors.HttpError as exc:
            raise self.backend.error(exc) from None
        response.set_timeouts(timeouts.idle, timeouts.total, since=since)
        if response.status >= 300:
            async with response:
                raise await self._status_error(response)
        return response

    async def _json(self, response: Response) -> Any:
        try:
            data = await response.read(_MAX_BODY)
        except errors.HttpError as exc:
            raise self.backend.error(exc) from None
        try:
            return json.loads(data)
        except ValueError as exc:
            raise protocol_error(f"{self.backend.name}: response is not JSON: {exc}") from None

    async def _status_error(self, response: Response) -> HttpStatusError:
        try:
            raw = await response.read(_MAX_ERROR_BODY)
        except errors.HttpError:
            raw = b""
        text = raw.decode(errors="replace")
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            document = json.loads(text)
            error = document.get("error", document)
            text = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        code = _STATUS_CODES.get(response.status, pb.ERROR_CODE_BACKEND_ERROR)
        message = capped(f"{self.backend.name} answered HTTP {response.status}: {text}")
        return HttpStatusError(code, message, status=response.status)

    def failed(self, run_id: str, error: IopError) -> None:
        """Log a run's backend failure (one line) and look at the model list again when idle."""
        self.backend.stale()
        _log.warning(
            "backend request failed",
            run_id=run_id,
            backend=self.backend.name,
            status=getattr(error, "status", None),
            code=error.name,
            error=error.message,
        )


async def _read_to_end(response: Response) -> None:
    """Read what is left of a body that should be about to end; leave it unfinished if it is not."""
    with contextlib.suppress(errors.HttpError, TimeoutError):
        async with asyncio.timeout(_TAIL_WAIT):
            async for _ in response.iter_bytes():
                pass


class Backends:
    """An adapter's backends: one ``Backend`` per base URL, one pool per (base URL, CA), one
    ``Endpoint`` per route model."""

    def __init__(
        self, models: Mapping[str, HttpOptions], *, kind: str, list_path: str, list_models: Callable[[Any], set[str]]
    ) -> None:
        self.options = dict(models)
        self.by_url: dict[str, Backend] = {}
        self._clients: dict[tuple[str, str | None], HttpClient] = {}
        self._endpoints: dict[str, Endpoint] = {}
        for model, options in self.options.items():
            backend = self.by_url.get(options.base_url)
            if backend is None:
                backend = self.by_url[options.base_url] = Backend(
                    options.base_url,
                    name=f"{kind} {options.base_url}",
                    list_path=list_path,
                    list_models=list_models,
                    health_interval=options.health_interval,
                    models_refresh=min(
                        o.models_refresh for o in self.options.values() if o.base_url == options.base_url
                    ),
                )
            endpoint = self._endpoints[model] = Endpoint(backend, self._client(options), options)
            backend.lister = backend.lister or endpoint

    def _client(self, options: HttpOptions) -> HttpClient:
        key = (options.base_url, str(options.ca) if options.ca else None)
        client = self._clients.get(key)
        if client is None:
            sharing = [o.max_connections for o in self.options.values() if (o.base_url, o.ca) == (key[0], options.ca)]
            tls = ssl.create_default_context(cafile=options.ca) if options.base_url.startswith("https:") else None
            client = self._clients[key] = HttpClient(options.base_url, max_connections=max(sharing), tls=tls)
        return client

    def __getitem__(self, model: str) -> Endpoint:
        return self._endpoints[model]

    def available(self, model: str) -> bool:
        """Whether ``model``'s backend is up, as last seen."""
        return self._endpoints[model].backend.available

    async def aclose(self) -> None:
        """Stop every backend's probe and close every connection pool."""
        for backend in self.by_url.values():
            await backend.aclose()
        for client in self._clients.values():
            await client.aclose()
