"""Work a cancel must not cut in half: starting a program, and stopping it.

Cancelled after the fork, ``create_subprocess_exec`` kills the program alone and waits for the
pipes its children hold open. :func:`started` lets the start go on to its end instead, stops what
it started, and passes the cancel on. The cli adapter stops a program gracefully (SIGTERM, then
SIGKILL after its grace); the engines kill their servers' groups at once: each gives its own stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def to_the_end(work: Awaitable[T]) -> T:
    """``work``'s result, awaited to its end even if this task is cancelled meanwhile; then the cancel passes on."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


async def started(start: Awaitable[T], stop: Callable[[T], Awaitable[None]]) -> T:
    """``start``'s result. Cancelled while it runs, the start goes on to its end, what it started
    is stopped with ``stop`` (to its end too), and the cancel passes on; a start that failed
    meanwhile started nothing to stop."""
    starting = asyncio.ensure_future(start)
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        await to_the_end(_stop_once_started(starting, stop))
        raise


async def _stop_once_started(starting: asyncio.Future[T], stop: Callable[[T], Awaitable[None]]) -> None:
    try:
        result = await starting
    except Exception:  # noqa: BLE001 - it failed to start: nothing runs, and the cancel is what the caller meets
        return
    await stop(result)
