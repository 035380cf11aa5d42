"""Helpers for the Files and Batch tests: a stack whose edge reaches its worker, and JSONL uploads."""

from __future__ import annotations

import io
import json
from typing import Any

import openai

from .conftest import Stack, wait_for


def worker_reachable(stack: Stack) -> Stack:
    """``stack`` once its edge answers a Files request (the edge dials the worker after it is ready)."""
    http = stack.http()
    wait_for(lambda: http.get("/files").status_code == 200, 15.0, 0.05, "the edge reaching its worker")
    return stack


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def upload(client: openai.OpenAI, data: bytes, name: str = "input.jsonl") -> str:
    """The id of ``data`` uploaded with purpose batch."""
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch").id
