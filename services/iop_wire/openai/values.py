"""Every value of a request body checked before any field is read: how deep it nests, that its
strings can be sent (UTF-8: no lone surrogate such as ``\\ud800``) and its numbers are finite.

``json.loads`` accepts all three (``NaN``, ``"\\ud800"``, and nesting until Python's recursion
limit), but none can become a run: protobuf refuses to encode a lone surrogate, and its decoder
(upb, 100 message levels) refuses a ``Struct`` nested over ~33 JSON levels inside an envelope,
so the run would fail somewhere downstream, or be retried forever, instead of being a 400 naming
the field here.
"""

from __future__ import annotations

import math
import re
from typing import Any

from iop_wire.openai.errors import ApiError

__all__ = ["MAX_DEPTH", "check_values", "too_deep"]

MAX_DEPTH = 32
"""Deepest nesting of a body (the body itself is level 1): what one run.request carries on the
wire with a level to spare. A tool's JSON Schema nested 10 objects deep takes 24."""


def check_values(data: dict[str, Any]) -> None:
    """400 naming the first value (``messages[0].content``) nested too deep, unencodable or not finite."""
    for name, value in data.items():
        _check(value, _key(name, ""), 2)


def _check(value: Any, where: str, depth: int) -> None:
    if isinstance(value, str):
        if not value.isascii():
            _encodable(value, where)
    elif isinstance(value, dict):
        _nested(where, depth)
        for name, item in value.items():
            _check(item, _key(name, where), depth + 1)
    elif isinstance(value, list):
        _nested(where, depth)
        for index, item in enumerate(value):
            _check(item, f"{where}[{index}]", depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        message = f"Invalid value for '{where}': {value} is not a JSON number (NaN and Infinity are not)."
        raise ApiError(400, message, param=where, code="invalid_value")


def _key(name: str, where: str) -> str:
    _encodable(name, where or "body")
    shown = name if len(name) <= 64 else name[:61] + "..."
    return f"{where}.{shown}" if where else shown


def _encodable(text: str, where: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        message = (
            f"Invalid value for '{where}': it holds a lone surrogate ({text[exc.start]!a}) at character "
            f"{exc.start}, which is not valid Unicode text."
        )
        raise ApiError(400, message, param=where, code="invalid_value") from None


def _nested(where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        message = f"'{where}' is nested over {MAX_DEPTH} levels deep, more than this server takes."
        raise ApiError(400, message, param=where, code="invalid_value")


_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:]')
"""A JSON text's strings (skipped whole) and the characters that open, close or key its levels."""


def too_deep(body: bytes) -> ApiError:
    """400 for a body too deep for the JSON parser itself, naming the top-level field that nests too deep."""
    field, depth, last_string = None, 0, b""
    for token in _TOKENS.finditer(body):
        text = token.group()
        if text in {b"[", b"{"}:
            depth += 1
            if depth > MAX_DEPTH:
                break
        elif text in {b"]", b"}"}:
            depth -= 1
        elif text == b":" and depth == 1:
            field = last_string[1:-1].decode(errors="replace")[:64]
        else:
            last_string = text
    message = f"'{field or 'body'}' is nested over {MAX_DEPTH} levels deep, more than this server takes."
    return ApiError(400, message, param=field, code="invalid_value")
