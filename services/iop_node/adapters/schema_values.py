"""A JSON value made from a JSON schema, deterministically: the mock adapter's tool-call arguments
and structured answers (``response_format``).

The value follows the schema's types, ``enum``/``const``, ``properties`` (every one, required or
not), ``items`` with ``minItems``/``maxItems``, numeric bounds and a few string formats; ``anyOf``
and ``oneOf`` take their first branch, ``allOf`` merges object branches, local ``$ref``s
(``#/$defs/...``, ``#/definitions/...``) resolve. A schema is a client's input: the value is
bounded (:data:`MAX_DEPTH` levels, :data:`MAX_VALUES` values in all), past which it is ``null``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_VALUES", "value_for"]

MAX_DEPTH = 12
"""Nesting followed (a recursive ``$ref`` stops here)."""
MAX_VALUES = 512
"""Values made in all (objects, arrays and scalars), whatever the schema asks."""
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


def value_for(schema: Any, rng: random.Random, words: Sequence[str]) -> Any:
    """A value valid for ``schema`` as far as the rules above go; the same for the same ``rng`` state."""
    return _Maker(schema, rng, words).make(schema, 0)


class _Maker:
    __slots__ = ("budget", "rng", "root", "words")

    def __init__(self, root: Any, rng: random.Random, words: Sequence[str]) -> None:
        self.root, self.rng, self.words = root, rng, words
        self.budget = MAX_VALUES

    def make(self, schema: Any, depth: int) -> Any:  # noqa: PLR0911 - one return a schema keyword
        if not isinstance(schema, dict) or depth > MAX_DEPTH or self.budget <= 0:
            return None
        self.budget -= 1
        if isinstance(ref := schema.get("$ref"), str):
            return self.make(self._resolve(ref), depth + 1)
        if "const" in schema:
            return schema["const"]
        if isinstance(choices := schema.get("enum"), list) and choices:
            return self.rng.choice(choices)
        for key in ("anyOf", "oneOf"):
            if isinstance(branches := schema.get(key), list) and branches:
                return self.make(branches[0], depth + 1)
        if isinstance(parts := schema.get("allOf"), list) and parts:
            merged: dict[str, Any] = {}
            for part in parts:
                value = self.make(part, depth + 1)
                if not isinstance(value, dict):
                    return value
                merged.update(value)
            return merged
        return self._typed(schema, _kind(schema), depth)

    def _typed(self, schema: dict[str, Any], kind: str, depth: int) -> Any:  # noqa: PLR0911 - one return a type
        rng = self.rng
        if kind == "object":
            properties = schema.get("properties")
            if not isinstance(properties, dict):
                return {}
            return {str(name): self.make(sub, depth + 1) for name, sub in properties.items() if self.budget > 0}
        if kind == "array":
            low = _int(schema.get("minItems"), 1)
            high = _int(schema.get("maxItems"), max(low, _MAX_ITEMS))
            count = max(0, min(max(low, min(high, _MAX_ITEMS)), high, MAX_VALUES))
            items = schema.get("items", {})
            return [self.make(items, depth + 1) for _ in range(count) if self.budget > 0]
        if kind == "integer":
            low = _int(schema.get("minimum"), 0)
            high = _int(schema.get("maximum"), low + 100)
            return rng.randint(low, high) if low <= high else low
        if kind == "number":
            least = _float(schema.get("minimum"), 0.0)
            most = _float(schema.get("maximum"), least + 100.0)
            return round(rng.uniform(least, most), 2) if least <= most else least
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "null":
            return None
        if isinstance(form := schema.get("format"), str) and form in _FORMATS:
            return _FORMATS[form]
        text = " ".join(rng.choice(self.words) for _ in range(2))
        least = _int(schema.get("minLength"), 0)
        while len(text) < least:
            text += " " + rng.choice(self.words)
        most = _int(schema.get("maxLength"), len(text))
        return text[: max(most, 0)]

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
    if "properties" in schema:
        return "object"
    return "array" if "items" in schema else "string"


def _int(value: Any, default: int) -> int:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and abs(value) < 2**53
    return int(value) if ok else default


def _float(value: Any, default: float) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and abs(value) < 2**53
    return float(value) if ok else default
