"""What the HTTP adapters (vllm, ollama) share: one pooled client per backend, timeouts,
health, and the one place where backend failures become IOP errors.

    connection refused, reset, closed mid-stream   -> UNAVAILABLE (retryable; backend marked down)
    first-byte, idle or total timeout              -> UNAVAILABLE (retryable; a slow backend is up)
    HTTP 404                                       -> MODEL_NOT_FOUND
    HTTP 400, 422                                  -> INVALID_ARGUMENT
    HTTP 429                                       -> RESOURCE_EXHAUSTED (retryable)
    HTTP 5xx and anything else                     -> BACKEND_ERROR
    not JSON, not HTTP, a stream with no end       -> BACKEND_PROTOCOL_ERROR

A backend marked down reports its models unavailable until a health probe sees it answer again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import structlog
from pydantic import BaseModel, ConfigDict, Field, FilePath

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters.httpclient import BadResponse, ConnectionLost, HttpClient, ReadTimeout, Response
from iop_wire.errors import IopError

__all__ = ["Backend", "Backends", "HttpOptions", "Timeouts", "json_text", "protocol_error"]

_log = structlog.get_logger("iop.node.http")
_STATUS_CODES = {
    404: pb.ERROR_CODE_MODEL_NOT_FOUND,
    400: pb.ERROR_CODE_INVALID_ARGUMENT,
    422: pb.ERROR_CODE_INVALID_ARGUMENT,
    429: pb.ERROR_CODE_RESOURCE_EXHAUSTED,
}
_MESSAGE_LIMIT = 500
_TAIL_WAIT = 0.2  # seconds to wait for a response's end after its final marker
_MAX_BODY = 256 * 1024 * 1024  # bytes of a JSON answer (embeddings of many inputs are large)
_MAX_ERROR_BODY = 1024 * 1024  # bytes of an error answer read for its message


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
    """The backend's address, e.g. http://10.0.0.5:8000; routes with the same one share a client,
    set up from the first such route's connection options."""
    target: str = ""
    """The backend's model name: set by the node from the route's ``target`` (or ``model``)."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer``; never logged."""
    ca: FilePath | None = None
    """A CA bundle (PEM) to verify an https backend's certificate with, instead of the system's."""
    timeouts: Timeouts = Timeouts()
    """Connect, first byte, idle and total timeouts."""
    health_interval: float = Field(2.0, gt=0)
    """Seconds between health probes while the backend is down."""
    max_connections: int = Field(256, ge=1)
    """Connections kept to the backend at most (kept alive between runs)."""


async def _read_to_end(response: Response) -> None:
    """Read what is left of a body that should be about to end; leave it unfinished if it is not."""
    with contextlib.suppress(OSError, ReadTimeout, BadResponse, TimeoutError):
        async with asyncio.timeout(_TAIL_WAIT):
            async for _ in response.iter_bytes():
                pass


def json_text(value: Any) -> str:
    """Text from a backend's JSON: a string, "" for null; TypeError for anything else."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"content is a {type(value).__name__}, not a string")
    return value


def protocol_error(message: str) -> IopError:
    """The backend's response could not be understood."""
    return IopError(pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR, message[:_MESSAGE_LIMIT])


