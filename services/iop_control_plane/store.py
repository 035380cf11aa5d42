"""The node audit (every node seen, with labels, address, models, first and last seen, and every
state change with its reason) and the run ledger (:mod:`iop_control_plane.ledger`), written to
the state store (:mod:`iop_control_plane.state`: a SQLite file, or PostgreSQL shared by replicas).

Nothing on a run's or a report's path waits for the database: writes are queued and committed
in batches by one background task. A batch that fails (the database went away) is kept and
retried, every second at most, until it is written; meanwhile new writes queue behind it. The
queue is bounded: runs started beyond ``backlog`` are not recorded, and node writes beyond it
are dropped (both counted, and logged once a second); a run taken when it started is recorded
when it ends (runs in progress are bounded by the listener's limits). A node's last-seen time
is one entry per node however often it reports. On open, runs left in progress by a
control-plane that was killed are recorded as interrupted: in a SQLite file all of them; in a
shared store those of control-planes silent for :data:`STALE_AFTER` seconds, checked again
every :data:`RECOVER_EVERY` seconds while running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import structlog
from prometheus_client import Counter

from iop_control_plane.ledger import LedgerEntry, LeftOpen
from iop_control_plane.sqlite_store import SqliteStore
from iop_control_plane.state import NodeSeen, Opened, Placed, StateChanged, StateStore, Write
from iop_control_plane.text import TEXT_CHARS, clip
from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = ["RECOVER_EVERY", "STALE_AFTER", "AuditStore"]

_log = structlog.get_logger("iop.control_plane")
_COMMIT_WINDOW = 0.02
"""Seconds the writer gathers writes before one commit: one transaction for many runs."""
_TOUCH_WINDOW = 5.0
"""Seconds a node's last-seen time may wait for its commit: 1,000 nodes reporting now and then
make one transaction every few seconds, not one every commit window."""
_PRUNE_EVERY = 1000
"""Runs (node state changes) recorded between two prunes of the ledger (of the state changes)."""
_RETRY = 1.0
"""Seconds between two attempts to write a batch the database refused."""
STALE_AFTER = 15.0
"""Seconds a control-plane sharing the store may be silent before its open runs are recorded interrupted."""
RECOVER_EVERY = 5.0
"""Seconds between two heartbeats (and recoveries of silent replicas' runs) in a shared store."""


class AuditStore:
    """Nodes and their state changes, and the ledger; ``first_seen`` is kept in memory for ``nodes.list``."""

    def __init__(
        self,
        store: Path | StateStore,
        *,
        max_runs: int = 1_000_000,
        max_events: int = 100_000,
        backlog: int = 10_000,
        dropped: Counter | None = None,
        owner: str | None = None,
    ) -> None:
        self.state: StateStore = SqliteStore(store) if isinstance(store, Path) else store
        """Where it is written."""
        self.path = self.state.path if isinstance(self.state, SqliteStore) else None
        """The SQLite file, when it is one."""
        self.owner = owner or uuid.uuid4().hex[:12]
        """This control-plane's name on its runs in progress."""
        self.max_runs = max_runs
        """Runs the ledger keeps; older ones are pruned."""
        self.max_events = max_events
        """Node state changes the audit keeps (a node reconnecting in a loop adds two a time); older ones are pruned."""
        self.backlog = backlog
        """Runs (and, apart, node writes) that may wait to be written; more are not recorded."""
        self.dropped_writes = 0
        """Node writes dropped because the backlog was full."""
        self._dropped = dropped
        self._queued_runs = 0
        self._since_prune = self._events_since_prune = 0
        self._last_drop_log = 0.0
        self.first_seen: dict[str, float] = {}
        """Node id -> when it first registered (from the store, across restarts)."""
        self.served_before: frozenset[str] = frozenset()
        """Models the nodes in the store served when they last registered (before this process started)."""
        self._pending: list[Write] = []
        self._touched: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._window: asyncio.TimerHandle | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.failing = False
        """Whether the last write failed (the database is away): what is queued waits."""
        self.on_left_open: Callable[[list[LeftOpen]], None] | None = None
        """Called with the runs recovery recorded interrupted (to ask their nodes how they ended)."""

    @property
    def waiting(self) -> int:
        """Writes queued and not yet committed."""
        return len(self._pending)

    async def open(self) -> None:
        """Open the store, record runs left open as interrupted, read first-seen times, start the writer."""
        await self.state.open(self.owner)
        try:
            if self.state.shared:
                await self.state.heartbeat()
            interrupted = await self.state.recover(STALE_AFTER if self.state.shared else 0.0)
            rows = await self.state.nodes()
        except BaseException:
            await self.state.aclose()
            raise
        if interrupted:
            _log.warning("runs left in progress by the last stop recorded as interrupted", runs=len(interrupted))
            self._left_open(interrupted)
        self.first_seen = {node_id: first_seen for node_id, first_seen, _ in rows}
        self.served_before = frozenset(model for *_, models in rows for model in json.loads(models))
        self._tasks.append(asyncio.create_task(self._write_loop(), name="iop-audit"))
        if self.state.shared:
            self._tasks.append(asyncio.create_task(self._keep_alive(), name="iop-audit-heartbeat"))

    def _left_open(self, runs: list[LeftOpen]) -> None:
        if self.on_left_open is not None:
            self.on_left_open(runs)

    async def aclose(self) -> None:
        """Commit what is queued (one attempt when the database is away) and close the store."""
        self._closing = True
        if self._window is not None:
            self._window.cancel()
            self._window = None
        self._wake.set()
        for task in self._tasks[1:]:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)  # the writer commits what is queued
        self._tasks.clear()
        await self.state.aclose()

    def node_seen(self, node_id: str, *, labels: Mapping[str, str], address: str, models: Iterable[str]) -> None:
        """A node registered."""
        now = time.time()
        self.first_seen.setdefault(node_id, now)
        self._queue(NodeSeen(node_id, json.dumps(dict(labels)), address, json.dumps(sorted(models)), now))

    def touched(self, node_id: str) -> None:
        """A node reported its status."""
        self._touched[node_id] = time.time()
        self._soon(_TOUCH_WINDOW)

    def state_changed(self, node_id: str, state: str, reason: str) -> None:
        """A node changed state."""
        self._queue(StateChanged(clip(node_id), time.time(), state, clip(reason, TEXT_CHARS)))

    def run_started(self, entry: LedgerEntry) -> None:
        """A run was received: note it in progress, unless the backlog is full (then it is not recorded)."""
        if self._takes(entry):
            self._pending.append(Opened(entry))
            self._soon()

    def run_placed(self, entry: LedgerEntry) -> None:
        """The run's latest attempt (``entry.attempts[-1]``) was placed on a node."""
        if entry.recorded:
            self._pending.append(Placed(entry, len(entry.attempts), entry.attempts[-1]))
            self._soon()

    def run_ended(self, entry: LedgerEntry) -> None:
        """Record a run in the ledger (one never started: unless the backlog is full)."""
        if entry.recorded or (entry.recorded is None and self._takes(entry)):
            self._pending.append(entry)
            self._soon()

    def _takes(self, entry: LedgerEntry) -> bool:
        """Decide whether the ledger records ``entry``: not when the backlog is full (counted, logged once a second)."""
        entry.recorded = self._queued_runs < self.backlog
        if entry.recorded:
            self._queued_runs += 1
            return True
        if self._dropped is not None:
            self._dropped.inc()
        self._log_drop("ledger backlog full: run not recorded", run_id=clip(entry.run_id))
        return False

    def _log_drop(self, event: str, **fields: object) -> None:
        now = time.monotonic()
        if now - self._last_drop_log >= 1.0:
            self._last_drop_log = now
            _log.warning(event, backlog=self.backlog, database_away=self.failing, **fields)

    async def runs(self, request: pb.RunsList) -> pb.RunsListed:
        """The ledger's runs that ``request`` asks for (off the event loop's way)."""
        return await self.state.runs(request)

    async def usage(self, request: pb.UsageList) -> pb.UsageListed:
        """Token usage per bucket that ``request`` asks for (off the event loop's way)."""
        return await self.state.usage(request)

    def events(self, node_id: str) -> list[tuple[str, str]]:
        """(state, reason) of a node's committed changes, oldest first, from a SQLite file (for tests and tools)."""
        assert self.path is not None, "events() reads a SQLite file; await state.events() otherwise"
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        try:
            query = "SELECT state, reason FROM node_events WHERE node_id = ? ORDER BY at"
            return [(state, reason) for state, reason in db.execute(query, (node_id,))]
        finally:
            db.close()

    def _queue(self, write: Write) -> None:
        if len(self._pending) - self._queued_runs >= self.backlog:  # node writes: bounded apart from runs
            self.dropped_writes += 1
            self._log_drop("audit backlog full: node write dropped", dropped=self.dropped_writes)
            return
        self._pending.append(write)
        self._soon()

    def _soon(self, window: float = _COMMIT_WINDOW) -> None:
        """Wake the writer once ``window`` has gathered what comes meanwhile (the sooner of two windows wins)."""
        if self._closing:
            return
        loop = asyncio.get_running_loop()
        if self._window is not None:
            if self._window.when() <= loop.time() + window:
                return
            self._window.cancel()
        self._window = loop.call_later(window, self._window_ended)

    def _window_ended(self) -> None:
        self._window = None
        self._wake.set()

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._write_pending()
            if self._closing:
                return

    async def _write_pending(self) -> None:
        """Write what is queued; on failure keep it (in order, ahead of newer writes) and retry."""
        while self._pending or self._touched:
            batch, touched = self._pending, self._touched
            self._pending, self._touched = [], {}
            runs = _runs_taken(batch)
            try:
                await self.state.commit(batch, touched)
            except Exception as exc:  # noqa: BLE001 - the audit must never stop the control-plane
                self._failed(batch, touched, exc)
                if self._closing:
                    return
                await asyncio.sleep(_RETRY)
                continue
            if self.failing:
                _log.info("audit writes resumed", written=len(batch))
                self.failing = False
            self._queued_runs = max(0, self._queued_runs - runs)
            await self._maybe_prune(batch)
            if not self._closing:
                return

    def _failed(self, batch: list[Write], touched: dict[str, float], exc: Exception) -> None:
        for write in batch:
            if isinstance(write, Opened):
                write.entry.open_row = None  # the row rolled back with the batch
        self._pending[:0] = batch
        self._touched = touched | self._touched
        if not self.failing:
            _log.warning(
                "audit write failed; retrying", reason=str(exc) or type(exc).__name__, queued=len(self._pending)
            )
        self.failing = True

    async def _maybe_prune(self, batch: list[Write]) -> None:
        self._since_prune += sum(isinstance(write, LedgerEntry) for write in batch)
        self._events_since_prune += sum(isinstance(write, StateChanged) for write in batch)
        if self._since_prune < _PRUNE_EVERY and self._events_since_prune < _PRUNE_EVERY:
            return
        self._since_prune = self._events_since_prune = 0
        with contextlib.suppress(Exception):  # the next prune tries again
            await self.state.prune(self.max_runs, self.max_events)

    async def _keep_alive(self) -> None:
        """In a shared store: note this control-plane alive, and record silent replicas' open runs interrupted.

        A replica is judged silent only once this one has reached the store for ``STALE_AFTER`` s without
        a break: while the database was away no replica could note itself alive, and when it is back each
        must have the time to before another takes its runs for lost (the HA test saw runs recorded
        interrupted by one replica and completed by the other after PostgreSQL was away for 11.8 s)."""
        reachable_since: float | None = time.monotonic()  # open() has just reached it
        while True:
            await asyncio.sleep(RECOVER_EVERY)
            try:
                await self.state.heartbeat()
            except Exception as exc:  # noqa: BLE001 - a background loop logs and continues
                _log.warning("audit heartbeat failed", reason=str(exc) or type(exc).__name__)
                reachable_since = None
                continue
            now = time.monotonic()
            if reachable_since is None or self.failing:
                reachable_since = now
            if now - reachable_since < STALE_AFTER:
                continue
            try:
                if interrupted := await self.state.recover(STALE_AFTER):
                    _log.warning(
                        "runs left in progress by a silent control-plane recorded as interrupted",
                        runs=len(interrupted),
                    )
                    self._left_open(interrupted)
            except Exception as exc:  # noqa: BLE001 - a background loop logs and continues
                _log.warning("recovering silent control-planes' runs failed", reason=str(exc) or type(exc).__name__)


def _runs_taken(batch: list[Write]) -> int:
    """Runs of ``batch`` that took a place in the backlog: those started, and those ended never started."""
    opened = {id(write.entry) for write in batch if isinstance(write, Opened)}
    unstarted = sum(
        isinstance(write, LedgerEntry) and id(write) not in opened and write.open_row is None for write in batch
    )
    return len(opened) + unstarted
