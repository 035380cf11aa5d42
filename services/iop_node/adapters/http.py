"""What the HTTP adapters (vllm, ollama) share: one pooled client per backend, timeouts,
health, and the one place where backend failures become IOP errors.

    connection refused, reset, closed mid-stream  -> UNAVAILABLE (retryable; backend marked down)
    no first byte / no data for the idle timeout  -> UNAVAILABLE (retryable)
    HTTP 404                                      -> MODEL_NOT_FOUND
    HTTP 400, 422                                 -> INVALID_ARGUMENT
    HTTP 429                                      -> RESOURCE_EXHAUSTED (retryable)
    HTTP 5xx and anything else                    -> BACKEND_ERROR
    a line that is not JSON, a stream with no end -> BACKEND_PROTOCOL_ERROR

A backend marked down reports its models unavailable until a health probe sees it answer again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import aiohttp
import structlog
from pydantic import BaseModel, ConfigDict, Field

from iop_wire.errors import ErrorCode, IopError

__all__ = ["Backend", "Backends", "HttpOptions", "Timeouts", "protocol_error"]

_log = structlog.get_logger("iop.node.http")
_STATUS_CODES = {
    404: ErrorCode.MODEL_NOT_FOUND,
    400: ErrorCode.INVALID_ARGUMENT,
    422: ErrorCode.INVALID_ARGUMENT,
    429: ErrorCode.RESOURCE_EXHAUSTED,
}
_MESSAGE_LIMIT = 500
_TAIL_WAIT = 0.2  # seconds to wait for a response's end after its final marker


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


class HttpOptions(BaseModel):
    """Options every HTTP-backed route has."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    base_url: str = Field(pattern=r"^https?://")
    """The backend's address, e.g. http://10.0.0.5:8000; routes with the same one share a client."""
    target: str = ""
    """The backend's model name: set by the node from the route's ``target`` (or ``model``)."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer``; never logged."""
    timeouts: Timeouts = Timeouts()
    """Connect, first byte, idle and total timeouts."""
    health_interval: float = Field(2.0, gt=0)
    """Seconds between health probes while the backend is down."""
    max_connections: int = Field(256, ge=1)
    """Connections kept to the backend at most (kept alive between runs)."""


class _IdleTimer:
    """Cancels the current task once ``seconds`` pass with no ``touch()``.

    One timer that re-arms itself when it finds recent data: touching costs a clock read per
    chunk, where rescheduling a timeout per chunk cost ~5 us of the relay's 30 us per token.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._last = self._loop.time()
        self._fired = False
        self._handle = self._loop.call_at(self._last + seconds, self._check)

    def touch(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        if self._loop.time() - self._last >= self.seconds and self._task is not None:
            self._fired = True
            self._task.cancel()
        else:
            self._handle = self._loop.call_at(self._last + self.seconds, self._check)

    def fired(self) -> bool:
        """True if the timer cancelled the task (and takes that cancellation back)."""
        if self._fired and self._task is not None:
            self._task.uncancel()
        return self._fired

    def stop(self) -> None:
        self._handle.cancel()


def protocol_error(message: str) -> IopError:
    """The backend's response could not be understood."""
    return IopError(ErrorCode.BACKEND_PROTOCOL_ERROR, message[:_MESSAGE_LIMIT])


