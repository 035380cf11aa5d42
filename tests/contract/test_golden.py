"""Golden examples: one or more JSON files per proto message, checked against both runtimes.

File names are ``<Message>[.<variant>].json``. Together the examples must use every field,
oneof branch, map, repeated field, optional field and non-zero enum value of runtime.proto.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import betterproto2
import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from iop_gen.bp import iop as bp
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.codec import get_codec

EXAMPLES = Path(__file__).parent / "examples"
FILE = pb.DESCRIPTOR
MESSAGES = sorted(FILE.message_types_by_name)
PATHS = sorted(EXAMPLES.glob("*.json"))


def _load(path: Path) -> tuple[str, dict[str, Any]]:
    return path.name.split(".")[0], json.loads(path.read_text())


def _pb(name: str, document: dict[str, Any]) -> Message:
    message: Message = getattr(pb, name)()
    return json_format.ParseDict(document, message)


def _walk(message: Message) -> Iterator[tuple[Message, FieldDescriptor, Any]]:
    """Every set field of ``message`` and of the messages inside it."""
    for field, value in message.ListFields():
        yield message, field, value
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            entries = value.values() if field.message_type.fields_by_name["value"].message_type else []
        elif field.is_repeated:
            entries = value
        else:
            entries = [value]
        for entry in entries:
            yield from _walk(entry)


def _has_map(message: Message) -> bool:
    return any(
        field.message_type is not None and field.message_type.GetOptions().map_entry and len(value) > 1
        for _, field, value in _walk(message)
    )


def test_every_message_has_an_example() -> None:
    named = {_load(path)[0] for path in PATHS}
    missing = sorted(set(MESSAGES) - named)
    assert not missing, f"messages without a golden example in {EXAMPLES}: {missing}"
    unknown = sorted(named - set(MESSAGES))
    assert not unknown, f"examples for messages not in runtime.proto: {unknown}"


def test_examples_use_every_field_and_enum_value() -> None:
    used_fields: set[str] = set()
    used_enums: set[str] = set()
    for path in PATHS:
        for _, field, value in _walk(_pb(*_load(path))):
            used_fields.add(field.full_name)
            if field.enum_type is not None:
                values = value if field.is_repeated else [value]
                used_enums.update(
                    f"{field.enum_type.full_name}.{field.enum_type.values_by_number[v].name}" for v in values
                )
    all_fields = {f.full_name for m in FILE.message_types_by_name.values() for f in m.fields}
    assert sorted(all_fields - used_fields) == []
    all_enums = {f"{e.full_name}.{v.name}" for e in FILE.enum_types_by_name.values() for v in e.values if v.number != 0}
    assert sorted(all_enums - used_enums) == []
    assert "iop.RunRequest.openai_fields" in used_fields  # google.protobuf.Struct is exercised


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_json_binary_json_is_identity(path: Path) -> None:
    name, document = _load(path)
    binary = _pb(name, document).SerializeToString()
    again = getattr(pb, name).FromString(binary)
    assert json_format.MessageToDict(again) == document


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_betterproto2_and_google_protobuf_agree(path: Path) -> None:
    name, document = _load(path)
    reference = _pb(name, document)
    typed_cls: type[betterproto2.Message] = getattr(bp, name)
    typed = typed_cls.parse(reference.SerializeToString())
    # each parses the other's bytes to an equal message
    assert getattr(pb, name).FromString(bytes(typed)) == reference
    assert typed_cls.parse(bytes(typed)) == typed
    # identical bytes wherever the encoding is deterministic (map order is not)
    if not _has_map(reference):
        assert bytes(typed) == reference.SerializeToString()
    # the same JSON, and each reads the other's JSON
    assert typed.to_dict() == json_format.MessageToDict(reference) == document
    assert typed_cls.from_dict(document) == typed


ENVELOPES = [p for p in PATHS if p.name.startswith("Envelope.")]


@pytest.mark.parametrize("path", ENVELOPES, ids=[p.stem for p in ENVELOPES])
def test_json_codec_and_protobuf_codec_deliver_equal_envelopes(path: Path) -> None:
    envelope = _pb(*_load(path))
    delivered = [get_codec(name).decode(get_codec(name).encode(envelope)) for name in ("proto", "json")]
    assert delivered[0] == delivered[1] == envelope


def test_map_entry_order_changes_the_bytes_not_the_message() -> None:
    """Why map-bearing examples compare parsed messages, not bytes (measured, not assumed)."""
    labels = {"zone": "eu", "gpu": "none", "rack": "r7"}
    forward = bytes(bp.CapabilityResponse(labels=labels))
    backward = bytes(bp.CapabilityResponse(labels=dict(reversed(labels.items()))))
    # betterproto2 writes entries in insertion order: one map, two encodings
    assert _label_keys(forward) == ["zone", "gpu", "rack"] and _label_keys(backward) == ["rack", "gpu", "zone"]
    assert forward != backward
    # both parse to one message, and google protobuf's deterministic encoding of it is one byte string
    parsed = [pb.CapabilityResponse.FromString(data) for data in (forward, backward)]
    assert parsed[0] == parsed[1] and dict(parsed[0].labels) == labels
    assert parsed[0].SerializeToString(deterministic=True) == parsed[1].SerializeToString(deterministic=True)


def _label_keys(data: bytes) -> list[str]:
    """The label keys in the order their entries appear in ``data`` (no key occurs elsewhere in it)."""
    return sorted(["zone", "gpu", "rack"], key=lambda key: data.index(key.encode()))


def _descriptor(name: str) -> Descriptor:
    return FILE.message_types_by_name[name]


def test_message_type_names_cover_the_seed() -> None:
    from iop_wire.messages import MESSAGE_TYPES

    seed = {
        "run.request",
        "run.event",
        "heartbeat",
        "cancel.request",
        "capability.request",
        "capability.response",
        "error",
    }
    assert seed <= set(MESSAGE_TYPES.values())
    assert {"node.register", "node.registered", "node.status", "node.drain"} <= set(MESSAGE_TYPES.values())
    admin = {"nodes.list", "nodes.listed", "nodes.drain", "nodes.undrain", "operation.done"}
    admin |= {"policy.apply", "policy.applied", "policy.show", "policy.shown"}
    assert admin <= set(MESSAGE_TYPES.values())
    assert len(MESSAGE_TYPES) == len(_descriptor("Envelope").oneofs_by_name["body"].fields)
