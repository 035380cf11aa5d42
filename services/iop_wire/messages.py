"""Envelope helpers: message-type names and the one place errors become ``Error`` messages.

Service code uses the upb classes generated in ``iop_gen.pb`` (typed by mypy-protobuf stubs)
and nothing else; the betterproto2 dataclasses in ``iop_gen.bp`` are for Python users of the
protocol and are proven equal to these by the contract tests.
"""

from __future__ import annotations

from typing import Final

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.errors import IopError

__all__ = ["BATCH_TIMES", "MESSAGE_TYPES", "error_envelope", "error_message", "message_type"]

#: Seed message-type name for each ``Envelope.body`` field.
MESSAGE_TYPES: Final[dict[str, str]] = {
    field.name: field.name.replace("_", ".") for field in pb.Envelope.DESCRIPTOR.oneofs_by_name["body"].fields
}

#: ``BatchInfo``'s times, in the proto's order (``created_at`` first): OpenAI's Batch object has each.
BATCH_TIMES: Final[tuple[str, ...]] = tuple(
    field.name
    for field in pb.BatchInfo.DESCRIPTOR.fields
    if field.message_type is not None and field.message_type.full_name == "google.protobuf.Timestamp"
)


def message_type(envelope: pb.Envelope) -> str | None:
    """The seed's name of the envelope's message (``run.request``, ...), None if no body."""
    field = envelope.WhichOneof("body")
    return None if field is None else MESSAGE_TYPES[field]


def error_message(error: IopError) -> pb.Error:
    """The wire form of ``error``: the one place errors become ``Error`` messages."""
    message = pb.Error(
        code=error.code,
        message=error.message,
        retryable=error.retryable,
        run_id=error.run_id,
        param=error.param,
        reason=error.reason,
    )
    if error.retry_after is not None:
        message.retry_after.FromTimedelta(error.retry_after)
    if error.usage is not None:
        message.usage.CopyFrom(error.usage)
    return message


def error_envelope(error: IopError, *, in_reply_to: str = "") -> pb.Envelope:
    """An envelope whose body is ``error``."""
    return pb.Envelope(run_id=error.run_id, in_reply_to=in_reply_to, error=error_message(error))
