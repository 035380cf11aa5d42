"""schema_values: the mock's JSON made from a schema is valid for it (checked with jsonschema), the
same for the same seed, and bounded in time and size whatever a hostile schema asks."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]  # no stubs installed

from iop_node.adapters.schema_values import MAX_CHARS, MAX_DEPTH, MAX_STRING, MAX_VALUES, bounded_value, value_for

WORDS = ("alpha", "beta", "gamma", "delta")


def _valid(schema: dict[str, Any], seed: int = 7) -> Any:
    value = value_for(schema, random.Random(seed), WORDS)
    errors = [error.message for error in Draft202012Validator(schema).iter_errors(value)]
    assert not errors, (value, errors)
    return value


WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "when": {"type": "string", "format": "date-time"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "precise": {"type": "boolean"},
        "place": {"$ref": "#/$defs/place"},
        "note": {"type": ["string", "null"]},
        "kind": {"const": "forecast"},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
    "$defs": {
        "place": {
            "type": "object",
            "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
            "required": ["lat"],
        }
    },
}


def test_a_typical_tool_schema_gets_a_valid_value_the_same_for_the_same_seed() -> None:
    value = _valid(WEATHER)
    assert set(value) == set(WEATHER["properties"]), "every property, required or not"
    assert value == value_for(WEATHER, random.Random(7), WORDS)
    assert any(value_for(WEATHER, random.Random(seed), WORDS) != value for seed in range(8)), "the seed matters"


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "minimum": 0.001, "maximum": 0.002},  # rounding to 2 places left the range
        {"type": "integer", "minimum": 1.5, "maximum": 2.5},  # a fractional minimum was cut down to 1
        {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 5},
        {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.01},
        {"type": "integer", "minimum": 1, "maximum": 20, "multipleOf": 7},
        {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}}, {"required": ["a", "b"]}]},
        {
            "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {"type": "integer", "minimum": 3}}}],
            "$defs": {"base": {"properties": {"a": {"type": "boolean"}}, "required": ["a", "b"]}},
        },
        {"type": "object", "required": ["x"], "additionalProperties": {"type": "integer"}},
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "minItems": 2, "maxItems": 2},
        {"type": "string", "minLength": 30, "maxLength": 31},
        {"type": "string", "maxLength": 0},
        {"type": "array", "maxItems": 0},
        {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        {"oneOf": [{"type": "null"}]},
        {"enum": [1, "two", None]},
        {"type": "object"},
        {},
    ],
)
def test_bounds_and_combinations_are_met(schema: dict[str, Any]) -> None:
    _valid(schema)


TREE = {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"$ref": "#/$defs/n"}}}
"""A binary tree of itself: 2**depth nodes, were the value not bounded."""


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "minLength": 10**9},
        {"type": "string", "minLength": 10**15, "maxLength": 10**15},
        {"type": "array", "minItems": 10**9, "items": {"type": "string", "minLength": 10**6}},
        {"type": "array", "maxItems": 10**12, "minItems": 10**12},
        {"$defs": {"loop": {"$ref": "#/$defs/loop"}}, "$ref": "#/$defs/loop"},
        {"$defs": {"n": TREE}, "$ref": "#/$defs/n"},
        {"allOf": [{"$ref": "#"}]},
        {"type": "object", "properties": {f"p{i}": {"type": "string", "minLength": 4000} for i in range(2000)}},
        {"type": "integer", "minimum": 10**300, "maximum": -(10**300)},
        {"type": "number", "minimum": float("inf")},
        {"type": "integer", "multipleOf": 10**20},
    ],
    ids=[
        "minLength-1e9",
        "lengths-1e15",
        "many-long-items",
        "maxItems-1e12",
        "ref-loop",
        "binary-recursion",
        "allOf-self",
        "wide-long-object",
        "huge-bounds",
        "infinite-bound",
        "huge-multipleOf",
    ],
)
@pytest.mark.timeout(10)  # unbounded, some of these never end: the timeout fails them
def test_hostile_schemas_cost_a_bounded_time_and_size(schema: dict[str, Any]) -> None:
    value = value_for(schema, random.Random(1), WORDS)
    size = len(json.dumps(value))
    assert size < MAX_CHARS + 64 * MAX_VALUES, size  # the strings' budget, and a little for each value's syntax


@pytest.mark.parametrize(
    ("schema", "bound"),
    [
        (WEATHER, ""),
        ({"type": "string", "minLength": MAX_STRING}, ""),
        ({"type": "string", "minLength": MAX_STRING + 1}, "string"),
        ({"type": "array", "minItems": MAX_VALUES + 1}, "items"),
        ({"type": "array", "minItems": 100, "items": {"type": "string", "minLength": MAX_STRING}}, "characters"),
        ({"type": "object", "properties": {str(i): {} for i in range(MAX_VALUES + 1)}}, "values"),
        ({"$defs": {"loop": {"$ref": "#/$defs/loop"}}, "$ref": "#/$defs/loop"}, "depth"),
    ],
)
def test_the_first_bound_that_cut_the_value_is_named(schema: dict[str, Any], bound: str) -> None:
    assert bounded_value(schema, random.Random(1), WORDS)[1] == bound


def test_a_schema_nested_deeper_than_the_bound_is_cut_with_null() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    value = value_for(schema, random.Random(1), WORDS)
    depth = 0
    while isinstance(value, dict):
        value, depth = value["a"], depth + 1
    assert value is None and depth == MAX_DEPTH + 1


def test_one_string_and_all_strings_together_are_bounded() -> None:
    assert len(value_for({"type": "string", "minLength": 10**9}, random.Random(1), WORDS)) == MAX_STRING
    many = {"type": "array", "minItems": 100, "items": {"type": "string", "minLength": MAX_STRING}}
    strings = value_for(many, random.Random(1), WORDS)
    assert sum(map(len, strings)) == MAX_CHARS and strings[-1] == ""


_SCALARS = st.one_of(
    st.fixed_dictionaries({"type": st.just("string")}, optional={"minLength": st.integers(0, 50)}),
    st.fixed_dictionaries(
        {"type": st.just("integer")}, optional={"minimum": st.integers(-50, 0), "maximum": st.integers(1, 50)}
    ),
    st.fixed_dictionaries(
        {"type": st.just("number")},
        optional={"minimum": st.floats(-10, 0), "exclusiveMaximum": st.floats(0.001, 10)},
    ),
    st.fixed_dictionaries({"type": st.just("boolean")}),
    st.fixed_dictionaries({"enum": st.lists(st.integers() | st.text(max_size=5), min_size=1, max_size=4)}),
    st.fixed_dictionaries({"type": st.just("string"), "format": st.sampled_from(["date", "email", "uuid", "uri"])}),
)


def _compound(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    objects = st.dictionaries(st.text("abcxyz", min_size=1, max_size=4), children, max_size=4).flatmap(
        lambda properties: st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.just(properties)},
            optional={"required": st.lists(st.sampled_from(sorted(properties) or ["z"]), unique=True, max_size=3)},
        )
    )
    arrays = st.fixed_dictionaries(
        {"type": st.just("array"), "items": children},
        optional={"minItems": st.integers(0, 4), "maxItems": st.integers(4, 8)},
    )
    return objects | arrays | st.builds(lambda first, other: {"anyOf": [first, other]}, children, children)


@settings(max_examples=200, deadline=None)
@given(st.recursive(_SCALARS, _compound, max_leaves=20), st.integers(0, 2**32))
def test_any_schema_of_the_followed_keywords_gets_a_valid_value(schema: dict[str, Any], seed: int) -> None:
    _valid(schema, seed)


@pytest.mark.timeout(10)  # unbounded, these take minutes to hours: the timeout fails them
def test_an_all_of_referring_to_itself_many_times_is_merged_once_within_the_budget() -> None:
    value, bound = bounded_value({"allOf": [{"$ref": "#"}] * 32}, random.Random(1), WORDS)
    assert bound == "values", (value, bound)
    chain: dict[str, Any] = {f"d{level}": {"allOf": [{"$ref": f"#/$defs/d{level + 1}"}] * 8} for level in range(11)}
    chain["d11"] = {"type": "object", "properties": {"deep": {"type": "integer"}}}
    value, bound = bounded_value({"$defs": chain, "$ref": "#/$defs/d0"}, random.Random(1), WORDS)
    assert bound == "values", "8**11 merges without a budget"


@pytest.mark.timeout(10)  # copying the growing merge per branch took 96 s and 880 MB for this one
def test_merging_many_branches_of_many_names_costs_one_branch() -> None:
    names = [f"p{index}" for index in range(100_000)]
    for branch in ({"required": names}, {"properties": {name: {"type": "string"} for name in names}}):
        schema = {"$defs": {"a": branch}, "allOf": [{"$ref": "#/$defs/a"}] * 500}
        tracemalloc.start()
        try:
            value, bound = bounded_value(schema, random.Random(1), WORDS)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert bound == "values", (value, bound)
        assert peak < 50_000_000, f"{peak} bytes at the peak: the merge copied branch after branch"


def test_const_and_enum_values_count_against_the_characters() -> None:
    schema = {
        "type": "object",
        "properties": {f"p{index:03}": {"$ref": "#/$defs/big"} for index in range(500)},
        "$defs": {"big": {"const": "x" * 100_000}},
    }
    value, bound = bounded_value(schema, random.Random(1), WORDS)
    assert bound == "characters" and len(json.dumps(value)) < MAX_CHARS + 64 * MAX_VALUES
    fits = "y" * 5000
    value, bound = bounded_value(
        {"type": "array", "minItems": 5, "maxItems": 5, "items": {"enum": [fits]}}, random.Random(1), WORDS
    )
    assert value == [fits, fits, fits, None, None] and bound == "characters"


def test_long_property_names_count_against_the_characters() -> None:
    named = {"type": "object", "properties": {"n" * 10_000: {"type": "null"}, "m" * 10_000: {"type": "null"}}}
    value, bound = bounded_value(named, random.Random(1), WORDS)
    assert list(value) == ["m" * 10_000] and bound == "characters"


def test_all_of_merges_required_across_branches() -> None:
    schema = {
        "allOf": [
            {"type": "object", "required": ["a"], "additionalProperties": {"type": "integer"}},
            {"required": ["b"]},
        ],
        "required": ["c"],
    }
    value = _valid(schema)
    assert sorted(value) == ["a", "b", "c"] and all(isinstance(item, int) for item in value.values())


def test_integer_bounds_beyond_two_to_the_53_still_bound() -> None:
    top = 9007199254740999
    for seed in range(20):
        assert (
            top - 100
            <= value_for({"type": "integer", "minimum": top - 100, "maximum": top}, random.Random(seed), WORDS)
            <= top
        )
    assert value_for({"type": "integer", "minimum": 2**60}, random.Random(1), WORDS) >= 2**60
    assert value_for({"type": "number", "maximum": -1e300}, random.Random(1), WORDS) <= -1e300


_OTHER_PROCESS = """
import json, random, sys
from google.protobuf import json_format, struct_pb2
from iop_node.adapters.schema_values import value_for
carried = struct_pb2.Struct()
carried.update(json.loads(sys.argv[1]))
received = struct_pb2.Struct.FromString(carried.SerializeToString())
print(json.dumps(value_for(json_format.MessageToDict(received), random.Random(3), ("alpha", "beta", "gamma"))))
"""


@pytest.mark.slow
def test_the_value_is_the_same_in_every_process_whatever_order_a_struct_gives_the_keys() -> None:
    schema = {
        "type": "object",
        "properties": {name: {"type": "string"} for name in "qwertyuiopasdfgh"}
        | {"n": {"type": "integer"}, "z": {"type": "object", "properties": {k: {"type": "number"} for k in "xyzab"}}},
    }
    outputs = {
        subprocess.run(
            [sys.executable, "-c", _OTHER_PROCESS, json.dumps(schema)], capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)  # two orders of 16 keys are the same once in 16! without sorting
    }
    assert len(outputs) == 1, outputs
    (output,) = outputs
    value = json.loads(output)
    assert list(value) == sorted(value) and list(value["z"]) == sorted(value["z"]), "written in sorted order"
    assert value == value_for(schema, random.Random(3), ("alpha", "beta", "gamma"))
