"""Errors as OpenAI returns them: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every IOP error code maps to one HTTP status in one table (:data:`STATUS`); README, "The edge",
prints it. An error found by the edge itself (bad JSON, a missing field, a bad key) is raised as
:class:`ApiError`; one that comes back from the platform is turned into one by :func:`from_iop`,
or by :func:`from_worker` for the worker's answers, where an unknown file or batch id is a 404.
"""

from __future__ import annotations

import json
import math

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import IopError, code_name

__all__ = ["ID_SHOWN", "STATUS", "ApiError", "from_event", "from_iop", "from_worker"]

STATUS: dict[int, int] = {
    pb.ERROR_CODE_UNSPECIFIED: 500,
    pb.ERROR_CODE_INVALID_ARGUMENT: 400,
    pb.ERROR_CODE_MODEL_NOT_FOUND: 404,
    pb.ERROR_CODE_UNAVAILABLE: 503,
    pb.ERROR_CODE_RESOURCE_EXHAUSTED: 429,
    pb.ERROR_CODE_DEADLINE_EXCEEDED: 504,
    pb.ERROR_CODE_CANCELLED: 499,
    pb.ERROR_CODE_INTERNAL: 500,
    pb.ERROR_CODE_BACKEND_ERROR: 502,
    pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR: 502,
    pb.ERROR_CODE_UNAUTHENTICATED: 401,
    pb.ERROR_CODE_PERMISSION_DENIED: 403,
    pb.ERROR_CODE_FRAME_TOO_LARGE: 413,
    pb.ERROR_CODE_MALFORMED_FRAME: 500,
    pb.ERROR_CODE_UNKNOWN_MESSAGE_TYPE: 500,
    pb.ERROR_CODE_CODEC_MISMATCH: 500,
    pb.ERROR_CODE_PROTOCOL_VIOLATION: 500,
    pb.ERROR_CODE_SHUTTING_DOWN: 503,
    pb.ERROR_CODE_NODE_LOST: 502,
    pb.ERROR_CODE_NOT_FOUND: 404,
}
"""HTTP status of each IOP error code (499: the client closed the request, as nginx counts it)."""

_TYPES = {429: "requests"}
"""OpenAI's error type where it is not the rule: a client's error (4xx) is an ``invalid_request_error``
(a 409 name in use, a 408 body too slow, as much as a 400), a server's a ``server_error``."""
_CODES: dict[int, str] = {
    pb.ERROR_CODE_MODEL_NOT_FOUND: "model_not_found",
    pb.ERROR_CODE_RESOURCE_EXHAUSTED: "rate_limit_exceeded",
    pb.ERROR_CODE_UNAVAILABLE: "service_unavailable",
    pb.ERROR_CODE_SHUTTING_DOWN: "service_unavailable",
    pb.ERROR_CODE_DEADLINE_EXCEEDED: "timeout",
    pb.ERROR_CODE_BACKEND_ERROR: "backend_error",
    pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR: "backend_error",
    pb.ERROR_CODE_NODE_LOST: "node_lost",
    pb.ERROR_CODE_CANCELLED: "cancelled",
    pb.ERROR_CODE_FRAME_TOO_LARGE: "request_too_large",
}
_REASON_CODES: dict[int, str] = {
    pb.ERROR_REASON_QUEUE_FULL: "queue_full",
    pb.ERROR_REASON_SLOW_CONSUMER: "slow_consumer",
    pb.ERROR_REASON_TOO_LARGE: "request_too_large",
}
"""OpenAI ``code`` for a reason that callers tell apart from the rest of its code."""


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
        self.retry_after = retry_after
        """Seconds, sent as the Retry-After header (whole seconds, rounded up) with 429 and 503."""

    def body(self) -> dict[str, object]:
        """The error object (what goes inside ``{"error": ...}``)."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def content(self) -> bytes:
        """The whole response body."""
        return json.dumps({"error": self.body()}).encode()

    def headers(self) -> dict[str, str]:
        """Retry-After when known."""
        if self.retry_after is None:
            return {}
        return {"retry-after": str(max(1, math.ceil(self.retry_after)))}


def from_iop(error: IopError | pb.Error) -> ApiError:
    """The HTTP error for an error from the platform."""
    if isinstance(error, pb.Error):
        error = IopError.from_message(error)
    status = STATUS.get(error.code, 500)
    retry_after = error.retry_after.total_seconds() if error.retry_after is not None else None
    if retry_after is None and status in (429, 503) and error.retryable:
        retry_after = 1.0
    code = _CODES.get(error.code)
    code = _REASON_CODES.get(error.reason, code)
    return ApiError(
        status,
        error.message or code_name(error.code).lower(),
        param=error.param or None,
        code=code,
        retry_after=retry_after,
    )


ID_SHOWN = 100
"""Characters of an unknown id said back in a 404 (ids are about 30; a megabyte one is not echoed)."""
_OBJECTS = {"file_id": "File", "batch_id": "Batch"}
"""The worker's ``param`` for an unknown id -> the object's name in OpenAI's 404 message."""


def from_worker(error: IopError, object_id: str, *, param: str = "id") -> ApiError:
    """The HTTP error for the worker's answer to a request about ``object_id``.

    The worker refuses an unknown id with NOT_FOUND, its ``param`` naming ``file_id`` or
    ``batch_id``; OpenAI answers that with 404 ``No such File object: ID``.
    """
    if error.code == pb.ERROR_CODE_NOT_FOUND:
        noun = f"{_OBJECTS[error.param]} object" if error.param in _OBJECTS else "object"
        return ApiError(404, f"No such {noun}: {object_id[:ID_SHOWN]}", param=param)
    return from_iop(error)


def from_event(event: pb.RunEvent) -> ApiError:
    """The HTTP error for a run's error event."""
    return from_iop(event.error)
