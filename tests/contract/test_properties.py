"""Property tests: arbitrary envelopes survive both codecs and both runtimes unchanged."""

from __future__ import annotations

import datetime
from typing import Any

from google.protobuf import duration_pb2, struct_pb2, timestamp_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop_gen.bp import iop as bp
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import get_codec
from iop_wire.framing import FrameDecoder, encode_frame

F = FieldDescriptor
_finite = st.floats(allow_nan=False, allow_infinity=False)
_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    F.TYPE_DOUBLE: _finite,
    # protobuf's JSON printer writes the largest float32 rounded past it (3.4028235e+38), and
    # its parser then refuses that as out of range (README, design)
    F.TYPE_FLOAT: st.floats(-3.3999999521443642e38, 3.3999999521443642e38, width=32),  # 3.4e38 as a float32
    F.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    F.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    F.TYPE_UINT32: st.integers(0, 2**32 - 1),
    F.TYPE_UINT64: st.integers(0, 2**64 - 1),
    F.TYPE_BOOL: st.booleans(),
    F.TYPE_STRING: st.text(max_size=20),
    F.TYPE_BYTES: st.binary(max_size=20),
}
_json_values = st.recursive(
    st.none() | st.booleans() | _finite | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


def _well_known(descriptor: Descriptor, exact: bool) -> st.SearchStrategy[Message] | None:
    name = descriptor.full_name
    if name == "google.protobuf.Timestamp":
        moments = st.datetimes(datetime.datetime(1, 1, 1), datetime.datetime(9999, 12, 31))
        return moments.map(lambda t: _set(timestamp_pb2.Timestamp(), "FromDatetime", t))
    if name == "google.protobuf.Duration":
        step, low = (1, -(10**15)) if exact else (1000, 0)
        return st.integers(low, 10**15).map(lambda n: _set(duration_pb2.Duration(), "FromNanoseconds", n - n % step))
    if name == "google.protobuf.Struct":
        return st.dictionaries(st.text(max_size=5), _json_values, max_size=4).map(
            lambda d: _set(struct_pb2.Struct(), "update", d)
        )
    return None


def _set(message: Message, method: str, value: Any) -> Message:
    getattr(message, method)(value)
    return message


def _value(field: FieldDescriptor, depth: int, exact: bool) -> st.SearchStrategy[Any]:
    if not exact and field.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return _SCALARS[field.type].map(lambda number: number + 0.0)  # -0.0 + 0.0 is 0.0
    if field.enum_type is not None:
        return st.sampled_from([v.number for v in field.enum_type.values])
    if field.message_type is not None:
        return messages(field.message_type, depth + 1, exact=exact)
    return _SCALARS[field.type]


@st.composite
def _message(draw: st.DrawFn, descriptor: Descriptor, depth: int, exact: bool) -> Message:
    message: Message = getattr(pb, descriptor.name)()
    oneofs_done: set[str] = set()
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None:
            if oneof.name in oneofs_done or not draw(st.booleans()):
                continue
            oneofs_done.add(oneof.name)
        elif field.message_type is not None and depth >= 3:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields
            entries = draw(st.dictionaries(_SCALARS[key_field.type], _value(value_field, depth, exact), max_size=3))
            getattr(message, field.name).update(entries)
        elif field.is_repeated:
            items = draw(st.lists(_value(field, depth, exact), max_size=3))
            target = getattr(message, field.name)
            for item in items:
                target.add().CopyFrom(item) if field.message_type else target.append(item)
        else:
            value = draw(_value(field, depth, exact))
            if field.message_type is not None:
                getattr(message, field.name).CopyFrom(value)
            else:
                setattr(message, field.name, value)
    return message


def messages(descriptor: Descriptor, depth: int = 0, *, exact: bool = True) -> st.SearchStrategy[Message]:
    """Arbitrary messages of ``descriptor`` (nested up to depth 3).

    ``exact=False`` keeps to what betterproto2 can hold: no negative zero (it drops -0.0 as
    the default value, where upb keeps the sign bit), Timestamp and Duration to whole
    microseconds, and durations
    non-negative: betterproto2 unwraps them to datetime and timedelta, which cannot hold
    nanoseconds, and it encodes negative sub-second timedeltas with the wrong sign (both found
    by this test; IOP's durations are never negative).
    """
    known = _well_known(descriptor, exact)
    return known if known is not None else _message(descriptor, depth, exact)


envelopes = messages(pb.Envelope.DESCRIPTOR)
betterproto2_envelopes = messages(pb.Envelope.DESCRIPTOR, exact=False)
_settings = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_settings
@given(envelopes)
def test_both_codecs_round_trip(envelope: pb.Envelope) -> None:
    for name in ("proto", "json"):
        codec = get_codec(name)
        assert codec.decode(codec.encode(envelope)) == envelope


@_settings
@given(betterproto2_envelopes)
def test_betterproto2_round_trips_google_bytes(envelope: pb.Envelope) -> None:
    typed = bp.Envelope.parse(envelope.SerializeToString())
    assert pb.Envelope.FromString(bytes(typed)) == envelope


@_settings
@given(st.lists(envelopes, min_size=1, max_size=5), st.integers(1, 64))
def test_frames_survive_any_chunking(batch: list[pb.Envelope], chunk: int) -> None:
    for index, envelope in enumerate(batch):
        envelope.id = str(index)  # senders always set it, so no envelope encodes to zero bytes
    stream = b"".join(encode_frame(e.SerializeToString()) for e in batch)
    decoder = FrameDecoder()
    bodies = [body for i in range(0, len(stream), chunk) for body in decoder.feed(stream[i : i + chunk])]
    assert [pb.Envelope.FromString(b) for b in bodies] == batch
    assert decoder.buffered == 0
