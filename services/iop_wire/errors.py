"""IOP's error tree; the codes are the proto's ``ErrorCode`` enum.

    IopError(code, message, retryable, run_id)
    ├── FrameError            a frame cannot be read: length 0 or over the maximum
    ├── DecodeError           a frame's body is not an envelope in the agreed codec
    ├── HandshakeError        the connection preface failed (codec mismatch, bad preface)
    └── ConnectionClosed      the connection is gone; runs on it may be retried

Errors become wire ``Error`` messages in one place: :func:`iop_wire.messages.error_message`.
"""

from __future__ import annotations

from iop_gen.bp.iop import ErrorCode

__all__ = [
    "ConnectionClosed",
    "DecodeError",
    "ErrorCode",
    "FrameError",
    "HandshakeError",
    "IopError",
]

_RETRYABLE = frozenset(
    {
        ErrorCode.UNAVAILABLE,
        ErrorCode.RESOURCE_EXHAUSTED,
        ErrorCode.SHUTTING_DOWN,
    }
)


class IopError(Exception):
    """A failure with an IOP error code, safe to send to the peer."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        retryable: bool | None = None,
        run_id: str = "",
    ) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.retryable = code in _RETRYABLE if retryable is None else retryable
        self.run_id = run_id

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class FrameError(IopError):
    """A frame's length prefix is 0 or over the maximum; the stream cannot be resynchronised."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.FRAME_TOO_LARGE, message, retryable=False)


class DecodeError(IopError):
    """A frame's body is not a valid envelope in the agreed codec."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.MALFORMED_FRAME, message, retryable=False)


class HandshakeError(IopError):
    """The connection preface failed."""


class ConnectionClosed(IopError):
    """The connection closed; what ran on it may be retried elsewhere."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.UNAVAILABLE) -> None:
        super().__init__(code, message, retryable=True)
