"""The console's live stream (``GET /console/api/live``): one poller per edge, fanned out to every watcher.

The first watcher starts the poller; it asks the control-plane every ``console.push_interval``
seconds (overview and nodes while an admin watches; today's usage by caller while a non-admin
does) and offers each watcher its events; the last watcher to leave stops it. So the
control-plane's load is one poll per edge, whatever the number of watchers.

Bounds: at most ``console.max_watchers`` watchers, and ``console.max_watchers_per_key`` of one
key (more get 429, counted, logged at most once a minute). Each tick re-checks every watcher's
key: a revoked key's stream ends, a key whose admin flag changed gets what it now may see. When
the edge stops, every stream is ended first (:meth:`LiveHub.end_all`), so the server's graceful
shutdown does not wait on them. A watcher holds at most :data:`QUEUED` messages; a new one replaces the oldest (the
latest wins), and a watcher that has taken none for :data:`STALL_TICKS` pushes in a row is
dropped (its stream closed, counted): a client that stops reading costs a bounded queue for
a bounded time, and never holds up the others. Every stream is renewed after :data:`RENEW_SECONDS`
(a ``reconnect`` event, then its end): a client whose kernel buffers hide that it stopped reading
holds its slot no longer. The last slots are kept for admin keys. A tick with nothing for a watcher (the
control-plane away) sends it an SSE comment line instead, so proxies keep the stream open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from iop_edge.metrics import EdgeMetrics
from iop_wire.openai.errors import ApiError

__all__ = ["QUEUED", "RENEW_SECONDS", "STALL_TICKS", "LiveHub", "LiveStream", "Snapshot", "Watcher", "sse_event"]

_log = structlog.get_logger("iop.edge.console")

QUEUED = 2
"""Messages a watcher may have waiting; a newer one replaces the oldest."""
STALL_TICKS = 5
"""Pushes in a row a watcher may leave untaken (its queue full) before it is dropped."""
RENEW_SECONDS = 600.0
"""How long one stream lasts at most (8 to 10 minutes): then it ends with a ``reconnect`` event and
the page opens a new one at once. A client that stops reading is only found out once its socket's
buffers are full, and the kernel's take megabytes: hours of pushes at a few hundred bytes a second.
This bounds the slot it holds to ten minutes whatever the buffers."""
_LOG_EVERY = 60.0
"""Seconds between two log lines about refused watchers."""


def sse_event(event: str, data: Any) -> bytes:
    """One server-sent event: ``event: NAME`` and its JSON ``data`` line."""
    return b"event: " + event.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


@dataclass(slots=True)
class Snapshot:
    """What one poll found: the admin events, and today's usage per caller (None: not asked or failed)."""

    admin: bytes | None = None
    """The ``overview`` and ``nodes`` events, encoded once for every admin watcher."""
    usage: Callable[[str], bytes] | None = None
    """The ``usage`` event of one caller."""
    trouble: str = ""
    """Why a part is missing (the control-plane did not answer), for the comment line."""