class Backend:
    """One backend server: a keep-alive connection pool, its health, and error translation."""

    def __init__(self, options: HttpOptions, *, health_path: str, name: str) -> None:
        self.options = options
        self.name = name
        self.available = True
        self._base = options.base_url.rstrip("/")
        self._health_path = health_path
        self._probe: asyncio.Task[None] | None = None
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        tls = ssl.create_default_context(cafile=options.ca) if self._base.startswith("https:") else None
        self._client = HttpClient(self._base, max_connections=options.max_connections, headers=headers, tls=tls)

    async def get_json(self, path: str) -> Any:
        """GET ``path`` and return its JSON body."""
        response = await self._open("GET", path, None)
        try:
            return await self._json(response)
        finally:
            response.release()

    async def post_json(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to ``path`` and return the JSON answer."""
        response = await self._open("POST", path, body)
        try:
            return await self._json(response)
        finally:
            response.release()

    async def post_lines(
        self, path: str, body: dict[str, Any], *, last: Callable[[bytes], bool]
    ) -> AsyncGenerator[bytes, None]:
        """POST ``body`` and yield the response's non-empty lines as they arrive.

        ``last`` recognizes the stream's final line ([DONE], a done object): before that line is
        yielded, the few bytes left of the body are read, so that the connection can go back to
        the pool when the caller stops there. Leaving the iteration anywhere else (a cancel, an
        error) closes the connection at once, so the backend sees it.
        """
        response = await self._open("POST", path, body)
        lines = response.lines()
        try:
            while True:
                try:
                    line = await anext(lines)
                except StopAsyncIteration:
                    return
                except (ReadTimeout, TimeoutError) as exc:  # before OSError, TimeoutError's base
                    raise self._unavailable(str(exc)) from None
                except OSError as exc:
                    raise self._lost(exc) from None
                except BadResponse as exc:
                    raise protocol_error(f"{self.name}: unreadable HTTP response: {exc}") from None
                if last(line):
                    await _read_to_end(response)
                yield line
        finally:
            await lines.aclose()
            response.release()  # back to the pool if read to the end; closed (the backend sees it) if not

    async def _open(self, method: str, path: str, body: dict[str, Any] | None) -> Response:
        """Send the request; the response once its head is in and its status is a success."""
        timeouts = self.options.timeouts
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        since = asyncio.get_running_loop().time()
        head_timeout = min(timeouts.first_byte, timeouts.total)
        try:
            response = await self._client.request(
                method, path, data, connect_timeout=timeouts.connect, head_timeout=head_timeout
            )
        except TimeoutError:  # before OSError, its base class; the backend is up, just slow
            raise self._unavailable(f"no response within {head_timeout:g} s") from None
        except ConnectionLost as exc:
            raise self._lost(exc) from None
        except OSError as exc:
            raise self._unreachable(exc) from None
        except BadResponse as exc:
            raise protocol_error(f"{self.name}: unreadable HTTP response: {exc}") from None
        response.set_timeouts(timeouts.idle, timeouts.total, since=since)
        if response.status >= 300:
            try:
                raise await self._status_error(response)
            finally:
                response.release()
        return response

    async def _json(self, response: Response) -> Any:
        try:
            return json.loads(await response.read(_MAX_BODY))
        except (ReadTimeout, TimeoutError) as exc:  # before OSError, TimeoutError's base
            raise self._unavailable(str(exc)) from None
        except OSError as exc:
            raise self._lost(exc) from None
        except ValueError as exc:  # BadResponse too
            raise protocol_error(f"{self.name}: response is not JSON: {exc}") from None

    def _unavailable(self, message: str) -> IopError:
        return IopError(pb.ERROR_CODE_UNAVAILABLE, f"{self.name}: {message}")

    def _unreachable(self, exc: BaseException) -> IopError:
        reason = str(exc) or type(exc).__name__
        self.mark_down(reason)
        return self._unavailable(f"cannot reach {self._base}: {reason}")

    def _lost(self, exc: BaseException) -> IopError:
        reason = str(exc) or type(exc).__name__
        self.mark_down(reason)
        return self._unavailable(f"connection lost mid-response: {reason}")

    async def _status_error(self, response: Response) -> IopError:
        try:
            raw = await response.read(_MAX_ERROR_BODY)
        except (OSError, ReadTimeout, ValueError):
            raw = b""
        text = raw.decode(errors="replace")[:_MESSAGE_LIMIT]
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            document = json.loads(text)
            error = document.get("error", document)
            text = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        code = _STATUS_CODES.get(response.status, pb.ERROR_CODE_BACKEND_ERROR)
        return IopError(code, f"{self.name} answered HTTP {response.status}: {text}")

    def mark_down(self, reason: str) -> None:
        """Report the backend's models unavailable until a health probe succeeds."""
        if self._client.closed:
            return  # shutting down: nothing to probe for
        if self.available:
            _log.warning("backend down", backend=self.name, url=self._base, reason=reason)
        self.available = False
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        connect = self.options.timeouts.connect
        while not self.available:
            await asyncio.sleep(self.options.health_interval)
            try:
                async with asyncio.timeout(connect + 1):
                    response = await self._client.request(
                        "GET", self._health_path, connect_timeout=connect, head_timeout=connect
                    )
                    response.abort()  # the probe wants the status only
                    self.available = response.status < 500
            except (OSError, ValueError):  # TimeoutError is an OSError
                continue
        _log.info("backend up", backend=self.name, url=self._base)

    async def aclose(self) -> None:
        """Stop probing and close the connection pool."""
        if self._probe is not None:
            self._probe.cancel()
        await self._client.aclose()


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
