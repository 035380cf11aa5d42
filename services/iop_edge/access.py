"""What every route shares: the API key check and the one way an :class:`ApiError` becomes a response."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from iop_edge.edge import Edge
from iop_edge.keys import ApiKey, KeyStore
from iop_wire.openai.errors import ApiError
from iop_wire.openai.responses import json_bytes

__all__ = ["JSON", "authenticate", "declared_length", "error_response", "read_body", "serve_json"]

_log = structlog.get_logger("iop.edge")
JSON = "application/json"
_NO_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using "
    "Bearer auth (i.e. Authorization: Bearer YOUR_KEY). Create one with 'iop keys create NAME'."
)


ANONYMOUS = "anonymous"
"""The caller of requests when keys are off (``auth: none``)."""


def caller_of(key: ApiKey | None) -> str:
    """Who a request is for: its key's name (runs, files and batches are attributed to it)."""
    return key.name if key is not None else ANONYMOUS


def authenticate(keys: KeyStore | None, request: Request, *, x_api_key: bool = False) -> ApiKey | None:
    """The request's API key; 401 without a valid one (None when keys are off: ``auth: none``).

    ``x_api_key``: an ``x-api-key`` header is taken too (Anthropic's SDKs send the key there).
    """
    if keys is None:
        return None
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if x_api_key and (given := request.headers.get("x-api-key", "")).strip():
        scheme, token = "bearer", given
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, _NO_KEY)
    key = keys.authenticate(token.strip())
    if key is None:
        shown = token[:6] + "*" * 4 + token[-4:] if len(token) > 12 else "*" * len(token)
        message = f"Incorrect API key provided: {shown}. Keys are made with 'iop keys create NAME'."
        raise ApiError(401, message, code="invalid_api_key")
    return key


def error_response(error: ApiError, request_id: str = "") -> Response:
    """``{"error": {...}}`` with the error's status (and Retry-After); server-side ones are logged."""
    if error.status >= 500 or error.status == 429:
        _log.info("request failed", run_id=request_id, status=error.status, reason=error.message)
    return Response(error.content(), status_code=error.status, media_type=JSON, headers=error.headers())


async def serve_json(
    edge: Edge, route: str, request: Request, produce: Callable[[ApiKey | None], Awaitable[dict[str, Any]]]
) -> Response:
    """The request authenticated, then ``produce(key)``'s object as JSON, or its ApiError; counted."""
    try:
        response = Response(json_bytes(await produce(authenticate(edge.keys, request))), media_type=JSON)
    except ApiError as error:
        response = error_response(error)
    edge.metrics.requests.labels(route, "", str(response.status_code)).inc()
    return response


def declared_length(request: Request) -> int | None:
    """The body's length as its Content-Length says, when that is a plain ASCII number (else None:
    the body is then counted as it arrives)."""
    declared = request.headers.get("content-length", "")
    return int(declared) if declared.isascii() and declared.isdigit() and len(declared) <= 20 else None


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole request body; 413 once it is over ``limit`` bytes (declared or read), 408 when it
    has not all arrived ``timeout`` seconds after the handler started reading it, 499 when the
    client went away before sending it all."""
    if (declared := declared_length(request)) is not None and declared > limit:
        raise ApiError(413, f"the request body is {declared} bytes, over this edge's limit of {limit}")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body is over this edge's limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        _log.warning("request body too slow", path=request.url.path, received=size, timeout=timeout)
        message = f"the request body did not arrive within {timeout:g} s (http.body_timeout); {size} bytes came"
        raise ApiError(408, message, code="timeout") from None
    except ClientDisconnect:
        raise ApiError(499, "the client closed the request before sending its whole body", code="cancelled") from None
    return b"".join(chunks)
