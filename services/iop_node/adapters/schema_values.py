"""A JSON value made from a JSON schema, deterministically: the mock adapter's tool-call arguments
and structured answers (``response_format``).

The value follows the schema's types, ``enum``/``const``, ``properties`` (every one, required or
not, and any ``required`` name the properties lack), ``items``/``prefixItems`` with
``minItems``/``maxItems``, numeric bounds (exclusive ones and an integer's ``multipleOf`` too),
string lengths and a few string formats; ``anyOf`` and ``oneOf`` take their first branch,
``allOf`` merges its branches into one schema, local ``$ref``s (``#/$defs/...``,
``#/definitions/...``) resolve. ``pattern``, ``not``, ``if``/``then`` and ``uniqueItems`` are not
followed.

A schema is a client's input: the value is bounded (:data:`MAX_DEPTH` levels, :data:`MAX_VALUES`
values and ``allOf`` branches merged, :data:`MAX_STRING` characters a string and :data:`MAX_CHARS`
in all: strings, ``const``/``enum`` values as JSON and property names), past which it is ``null`` (a
string: cut short), whatever the schema asks: ``minLength: 1e9`` costs what ``minLength: 4096``
does, and an ``allOf`` that refers to itself is merged once. :func:`bounded_value` says which bound
bit first, for the caller to log.

An object's properties are drawn and written in sorted order: the schema reaches the mock as a
protobuf Struct, whose key order differs between processes, so the schema's own order is unknown
there and sorting keeps the value the same on every node.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from typing import Any

__all__ = ["MAX_CHARS", "MAX_DEPTH", "MAX_STRING", "MAX_VALUES", "bounded_value", "value_for"]

MAX_DEPTH = 12
"""Nesting followed (a recursive ``$ref`` stops here)."""
MAX_VALUES = 512
"""Values made in all (objects, arrays and scalars), whatever the schema asks."""
MAX_STRING = 4096
"""Characters of one string at most (a larger ``minLength`` is not met)."""
MAX_CHARS = 16384
"""Characters of all strings together at most; past them strings are empty."""
_MAX_ITEMS = 3
"""Items of an array when the schema sets no ``minItems`` above it."""
_FORMATS = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00Z",
    "email": "user@example.com",
    "uri": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
}
_MERGED = ("properties", "$defs", "definitions")
"""Keywords whose objects ``allOf`` branches add up; ``required`` adds up too, the rest are overwritten."""


def value_for(schema: Any, rng: random.Random, words: Sequence[str]) -> Any:
    """A value valid for ``schema`` as far as the rules above go; the same for the same ``rng`` state."""
    return bounded_value(schema, rng, words)[0]


def bounded_value(schema: Any, rng: random.Random, words: Sequence[str]) -> tuple[Any, str]:
    """:func:`value_for`'s value, and the first bound it met ("" for none): ``depth``, ``values``,
    ``items`` (a ``minItems`` above MAX_VALUES), ``string`` (a ``minLength`` above MAX_STRING) or
    ``characters`` (MAX_CHARS)."""
    maker = _Maker(schema, rng, words)
    return maker.make(schema, 0), maker.bound


class _Maker:
    __slots__ = ("bound", "budget", "chars", "merging", "rng", "root", "words")

    def __init__(self, root: Any, rng: random.Random, words: Sequence[str]) -> None:
        self.root, self.rng, self.words = root, rng, words
        self.budget = MAX_VALUES
        self.chars = MAX_CHARS
        self.bound = ""
        self.merging: set[str] = set()
        """The references whose ``allOf`` is being merged higher up (one met again is a cycle: skipped)."""

    def bit(self, bound: str) -> None:
        """Note that ``bound`` cut the value (the first one is kept)."""
        self.bound = self.bound or bound

    def make(self, schema: Any, depth: int) -> Any:  # noqa: PLR0911 - one return a schema keyword
        if not isinstance(schema, dict):
            return None
        if depth > MAX_DEPTH or self.budget <= 0:
            self.bit("depth" if depth > MAX_DEPTH else "values")
            return None
        self.budget -= 1
        if isinstance(ref := schema.get("$ref"), str):
            return self.make(self._resolve(ref), depth + 1)
        if "const" in schema:
            return self._charged(schema["const"])
        if isinstance(choices := schema.get("enum"), list) and choices:
            return self._charged(self.rng.choice(choices))
        for key in ("anyOf", "oneOf"):
            if isinstance(branches := schema.get(key), list) and branches:
                return self.make(branches[0], depth + 1)
        if isinstance(schema.get("allOf"), list):
            return self.make(self._merged(schema, depth), depth + 1)
        return self._typed(schema, _kind(schema), depth)

    def _charged(self, value: Any) -> Any:
        """A ``const`` or ``enum`` value, its JSON charged to the characters left; None past them (a
        large constant referred to many times is as many copies in the text)."""
        size = len(json.dumps(value))
        if size > self.chars:
            self.bit("characters")
            return None
        self.chars -= size
        return value

    def _merged(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        """``schema`` and its ``allOf`` branches (theirs merged first, references resolved) as one schema.

        Each branch visited costs a value of the budget, and a reference already being merged higher up
        is skipped: ``{"allOf": [{"$ref": "#"}] * b}`` would otherwise cost ~b**MAX_DEPTH merges. Each
        property or required name merged costs one too, and merging copies a branch's entries once
        (into the merged schema's own dict or list), so 500 branches naming 100,000 required
        properties cost one branch's worth, not 500 copies of a growing list."""
        merged = {key: value for key, value in schema.items() if key != "allOf"}
        own: set[str] = set()
        """Keys whose dict or list in ``merged`` is this merge's copy (extended in place)."""
        for branch in schema["allOf"]:
            if self.budget <= 0:
                self.bit("values")
                break
            self.budget -= 1
            part, level, refs = branch, depth, []
            while isinstance(part, dict) and isinstance(part.get("$ref"), str) and level <= MAX_DEPTH:
                refs.append(part["$ref"])
                part, level = self._resolve(part["$ref"]), level + 1
            if any(ref in self.merging for ref in refs):
                continue  # a cycle: this schema is already being merged
            if isinstance(part, dict) and isinstance(part.get("allOf"), list) and level <= MAX_DEPTH:
                self.merging.update(refs)
                try:
                    part = self._merged(part, level + 1)
                finally:
                    self.merging.difference_update(refs)
            if isinstance(part, dict):
                self._merge_into(merged, own, part)
        return merged

    def _merge_into(self, merged: dict[str, Any], own: set[str], part: dict[str, Any]) -> None:
        """``part``'s keys into ``merged``: properties (and definitions) joined, required names added,
        the rest replaced; each name joined costs a value of the budget."""
        for key, value in part.items():
            joined = key in _MERGED and isinstance(value, dict) and isinstance(merged.get(key), dict)
            if joined or (key == "required" and isinstance(value, list) and isinstance(merged.get(key), list)):
                self.budget -= len(value)
                if key not in own:
                    merged[key] = (dict if joined else list)(merged[key])
                    own.add(key)
                if joined:
                    merged[key].update(value)
                else:
                    merged[key].extend(value)
            else:
                merged[key] = value
                own.discard(key)

    def _typed(self, schema: dict[str, Any], kind: str, depth: int) -> Any:  # noqa: PLR0911 - one return a type
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            return self._number(schema)
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        return self._string(schema)

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        value: dict[str, Any] = {}
        for name in sorted(properties, key=str):  # drawn in an order every process agrees on (see the module)
            if self.budget <= 0 or not self._named(str(name)):
                break
            value[str(name)] = self.make(properties[name], depth + 1)
        if len(value) < len(properties):
            self.bit("values" if self.budget <= 0 else "characters")
        required = schema.get("required")
        extra = schema.get("additionalProperties")
        for name in required if isinstance(required, list) else ():
            if self.budget <= 0:
                break
            if isinstance(name, str) and name not in value and self._named(name):
                value[name] = self.make(extra if isinstance(extra, dict) else {"type": "string"}, depth + 1)
        return dict(sorted(value.items()))

    def _named(self, name: str) -> bool:
        """Whether the property ``name`` fits in the characters left (charged to them if it does)."""
        if len(name) > self.chars:
            self.bit("characters")
            return False
        self.chars -= len(name)
        return True

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        low = _int(schema.get("minItems"), 1)
        high = _int(schema.get("maxItems"), max(low, _MAX_ITEMS))
        count = max(0, min(max(low, min(high, _MAX_ITEMS)), high, MAX_VALUES))
        if count < min(low, high):
            self.bit("items")
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items = schema.get("items", {})
        value = []
        for index in range(count):
            if self.budget <= 0:
                self.bit("values")
                break
            value.append(self.make(prefix[index] if index < len(prefix) else items, depth + 1))
        return value

    def _integer(self, schema: dict[str, Any]) -> int:
        least, above = _bound(schema.get("minimum")), _bound(schema.get("exclusiveMinimum"))
        most, below = _bound(schema.get("maximum")), _bound(schema.get("exclusiveMaximum"))
        lows = [math.ceil(least)] if least is not None else []
        lows += [math.floor(above) + 1] if above is not None else []
        highs = [math.floor(most)] if most is not None else []
        highs += [math.ceil(below) - 1] if below is not None else []
        high = min(highs) if highs else None
        low = max(lows) if lows else _floor_below(high)
        high = low + 100 if high is None else high
        step = _int(schema.get("multipleOf"), 1)
        if step > 1:  # the multiples of step in [low, high], if any
            first, last = -(-low // step), high // step
            return self.rng.randint(first, last) * step if first <= last else first * step
        return self.rng.randint(low, high) if low <= high else low

    def _number(self, schema: dict[str, Any]) -> float:
        least, above = _bound(schema.get("minimum")), _bound(schema.get("exclusiveMinimum"))
        most, below = _bound(schema.get("maximum")), _bound(schema.get("exclusiveMaximum"))
        highest = min((bound for bound in (most, below) if bound is not None), default=None)
        low = max((bound for bound in (least, above) if bound is not None), default=_floor_below(highest))
        high = low + 100.0 if highest is None else highest
        if low > high:
            return low
        value = round(self.rng.uniform(low, high), 2)
        if not low <= value <= high or value in (above, below):  # rounded out of a narrow range
            value = (low + high) / 2
        return value

    def _string(self, schema: dict[str, Any]) -> str:
        if isinstance(form := schema.get("format"), str) and form in _FORMATS:
            return _FORMATS[form]
        wanted = _int(schema.get("minLength"), 0)
        if wanted > MAX_STRING:
            self.bit("string")
        least = min(wanted, MAX_STRING)
        most = min(_int(schema.get("maxLength"), MAX_STRING), MAX_STRING)
        words = [self.rng.choice(self.words) for _ in range(2)]
        size = len(words[0]) + len(words[1]) + 1
        while size < least:  # bounded: least <= MAX_STRING
            words.append(self.rng.choice(self.words))
            size += len(words[-1]) + 1
        text = " ".join(words)[: max(most, 0)]
        if len(text) > self.chars:
            self.bit("characters")
            text = text[: self.chars]
        self.chars -= len(text)
        return text

    def _resolve(self, ref: str) -> Any:
        """A local reference (``#/a/b``) in the root schema; None for any other."""
        if not ref.startswith("#"):
            return None
        node: Any = self.root
        for part in filter(None, ref[1:].split("/")):
            key = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node


def _kind(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        named = [item for item in kind if isinstance(item, str) and item != "null"]
        return named[0] if named else "null"
    if isinstance(kind, str):
        return kind
    if "properties" in schema or "required" in schema:
        return "object"
    return "array" if "items" in schema or "prefixItems" in schema else "string"


def _floor_below(high: Any) -> Any:
    """The low end of a range with no lower bound: 0, or 100 below a negative upper bound."""
    return 0 if high is None or high >= 0 else high - 100


def _int(value: Any, default: int) -> int:
    found = _bound(value)
    return default if found is None else int(found)


def _bound(value: Any) -> int | float | None:
    """``value`` when it is a finite number a schema may bound with (not a bool), as given: an int stays
    exact however large (``maximum: 9007199254740999`` is not rounded up past itself); else None."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None
