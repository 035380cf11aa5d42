"""IOP's error tree; the codes are the proto's ``ErrorCode`` enum, used as generated (upb).

    IopError(code, message, retryable, run_id)
    ├── FrameError            a frame cannot be read: length 0 or over the maximum, or cut off
    ├── DecodeError           a frame's body is not an envelope in the agreed codec
    ├── HandshakeError        the connection preface failed (codec mismatch, bad preface)
    └── ConnectionClosed      the connection is gone; runs on it may be retried

Codes are the generated constants (``pb.ERROR_CODE_UNAVAILABLE``), never a hand copy of the
enum; :func:`code_name` gives the short name (``UNAVAILABLE``) used in logs and run history.
Errors become wire ``Error`` messages in one place: :func:`iop_wire.messages.error_message`.
"""

from __future__ import annotations

import datetime
from typing import TypeAlias

from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = [
    "Code",
    "ConnectionClosed",
    "DecodeError",
    "FrameError",
    "HandshakeError",
    "IopError",
    "Reason",
    "code_name",
]

Code: TypeAlias = pb.ErrorCode.ValueType
"""An ``ErrorCode`` value (``pb.ERROR_CODE_*``)."""
Reason: TypeAlias = pb.ErrorReason.ValueType
"""An ``ErrorReason`` value (``pb.ERROR_REASON_*``): which case of a code, where callers tell them apart."""

_RETRYABLE = frozenset(
    {
        pb.ERROR_CODE_UNAVAILABLE,
        pb.ERROR_CODE_RESOURCE_EXHAUSTED,
        pb.ERROR_CODE_SHUTTING_DOWN,
        pb.ERROR_CODE_NODE_LOST,
    }
)


def code_name(code: int) -> str:
    """``UNAVAILABLE`` for ``pb.ERROR_CODE_UNAVAILABLE``; ``UNKNOWN_<n>`` for a code from a newer peer."""
    try:
        return pb.ErrorCode.Name(code).removeprefix("ERROR_CODE_")  # type: ignore[arg-type]
    except ValueError:
        return f"UNKNOWN_{code}"


class IopError(Exception):
    """A failure with an IOP error code, safe to send to the peer."""

    def __init__(
        self,
        code: Code,
        message: str,
        *,
        retryable: bool | None = None,
        run_id: str = "",
        retry_after: datetime.timedelta | None = None,
        param: str = "",
        reason: Reason = pb.ERROR_REASON_UNSPECIFIED,
        usage: pb.Usage | None = None,
    ) -> None:
        super().__init__(message)
        self.code: Code = code
        self.message = message
        self.retryable = code in _RETRYABLE if retryable is None else retryable
        self.run_id = run_id
        self.retry_after = retry_after
        """How long to wait before retrying, when the sender can tell (RESOURCE_EXHAUSTED)."""
        self.param = param
        """The request field to blame, by its OpenAI name (INVALID_ARGUMENT)."""
        self.reason: Reason = reason
        """Which case of the code (a full queue or a caller's own limit, ...); decide by it, not by the message."""
        self.usage = usage
        """A run's terminal error: the tokens it used before it ended, when the sender counted them."""

    @property
    def name(self) -> str:
        """The code's short name (``UNAVAILABLE``)."""
        return code_name(self.code)

    def __str__(self) -> str:
        return f"{self.name}: {self.message}"

    @classmethod
    def from_message(cls, error: pb.Error) -> IopError:
        """The error a peer sent."""
        retry_after = error.retry_after.ToTimedelta() if error.HasField("retry_after") else None
        return cls(
            error.code,
            error.message,
            retryable=error.retryable,
            run_id=error.run_id,
            retry_after=retry_after,
            param=error.param,
            reason=error.reason,
            usage=error.usage if error.HasField("usage") else None,
        )


class FrameError(IopError):
    """A frame cannot be read (length 0 or over the maximum, or its body did not arrive in time)."""

    def __init__(self, message: str, code: Code = pb.ERROR_CODE_FRAME_TOO_LARGE) -> None:
        super().__init__(code, message, retryable=False)


class DecodeError(IopError):
    """A frame's body is not a valid envelope in the agreed codec."""

    def __init__(self, message: str) -> None:
        super().__init__(pb.ERROR_CODE_MALFORMED_FRAME, message, retryable=False)


class HandshakeError(IopError):
    """The connection preface failed."""


class ConnectionClosed(IopError):
    """The connection closed; what ran on it may be retried elsewhere."""

    def __init__(self, message: str, code: Code = pb.ERROR_CODE_UNAVAILABLE) -> None:
        super().__init__(code, message, retryable=True)
