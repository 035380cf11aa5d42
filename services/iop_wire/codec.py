"""Codecs turn an ``Envelope`` (google protobuf, upb-backed) into a frame body and back.

Two codecs, chosen per connection by the preface (see ``endpoint``):

- ``proto``: protobuf binary, the default and the fast path.
- ``json``: proto3 canonical JSON (``google.protobuf.json_format``), what any language's
  protobuf library reads and writes; for debugging and for clients without protobuf binary.
"""

from __future__ import annotations

import json
from typing import Final, Protocol

from google.protobuf.message import DecodeError as ProtobufDecodeError

from iop_gen.pb.iop.runtime_pb2 import ERROR_CODE_PROTOCOL_VIOLATION, Envelope
from iop_wire.errors import DecodeError, HandshakeError, IopError
from iop_wire.framing import PREFACE_PREFIX

__all__ = ["CODECS", "Codec", "JsonCodec", "ProtobufCodec", "get_codec", "preface_refusal"]


class Codec(Protocol):
    """Encodes and decodes whole envelopes."""

    name: str

    def encode(self, envelope: Envelope) -> bytes:
        """Return the frame body for ``envelope``."""
        ...

    def decode(self, body: bytes) -> Envelope:
        """Parse a frame body; raise :class:`DecodeError` if it is not an envelope."""
        ...


class ProtobufCodec:
    """Protobuf binary encoding."""

    name = "proto"

    def encode(self, envelope: Envelope) -> bytes:
        return envelope.SerializeToString()

    def decode(self, body: bytes) -> Envelope:
        try:
            return Envelope.FromString(body)
        except ProtobufDecodeError as exc:
            raise DecodeError(f"frame body is not a protobuf Envelope: {exc}") from None


class JsonCodec:
    """Proto3 canonical JSON, UTF-8, one envelope object per frame."""

    name = "json"

    def encode(self, envelope: Envelope) -> bytes:
        from google.protobuf import json_format  # noqa: PLC0415 - on first use: a short process (iop nodes ls) speaks proto

        document = json_format.MessageToDict(envelope)
        return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()

    def decode(self, body: bytes) -> Envelope:
        from google.protobuf import json_format  # noqa: PLC0415 - as in encode

        try:
            # Unknown fields are skipped so that a message type added later reads as
            # "no body" (ERROR_CODE_UNKNOWN_MESSAGE_TYPE), as it does in protobuf binary.
            return json_format.Parse(body, Envelope(), ignore_unknown_fields=True)
        except (json_format.ParseError, UnicodeDecodeError, ValueError) as exc:
            raise DecodeError(f"frame body is not a JSON Envelope: {_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


CODECS: Final[dict[str, Codec]] = {"proto": ProtobufCodec(), "json": JsonCodec()}


def get_codec(name: str) -> Codec:
    """Return the codec called ``name`` (``proto`` or ``json``)."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODECS)}") from None


def preface_refusal(answer: bytes, codec: Codec) -> IopError | None:
    """None when a listener's ``answer`` to our preface accepts ``codec``, else the error it sent instead."""
    if answer == PREFACE_PREFIX + codec.name.encode():
        return None
    envelope = codec.decode(answer)
    if envelope.WhichOneof("body") != "error":
        return HandshakeError(ERROR_CODE_PROTOCOL_VIOLATION, "listener answered the preface with a non-error")
    error = envelope.error
    return HandshakeError(error.code, error.message, retryable=error.retryable, reason=error.reason)
