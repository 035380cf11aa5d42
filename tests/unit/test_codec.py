"""Codecs and message helpers, with no sockets."""

from __future__ import annotations

import datetime

import pytest

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import get_codec
from iop_wire.errors import ConnectionClosed, DecodeError, IopError, code_name
from iop_wire.messages import error_envelope, message_type


def test_unknown_codec_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown codec 'xml'; known: proto, json"):
        get_codec("xml")


def test_json_codec_writes_canonical_proto3_json() -> None:
    envelope = pb.Envelope(id="1", run_id="r", run_event=pb.RunEvent(sequence=2, delta=pb.RunDelta(text="hé")))
    assert (
        get_codec("json").encode(envelope)
        == '{"id":"1","runId":"r","runEvent":{"sequence":"2","delta":{"text":"hé"}}}'.encode()
    )


@pytest.mark.parametrize(("name", "body"), [("proto", b"\xff\xff"), ("json", b"{not json")])
def test_decode_errors_are_malformed_frame(name: str, body: bytes) -> None:
    with pytest.raises(DecodeError) as caught:
        get_codec(name).decode(body)
    assert caught.value.code == pb.ERROR_CODE_MALFORMED_FRAME


def test_message_type_uses_the_seed_names() -> None:
    assert message_type(pb.Envelope(run_request=pb.RunRequest())) == "run.request"
    assert message_type(pb.Envelope(capability_response=pb.CapabilityResponse())) == "capability.response"
    assert message_type(pb.Envelope(node_drain=pb.NodeDrain())) == "node.drain"
    assert message_type(pb.Envelope(id="x")) is None


def test_errors_default_retryable_by_code_and_become_one_wire_shape() -> None:
    assert IopError(pb.ERROR_CODE_UNAVAILABLE, "x").retryable
    assert not IopError(pb.ERROR_CODE_INVALID_ARGUMENT, "x").retryable
    assert ConnectionClosed("gone").retryable
    envelope = error_envelope(IopError(pb.ERROR_CODE_MODEL_NOT_FOUND, "no such model", run_id="r9"), in_reply_to="e1")
    assert (envelope.run_id, envelope.in_reply_to) == ("r9", "e1")
    assert envelope.error.code == pb.ERROR_CODE_MODEL_NOT_FOUND and not envelope.error.retryable


def test_error_codes_are_the_generated_enum_with_short_names() -> None:
    assert code_name(pb.ERROR_CODE_RESOURCE_EXHAUSTED) == "RESOURCE_EXHAUSTED"
    assert code_name(999) == "UNKNOWN_999"  # a code from a newer peer still has a name
    error = IopError(pb.ERROR_CODE_MODEL_NOT_FOUND, "gone")
    assert (error.name, str(error)) == ("MODEL_NOT_FOUND", "MODEL_NOT_FOUND: gone")
    assert IopError.from_message(pb.Error(code=999, message="new", retryable=True)).retryable


def test_retry_after_travels_both_ways_and_node_lost_is_retryable() -> None:
    error = IopError(pb.ERROR_CODE_RESOURCE_EXHAUSTED, "queue full", retry_after=datetime.timedelta(seconds=1.5))
    wire = error_envelope(error).error
    assert wire.retry_after.ToTimedelta() == datetime.timedelta(seconds=1.5)
    assert IopError.from_message(wire).retry_after == datetime.timedelta(seconds=1.5)
    assert IopError.from_message(pb.Error(code=pb.ERROR_CODE_UNAVAILABLE)).retry_after is None  # unset: no hint
    assert IopError(pb.ERROR_CODE_NODE_LOST, "node gone").retryable
