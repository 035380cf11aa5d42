"""Codecs and message helpers, with no sockets."""

from __future__ import annotations

import pytest

from iop_gen.bp import iop as bp
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import get_codec
from iop_wire.errors import ConnectionClosed, DecodeError, ErrorCode, IopError
from iop_wire.messages import error_envelope, from_typed, message_type, to_typed


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
    assert caught.value.code == ErrorCode.MALFORMED_FRAME


def test_message_type_uses_the_seed_names() -> None:
    assert message_type(pb.Envelope(run_request=pb.RunRequest())) == "run.request"
    assert message_type(pb.Envelope(capability_response=pb.CapabilityResponse())) == "capability.response"
    assert message_type(pb.Envelope(node_drain=pb.NodeDrain())) == "node.drain"
    assert message_type(pb.Envelope(id="x")) is None


def test_typed_conversion_both_ways() -> None:
    typed = bp.RunRequest(run_id="r", model="m", sampling=bp.Sampling(max_tokens=5, stop=["x"]))
    upb = from_typed(typed, pb.RunRequest)
    assert upb.sampling.max_tokens == 5 and list(upb.sampling.stop) == ["x"]
    assert to_typed(upb, bp.RunRequest) == typed


def test_errors_default_retryable_by_code_and_become_one_wire_shape() -> None:
    assert IopError(ErrorCode.UNAVAILABLE, "x").retryable
    assert not IopError(ErrorCode.INVALID_ARGUMENT, "x").retryable
    assert ConnectionClosed("gone").retryable
    envelope = error_envelope(IopError(ErrorCode.MODEL_NOT_FOUND, "no such model", run_id="r9"), in_reply_to="e1")
    assert (envelope.run_id, envelope.in_reply_to) == ("r9", "e1")
    assert envelope.error.code == pb.ERROR_CODE_MODEL_NOT_FOUND and not envelope.error.retryable


def test_error_code_enum_mirrors_the_proto() -> None:
    assert {code.name for code in ErrorCode} == {
        n.removeprefix("ERROR_CODE_") for n in pb.ErrorCode.DESCRIPTOR.values_by_name
    }
    assert all(int(code) == pb.ErrorCode.Value(f"ERROR_CODE_{code.name}") for code in ErrorCode)
