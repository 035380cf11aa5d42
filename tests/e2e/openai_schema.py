"""OpenAI's official response schemas (../shared/openai/openapi.json), as jsonschema validators.

The document is read where it is, never copied into the project; where it is absent, every
validation skips its test with the reason. OpenAPI 3.1 is JSON Schema 2020-12 except for the
OpenAPI 3.0 ``nullable: true`` the document still carries in places: those schemas are rewritten
to also accept null. ``x-*`` keys and ``discriminator`` are annotations jsonschema ignores.

The document has no schema for the chunks of a streamed text completion (``/completions`` lists
only ``application/json``); OpenAI streams them as ``CreateCompletionResponse`` objects whose
``finish_reason`` is null until the last. :data:`COMPLETION_CHUNK` is that schema with exactly
this one difference, derived from the document here (nothing else is relaxed).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]  # no stubs installed
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

__all__ = ["COMPLETION_CHUNK", "SPEC", "arguments_valid", "validate"]

SPEC = Path(__file__).resolve().parents[2].parent / "shared" / "openai" / "openapi.json"
_BASE = "urn:openai:openapi"
COMPLETION_CHUNK = "CreateCompletionResponse (stream chunk)"
"""CreateCompletionResponse with a null ``choices[].finish_reason`` allowed, as OpenAI streams it."""


def _nullable(node: Any) -> Any:
    """``node`` with every OpenAPI 3.0 ``nullable: true`` schema turned into ``anyOf [schema, null]``."""
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted = {key: _nullable(value) for key, value in node.items() if not key.startswith("x-")}
    if converted.pop("nullable", None) is True:
        return {"anyOf": [converted, {"type": "null"}]}
    return converted


@functools.cache
def _registry() -> Registry | None:
    if not SPEC.is_file():
        return None
    document = _nullable(json.loads(SPEC.read_text()))
    schemas = document["components"]["schemas"]
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    choice = chunk["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    schemas[COMPLETION_CHUNK] = chunk
    resource: Resource[Any] = Resource.from_contents(document, default_specification=DRAFT202012)
    registry: Registry[Any] = Registry().with_resource(_BASE, resource)
    return registry


@functools.cache
def _validator(name: str) -> Draft202012Validator:
    registry = _registry()
    assert registry is not None
    contents = registry.contents(_BASE)
    assert name in contents["components"]["schemas"], f"{name} is not a schema of {SPEC}"
    return Draft202012Validator({"$ref": f"{_BASE}#/components/schemas/{quote(name)}"}, registry=registry)


def validate(name: str, instance: Any) -> None:
    """Fail the test unless ``instance`` is a valid ``name`` (a components/schemas entry); skip without the spec."""
    if _registry() is None:
        pytest.skip(f"OpenAI's schemas are not at {SPEC} (../shared is absent): nothing to validate against")
    errors = sorted(_validator(name).iter_errors(instance), key=lambda error: list(error.absolute_path))
    if errors:
        shown = "\n".join(f"  at {list(e.absolute_path)}: {e.message[:300]}" for e in errors[:5])
        pytest.fail(f"not a valid {name}:\n{shown}\ninstance: {json.dumps(instance)[:1500]}")


def arguments_valid(arguments: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A tool call's ``arguments`` (JSON text) parsed, failing the test unless it is an object valid for
    ``schema`` (the tool's parameters)."""
    value = json.loads(arguments)
    errors = [error.message for error in Draft202012Validator(schema).iter_errors(value)]
    assert not errors, (value, errors)
    assert isinstance(value, dict)
    return value