class Backend:
    """One backend server: a keep-alive connection pool, its health, and error translation."""

    def __init__(self, options: HttpOptions, *, health_path: str, name: str) -> None:
        self.options = options
        self.name = name
        self.available = True
        self._base = options.base_url.rstrip("/")
        self._health_path = health_path
        self._session: aiohttp.ClientSession | None = None
        self._probe: asyncio.Task[None] | None = None
        self._headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeouts = self.options.timeouts
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.options.max_connections, keepalive_timeout=30),
                # no sock_read: it would also cut the wait for headers short (first_byte covers
                # that); the idle timeout is applied between chunks in _lines
                timeout=aiohttp.ClientTimeout(total=timeouts.total, sock_connect=timeouts.connect),
                headers=self._headers,
            )
        return self._session

    async def get_json(self, path: str) -> Any:
        """GET ``path`` and return its JSON body."""
        async with self._request("GET", path, None) as response:
            return await self._json(response)

    async def post_json(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to ``path`` and return the JSON answer."""
        async with self._request("POST", path, body) as response:
            return await self._json(response)

    async def post_lines(self, path: str, body: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        """POST ``body`` and yield the response's non-empty lines as they arrive.

        Leaving the iteration early (a cancel) closes the connection, so the backend sees it.
        """
        async with self._request("POST", path, body) as response:
            finished = False
            try:
                async for line in self._lines(response):
                    yield line
                finished = True
            except GeneratorExit:
                # The caller stopped at the stream's final marker: let the body end (it is a
                # few bytes away) so the connection can go back to the pool.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(_TAIL_WAIT):
                        await response.content.read()
                    finished = response.content.at_eof()
                raise
            finally:
                if not finished:
                    response.close()  # abort: never return a half-read connection to the pool

    @contextlib.asynccontextmanager
    async def _request(
        self, method: str, path: str, body: dict[str, Any] | None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        try:
            async with asyncio.timeout(self.options.timeouts.first_byte):
                response = await self._client().request(method, self._base + path, json=body)
        except (aiohttp.ClientConnectionError, OSError) as exc:  # before TimeoutError: a connect timeout is both
            raise self._unreachable(exc) from None
        except TimeoutError:
            raise self._unavailable(f"no response within {self.options.timeouts.first_byte:g} s") from None
        except aiohttp.ClientResponseError as exc:
            raise protocol_error(f"{self.name}: unreadable HTTP response: {exc.message}") from None
        try:
            if response.status >= 300:
                raise await self._status_error(response)
            yield response
        finally:
            response.release()

    async def _lines(self, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        idle = _IdleTimer(self.options.timeouts.idle)
        try:
            async for raw in response.content:
                idle.touch()
                line = raw.strip()
                if line:
                    yield line
        except asyncio.CancelledError:
            if idle.fired():
                raise self._unavailable(f"stalled, no data for {idle.seconds:g} s") from None
            raise
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError) as exc:
            raise self._lost(exc) from None
        except aiohttp.ClientResponseError as exc:
            raise protocol_error(f"{self.name}: unreadable HTTP response: {exc.message}") from None
        finally:
            idle.stop()

    async def _json(self, response: aiohttp.ClientResponse) -> Any:
        try:
            async with asyncio.timeout(self.options.timeouts.idle):
                return json.loads(await response.read())
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise self._lost(exc) from None
        except TimeoutError:
            raise self._unavailable(f"stalled, no data for {self.options.timeouts.idle:g} s") from None
        except ValueError as exc:
            raise protocol_error(f"{self.name}: response is not JSON: {exc}") from None

    def _unavailable(self, message: str) -> IopError:
        return IopError(ErrorCode.UNAVAILABLE, f"{self.name}: {message}")

    def _unreachable(self, exc: BaseException) -> IopError:
        self.mark_down(str(exc) or type(exc).__name__)
        return self._unavailable(f"cannot reach {self._base}: {exc or type(exc).__name__}")

    def _lost(self, exc: BaseException) -> IopError:
        self.mark_down(str(exc) or type(exc).__name__)
        return self._unavailable(f"connection lost mid-response: {exc or type(exc).__name__}")

    async def _status_error(self, response: aiohttp.ClientResponse) -> IopError:
        text = (await response.text(errors="replace"))[:_MESSAGE_LIMIT]
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            document = json.loads(text)
            error = document.get("error", document)
            text = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        code = _STATUS_CODES.get(response.status, ErrorCode.BACKEND_ERROR)
        return IopError(code, f"{self.name} answered HTTP {response.status}: {text}")

    def mark_down(self, reason: str) -> None:
        """Report the backend's models unavailable until a health probe succeeds."""
        if self.available:
            _log.warning("backend down", backend=self.name, url=self._base, reason=reason)
        self.available = False
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        while not self.available:
            await asyncio.sleep(self.options.health_interval)
            try:
                async with asyncio.timeout(self.options.timeouts.connect + 1):
                    response = await self._client().get(self._base + self._health_path)
                    response.release()
                    self.available = response.status < 500
            except (aiohttp.ClientError, OSError, TimeoutError):
                continue
        _log.info("backend up", backend=self.name, url=self._base)

    async def aclose(self) -> None:
        """Stop probing and close the connection pool."""
        if self._probe is not None:
            self._probe.cancel()
        if self._session is not None:
            await self._session.close()


class Backends:
    """The backends of one adapter: one ``Backend`` per base URL, looked up by route model."""

    def __init__(self, models: Mapping[str, HttpOptions], *, health_path: str, kind: str) -> None:
        self.options = dict(models)
        self.by_url: dict[str, Backend] = {}
        for options in self.options.values():
            if options.base_url not in self.by_url:
                self.by_url[options.base_url] = Backend(
                    options, health_path=health_path, name=f"{kind} {options.base_url}"
                )

    def __getitem__(self, model: str) -> Backend:
        return self.by_url[self.options[model].base_url]

    def available(self, model: str) -> bool:
        """Whether ``model``'s backend is up, as last seen."""
        return self[model].available

    async def aclose(self) -> None:
        """Close every backend's connection pool."""
        for backend in self.by_url.values():
            await backend.aclose()
