"""The worker's background parts kept alive: a failure is logged, counted and followed by a growing pause.

The engine's step, its lease renewal and the upload sweep each call the store on a timer. The
store can fail in many ways besides OSError (SQLite's "database is locked", asyncpg's lost
connection, a bug): :func:`repeat` catches them all, counts them in
``iop_worker_part_failures_total{part}``, logs one line per failure (the growing pause bounds
the rate: at most one line per pause, and the pause doubles up to :data:`MAX_PAUSE`) and goes on.
What still ends a part (a bug in the loop itself) ends the worker: :func:`first_failure` is how
``main`` waits on its parts, so nothing is ever silently gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

import structlog
from prometheus_client import Counter

__all__ = ["MAX_PAUSE", "first_failure", "repeat"]

_log = structlog.get_logger("iop.worker")
FIRST_PAUSE = 0.5
"""Seconds after a part's first failure in a row."""
MAX_PAUSE = 30.0
"""Seconds: the longest pause after failures in a row (the store may be down for minutes)."""


async def repeat(
    part: str, once: Callable[[], Awaitable[object]], wait: Callable[[], Awaitable[object]], failures: Counter
) -> None:
    """``once()`` then ``wait()``, forever; a failure of ``once`` is logged, counted, and paused after."""
    pause = 0.0
    while True:
        try:
            await once()
        except Exception as exc:  # noqa: BLE001 - any store or driver error: the part goes on after a pause
            failures.labels(part).inc()
            pause = min(max(pause * 2, FIRST_PAUSE), MAX_PAUSE)
            _log.warning("worker part failed", part=part, error=repr(exc), retry_in=pause)
            await asyncio.sleep(pause)
        else:
            pause = 0.0
        await wait()


async def first_failure(stop: Awaitable[object], parts: Iterable[asyncio.Task[None]]) -> asyncio.Task[None] | None:
    """Wait for ``stop`` or for one of ``parts`` to end (it should not); the part that ended, or None."""
    stopping = asyncio.ensure_future(stop)
    watched = set(parts)
    try:
        done, _ = await asyncio.wait({stopping, *watched}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    for part in watched:
        if part in done:
            error = None if part.cancelled() else part.exception()
            _log.error("worker part ended: stopping the worker", part=part.get_name(), error=repr(error))
            return part
    return None
