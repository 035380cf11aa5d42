"""Raw server-sent events from the edge, each ``data:`` chunk validated against OpenAI's schema."""

from __future__ import annotations

import json
from typing import Any

import httpx2 as httpx

from .openai_schema import validate


def events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a streamed response, in order (``[DONE]`` included)."""
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), f"not an SSE data line in {lines}"
    return [line.removeprefix("data: ") for line in lines]


def chunks(payloads: list[str], schema: str) -> list[dict[str, Any]]:
    """The JSON chunks before ``[DONE]`` (which must end the stream), each a valid ``schema``."""
    assert payloads and payloads[-1] == "[DONE]", f"the stream does not end with [DONE]: {payloads[-3:]}"
    parsed = [json.loads(payload) for payload in payloads[:-1]]
    for chunk in parsed:
        validate(schema, chunk)
    return parsed
