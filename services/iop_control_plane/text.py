"""Bounds on the strings peers send that the control-plane keeps, logs or sends back.

A requester names a model, a caller and a run id, a node sends error messages, a requester a
cancel reason: each may be of any length up to the frame limit. A run whose names are over
:data:`NAME_CHARS` is refused (INVALID_ARGUMENT) without echoing them whole, and every string
the ledger stores is clipped (:func:`clip`), so a row stays a few KB whatever the peers send.
"""

from __future__ import annotations

__all__ = ["NAME_CHARS", "TEXT_CHARS", "clip"]

NAME_CHARS = 256
"""Most characters of a name (model, caller, run id, node id) kept, logged or echoed."""
TEXT_CHARS = 4096
"""Most characters of a free text (an error message, a cancel reason) kept."""
_MARK = "…[{} more]"


def clip(text: str, limit: int = NAME_CHARS) -> str:
    """``text``, or its first ``limit`` characters and a marker saying how many more there were."""
    if len(text) <= limit:
        return text
    return text[:limit] + _MARK.format(len(text) - limit)
