"""The Files and Batch API's rules, in one place for the edge, the worker and the CLI.

What a batch may run (:data:`ENDPOINTS`), how long it may take (:func:`window_seconds`: OpenAI
has only ``24h``; IOP also takes other durations, and the edge and the worker once disagreed on
``1d``, which both now take), what files are for (:data:`PURPOSES`, :data:`OUTPUT_PURPOSE`),
how long a page may be (:data:`FILES_PAGE`, :data:`BATCHES_PAGE`, :func:`page_limit`) and the
statuses' OpenAI names (:data:`STATUS_NAMES`, :data:`ENDED`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = [
    "BATCHES_PAGE",
    "DEFAULT_WINDOW",
    "ENDED",
    "ENDPOINTS",
    "FILES_PAGE",
    "OUTPUT_PURPOSE",
    "PURPOSES",
    "STATUS_CODES",
    "STATUS_NAMES",
    "Page",
    "page_limit",
    "window_seconds",
]

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
"""Endpoints a batch's lines may go to: the ones IOP serves."""
PURPOSES = ("batch",)
"""Purposes an upload may have: files for the Batch API."""
OUTPUT_PURPOSE = "batch_output"
"""The purpose of the output and error files the worker writes (not a batch's input)."""
DEFAULT_WINDOW = "24h"
_WINDOW = re.compile(r"([1-9][0-9]{0,5})([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}

STATUS_NAMES: dict[pb.BatchStatus.ValueType, str] = {
    pb.BATCH_STATUS_VALIDATING: "validating",
    pb.BATCH_STATUS_FAILED: "failed",
    pb.BATCH_STATUS_IN_PROGRESS: "in_progress",
    pb.BATCH_STATUS_FINALIZING: "finalizing",
    pb.BATCH_STATUS_COMPLETED: "completed",
    pb.BATCH_STATUS_EXPIRED: "expired",
    pb.BATCH_STATUS_CANCELLING: "cancelling",
    pb.BATCH_STATUS_CANCELLED: "cancelled",
}
"""A batch status's OpenAI name."""
STATUS_CODES: dict[str, pb.BatchStatus.ValueType] = {name: code for code, name in STATUS_NAMES.items()}
ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
"""The statuses a batch ends in."""


class Page(NamedTuple):
    """A list's ``limit``: its default and its cap."""

    default: int
    maximum: int


FILES_PAGE = Page(10_000, 10_000)
BATCHES_PAGE = Page(20, 100)


def window_seconds(window: str) -> int:
    """Seconds of a completion window (``24h``, ``1d``, ``30m``, ``90s``); ValueError saying what is taken."""
    match = _WINDOW.fullmatch(window)
    if match is None:
        raise ValueError(
            f"Invalid value: '{window[:40]}'. Supported values are: '24h' (or a duration: 30s, 10m, 2h, 1d)."
        )
    return int(match[1]) * _UNIT[match[2]]


def page_limit(value: str | None, page: Page) -> int:
    """A list's ``limit`` query parameter; ValueError unless a whole number (ASCII digits) from 1 to the cap.

    ``str.isdigit`` alone takes ``²`` and 4,300-digit numbers, which ``int`` then refuses.
    """
    if value is None:
        return page.default
    if not (value.isascii() and value.isdigit() and len(value) <= len(str(page.maximum))):
        raise ValueError(f"limit must be a whole number from 1 to {page.maximum}, not '{value[:40]}'")
    limit = int(value)
    if not 1 <= limit <= page.maximum:
        raise ValueError(f"limit must be a whole number from 1 to {page.maximum}, not '{value}'")
    return limit