@dataclass(eq=False, slots=True)
class Watcher:
    """One open live stream: whose it is, and its bounded queue."""

    caller: str
    admin: bool
    queue: deque[bytes] = field(default_factory=lambda: deque(maxlen=QUEUED))
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    untaken: int = 0
    """Pushes in a row that met a full queue."""
    dropped: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the hub drops it: its stream is closed, even mid-write."""
    recheck: Recheck | None = None
    """Its key looked up again at each tick (None: nothing to re-check, keys are off)."""
    renew_at: float = field(default_factory=lambda: time.monotonic() + RENEW_SECONDS * random.uniform(0.8, 1.0))  # noqa: S311 - jitter
    """When it is renewed: :data:`RENEW_SECONDS` after it joined, less up to a fifth (streams opened
    together, every page after an edge's restart, do not all reconnect in the same tick)."""
    renewed: bool = False
    """Ended for renewal: its stream's last event tells the page to reconnect at once."""

    def offer(self, message: bytes) -> bool:
        """Queue ``message`` (the oldest goes when full); False once the watcher should be dropped."""
        if len(self.queue) == QUEUED:
            self.untaken += 1
            if self.untaken >= STALL_TICKS:
                self.dropped.set()
                return False
        else:
            self.untaken = 0
        self.queue.append(message)
        self.ready.set()
        return True

    async def messages(self) -> AsyncIterator[bytes]:
        """The messages as they come (forever: the stream's end is the client's or the hub's doing)."""
        while True:
            await self.ready.wait()
            self.ready.clear()
            while self.queue:
                yield self.queue.popleft()


Recheck = Callable[[], bool | None]
"""A watcher's key looked up again: whether it is an admin now, None once it is revoked."""
Poll = Callable[[bool, bool], Awaitable[Snapshot]]
"""Asks the control-plane: (admins watch, non-admins watch) -> what to push."""


class LiveHub:
    """The watchers of one edge and the poller that feeds them."""

    def __init__(
        self, poll: Poll, *, interval: float, max_watchers: int, metrics: EdgeMetrics, max_per_key: int | None = None
    ) -> None:
        self._poll, self.interval, self.max_watchers, self.metrics = poll, interval, max_watchers, metrics
        self.max_per_key = max_watchers if max_per_key is None else max_per_key
        self.watchers: set[Watcher] = set()
        self.stopping = False
        self._task: asyncio.Task[None] | None = None
        self._refused_logged = 0.0
        self._refused_since = 0

    def join(self, caller: str, *, admin: bool, recheck: Recheck | None = None) -> Watcher:
        """A new watcher; 429 once ``max_watchers`` are open, or ``max_per_key`` of this caller's (keys on);
        503 while the edge stops. Starts the poller for the first."""
        if self.stopping:
            raise ApiError(503, "this edge is stopping; reconnect to another", retry_after=1.0)
        # With keys off (no recheck: auth none) every watcher is `anonymous`: only the edge's bound holds.
        mine = sum(1 for watcher in self.watchers if watcher.caller == caller) if recheck is not None else 0
        # Keys that are not admin share the slots but the last ones: enough for one admin key's streams,
        # so a crowd of plain keys cannot lock the operators out of their own console.
        room = self.max_watchers if admin else self.max_watchers - min(self.max_per_key, self.max_watchers // 2)
        if len(self.watchers) >= room or mine >= self.max_per_key:
            self.metrics.watchers_refused.inc()
            self._log_refusal(caller)
            if mine >= self.max_per_key:
                message = f"key {caller!r} has {mine} live streams open, its limit (console.max_watchers_per_key)"
            elif admin:
                message = f"this edge has {len(self.watchers)} live streams open, its limit (console.max_watchers)"
            else:
                message = (
                    f"this edge has {len(self.watchers)} live streams open: the rest of console.max_watchers"
                    " is kept for admin keys"
                )
            raise ApiError(429, message, code="too_many_requests", retry_after=self.interval * 5)
        watcher = Watcher(caller, admin, recheck=recheck)
        self.watchers.add(watcher)
        self.metrics.watchers.set(len(self.watchers))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="iop-edge-console-live")
        return watcher

    def leave(self, watcher: Watcher) -> None:
        """The watcher's stream ended; the poller stops with the last one (at its next tick)."""
        self.watchers.discard(watcher)
        self.metrics.watchers.set(len(self.watchers))

    def end_all(self) -> None:
        """End every stream and take no more (the edge is stopping: its graceful shutdown must not
        wait on streams that never end by themselves)."""
        self.stopping = True
        for watcher in list(self.watchers):
            watcher.dropped.set()
            self.leave(watcher)

    async def aclose(self) -> None:
        """Stop the poller (the edge is stopping)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _log_refusal(self, caller: str) -> None:
        self._refused_since += 1
        now = time.monotonic()
        if now - self._refused_logged >= _LOG_EVERY:
            _log.warning(
                "console live streams refused",
                limit=self.max_watchers,
                per_key=self.max_per_key,
                caller=caller,
                refused=self._refused_since,
            )
            self._refused_logged, self._refused_since = now, 0

    async def _run(self) -> None:
        while self.watchers:
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - a bug in one poll must not leave every watcher without pushes
                _log.exception("console live poll failed: polling on")
            await asyncio.sleep(self.interval)

    async def tick(self) -> None:
        """One poll, offered to every watcher; those that stopped reading are dropped, those whose
        key was revoked ended."""
        watchers = [w for w in list(self.watchers) if self._still_allowed(w) and not self._renewed(w)]
        snapshot = await self._poll(any(w.admin for w in watchers), any(not w.admin for w in watchers))
        for watcher in watchers:
            if not watcher.offer(self._message(watcher, snapshot)):
                self.metrics.watchers_dropped.inc()
                _log.info("console live stream dropped: its client stopped reading", caller=watcher.caller)
                self.leave(watcher)

    def _renewed(self, watcher: Watcher) -> bool:
        """End a stream open :data:`RENEW_SECONDS` (its page reconnects at once); True if it was."""
        if time.monotonic() < watcher.renew_at:
            return False
        self.metrics.watchers_renewed.inc()
        _log.info("console live stream renewed", caller=watcher.caller)
        watcher.renewed = True
        watcher.dropped.set()
        self.leave(watcher)
        return True

    def _still_allowed(self, watcher: Watcher) -> bool:
        """Re-check the watcher's key: ended (False) once revoked, its scope updated when changed."""
        if watcher.recheck is None:
            return True
        admin = watcher.recheck()
        if admin is None:
            _log.info("console live stream ended: its key was revoked", caller=watcher.caller)
            watcher.dropped.set()
            self.leave(watcher)
            return False
        watcher.admin = admin
        return True

    @staticmethod
    def _message(watcher: Watcher, snapshot: Snapshot) -> bytes:
        if watcher.admin and snapshot.admin is not None:
            return snapshot.admin
        if not watcher.admin and snapshot.usage is not None:
            return snapshot.usage(watcher.caller)
        return b": " + (snapshot.trouble or "nothing new").encode() + b"\n\n"  # a comment keeps proxies open


class LiveStream(Response):
    """The ``text/event-stream`` of one watcher: ends when the client goes away or the hub drops it."""

    media_type = "text/event-stream"

    def __init__(self, hub: LiveHub, watcher: Watcher) -> None:
        self.hub, self.watcher = hub, watcher
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.watcher.dropped.is_set():  # dropped (the edge stopping) between joining and now
            self.hub.leave(self.watcher)
            await _refuse(send)
            return
        tasks = (
            asyncio.ensure_future(self._send(send)),
            asyncio.ensure_future(_disconnected(receive)),
            asyncio.ensure_future(self.watcher.dropped.wait()),
        )
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.hub.leave(self.watcher)
        if self.watcher.dropped.is_set():
            if not self._started:  # dropped (the edge stopping) before the stream began: a 503, not a 500
                await _refuse(send)
                return
            await _end(send, b"event: reconnect\ndata: {}\n\n" if self.watcher.renewed else b"")

    async def _send(self, send: Send) -> None:
        with contextlib.suppress(OSError):  # the client went away mid-write
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            self._started = True
            await send({"type": "http.response.body", "body": b": live\n\n", "more_body": True})
            async for message in self.watcher.messages():
                await send({"type": "http.response.body", "body": message, "more_body": True})


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _refuse(send: Send) -> None:
    """A 503 in place of a stream the hub dropped before it began; bounded like :func:`_end`."""
    error = ApiError(503, "this edge is stopping; reconnect to another", retry_after=1.0)
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
    with contextlib.suppress(OSError, RuntimeError, TimeoutError):
        async with asyncio.timeout(1.0):
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": error.content()})


async def _end(send: Send, last: bytes = b"") -> None:
    """The stream's last chunk (``last``, then its end), so its client sees it end (not a cut
    connection); bounded: a client that stopped reading may never take it."""
    with contextlib.suppress(OSError, RuntimeError, TimeoutError):
        async with asyncio.timeout(1.0):
            await send({"type": "http.response.body", "body": last, "more_body": False})
