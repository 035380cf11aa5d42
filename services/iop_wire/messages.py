"""Envelope helpers: message-type names, builders and betterproto2 <-> upb conversion.

Service code is written against the betterproto2 dataclasses (``iop_gen.bp.iop``); the wire
moves google protobuf messages (``iop_gen.pb.iop.runtime_pb2``), whose upb core encodes and
decodes ~20 times faster. Both are generated from the same proto, so converting is a
serialize/parse through protobuf binary, done off the per-token path only.
"""

from __future__ import annotations

from typing import Final, TypeVar

import betterproto2
from google.protobuf.message import Message as PbMessage

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.errors import IopError

__all__ = [
    "MESSAGE_TYPES",
    "error_envelope",
    "error_message",
    "from_typed",
    "message_type",
    "to_typed",
]

_Typed = TypeVar("_Typed", bound=betterproto2.Message)
_Pb = TypeVar("_Pb", bound=PbMessage)

#: Seed message-type name for each ``Envelope.body`` field.
MESSAGE_TYPES: Final[dict[str, str]] = {
    field.name: field.name.replace("_", ".") for field in pb.Envelope.DESCRIPTOR.oneofs_by_name["body"].fields
}


def message_type(envelope: pb.Envelope) -> str | None:
    """The seed's name of the envelope's message (``run.request``, ...), None if no body."""
    field = envelope.WhichOneof("body")
    return None if field is None else MESSAGE_TYPES[field]


def to_typed(message: PbMessage, cls: type[_Typed]) -> _Typed:
    """Convert a google protobuf message to its betterproto2 dataclass."""
    return cls.parse(message.SerializeToString())


def from_typed(message: betterproto2.Message, cls: type[_Pb]) -> _Pb:
    """Convert a betterproto2 dataclass to its google protobuf message."""
    return cls.FromString(bytes(message))


def error_message(error: IopError) -> pb.Error:
    """The wire form of ``error``: the one place errors become ``Error`` messages."""
    return pb.Error(
        code=pb.ErrorCode.ValueType(int(error.code)),
        message=error.message,
        retryable=error.retryable,
        run_id=error.run_id,
    )


def error_envelope(error: IopError, *, in_reply_to: str = "") -> pb.Envelope:
    """An envelope whose body is ``error``."""
    return pb.Envelope(run_id=error.run_id, in_reply_to=in_reply_to, error=error_message(error))
