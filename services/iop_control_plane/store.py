"""The control-plane's SQLite file: the node audit (every node seen, with labels, address,
models, first and last seen, and every state change with its reason) and the run ledger
(:mod:`iop_control_plane.ledger`). Writes are queued and committed in batches by one background
task, off the paths that serve runs and reports. The ledger's queue is bounded: when the disk
cannot keep up, runs started beyond ``backlog`` are not recorded (counted, and logged once a
second); a run taken when it started is recorded when it ends (runs in progress are bounded by
the listener's limits). On open, runs left in progress by a control-plane that was killed are
recorded as interrupted (:func:`iop_control_plane.ledger.recover`).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog
from prometheus_client import Counter

from iop_control_plane import ledger
from iop_control_plane.ledger import Attempt, LedgerEntry
from iop_control_plane.text import TEXT_CHARS, clip
from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = ["AuditStore"]

_log = structlog.get_logger("iop.control_plane")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY, labels TEXT NOT NULL, address TEXT NOT NULL, models TEXT NOT NULL,
    first_seen REAL NOT NULL, last_seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS node_events (
    node_id TEXT NOT NULL, at REAL NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS node_events_by_node ON node_events (node_id, at);
"""
_UPSERT = """
INSERT INTO nodes (node_id, labels, address, models, first_seen, last_seen) VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (node_id) DO UPDATE SET labels = excluded.labels, address = excluded.address,
    models = excluded.models, last_seen = excluded.last_seen
"""


@dataclass(frozen=True, slots=True)
class _Opened:
    """A run started: its row in ``open_runs``."""

    entry: LedgerEntry


@dataclass(frozen=True, slots=True)
class _Placed:
    """A run's attempt number ``number`` was placed on a node."""

    entry: LedgerEntry
    number: int
    attempt: Attempt


_Write = tuple[str, tuple[object, ...]] | LedgerEntry | _Opened | _Placed
_COMMIT_WINDOW = 0.02
"""Seconds the writer gathers writes before one commit: one thread hop and transaction for many runs."""
_PRUNE_EVERY = 1000
"""Runs (node state changes) recorded between two prunes of the ledger (of the state changes)."""
_STATE_CHANGED = "INSERT INTO node_events VALUES (?, ?, ?, ?)"


class AuditStore:
    """Nodes and their state changes; ``first_seen`` is kept in memory for ``nodes.list``."""

    def __init__(
        self,
        path: Path,
        *,
        max_runs: int = 1_000_000,
        max_events: int = 100_000,
        backlog: int = 10_000,
        dropped: Counter | None = None,
    ) -> None:
        self.path = path
        self.max_runs = max_runs
        """Runs the ledger keeps; older ones are pruned."""
        self.max_events = max_events
        """Node state changes the audit keeps (a node reconnecting in a loop adds two a time); older ones are pruned."""
        self.backlog = backlog
        """Runs that may wait to be written; more are not recorded."""
        self._dropped = dropped
        self._queued_runs = 0
        self._since_prune = self._events_since_prune = 0
        self._last_drop_log = 0.0
        self.first_seen: dict[str, float] = {}
        """Node id -> when it first registered (from the file, across restarts)."""
        self.served_before: frozenset[str] = frozenset()
        """Models the nodes in the file served when they last registered (before this process started)."""
        self._db: sqlite3.Connection | None = None
        self._pending: list[_Write] = []
        self._wake = asyncio.Event()
        self._window: asyncio.TimerHandle | None = None
        self._writer: asyncio.Task[None] | None = None
        self._closing = False

    async def open(self) -> None:
        """Create the file and tables, record runs left open as interrupted, read first-seen times, start the writer."""
        self._db = await asyncio.to_thread(self._connect)
        if interrupted := await asyncio.to_thread(ledger.recover, self._db):
            _log.warning("runs left in progress by the last stop recorded as interrupted", runs=interrupted)
        rows = await asyncio.to_thread(self._db.execute("SELECT node_id, first_seen, models FROM nodes").fetchall)
        self.first_seen = {node_id: first_seen for node_id, first_seen, _ in rows}
        self.served_before = frozenset(model for *_, models in rows for model in json.loads(models))
        self._writer = asyncio.create_task(self._write_loop(), name="iop-audit")

    async def aclose(self) -> None:
        """Commit what is queued and close the file."""
        self._closing = True
        if self._window is not None:
            self._window.cancel()
            self._window = None
        self._wake.set()
        if self._writer is not None:
            await self._writer  # it commits what is queued, then returns
        if self._db is not None:
            self._db.close()
            self._db = None

    def node_seen(self, node_id: str, *, labels: Mapping[str, str], address: str, models: Iterable[str]) -> None:
        """A node registered."""
        now = time.time()
        self.first_seen.setdefault(node_id, now)
        row = (node_id, json.dumps(dict(labels)), address, json.dumps(sorted(models)), now, now)
        self._queue(_UPSERT, row)

    def touched(self, node_id: str) -> None:
        """A node reported its status."""
        self._queue("UPDATE nodes SET last_seen = ? WHERE node_id = ?", (time.time(), node_id))

    def state_changed(self, node_id: str, state: str, reason: str) -> None:
        """A node changed state."""
        self._queue(_STATE_CHANGED, (clip(node_id), time.time(), state, clip(reason, TEXT_CHARS)))

    def run_started(self, entry: LedgerEntry) -> None:
        """A run was received: note it in progress, unless the backlog is full (then it is not recorded)."""
        if self._takes(entry):
            self._pending.append(_Opened(entry))
            self._soon()

    def run_placed(self, entry: LedgerEntry) -> None:
        """The run's latest attempt (``entry.attempts[-1]``) was placed on a node."""
        if entry.recorded:
            self._pending.append(_Placed(entry, len(entry.attempts), entry.attempts[-1]))
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
        now = time.monotonic()
        if now - self._last_drop_log >= 1.0:
            self._last_drop_log = now
            _log.warning("ledger backlog full: run not recorded", run_id=clip(entry.run_id), backlog=self.backlog)
        return False

    async def runs(self, request: pb.RunsList) -> pb.RunsListed:
        """The ledger's runs that ``request`` asks for (read in a thread, on a connection of its own)."""
        return await asyncio.to_thread(ledger.query, self.path, request)

    def events(self, node_id: str) -> list[tuple[str, str]]:
        """(state, reason) of a node's committed changes, oldest first (for tests and tools)."""
        assert self._db is not None
        query = "SELECT state, reason FROM node_events WHERE node_id = ? ORDER BY at"
        return [(state, reason) for state, reason in self._db.execute(query, (node_id,))]

    def _queue(self, sql: str, params: tuple[object, ...]) -> None:
        self._pending.append((sql, params))
        self._soon()

    def _soon(self) -> None:
        """Wake the writer once the commit window has gathered what the next milliseconds bring."""
        if self._window is None:
            self._window = asyncio.get_running_loop().call_later(_COMMIT_WINDOW, self._window_ended)

    def _window_ended(self) -> None:
        self._window = None
        self._wake.set()

    def _take(self) -> list[_Write]:
        batch, self._pending = self._pending, []
        self._queued_runs = 0
        return batch

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await asyncio.to_thread(self._commit, self._take())
            except sqlite3.Error as exc:  # the audit must never stop the control-plane
                _log.warning("audit write failed", reason=str(exc))
            if self._closing and not self._pending:
                return

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")  # readers (runs.list) never wait for the writer
        db.execute("PRAGMA synchronous=NORMAL")  # WAL: a commit survives a crash of the process, fsync at checkpoints
        db.executescript(_SCHEMA + ledger.SCHEMA)
        return db

    def _commit(self, batch: list[_Write]) -> None:
        if not batch or self._db is None:
            return
        ending = {id(write) for write in batch if isinstance(write, LedgerEntry)}
        with self._db:
            for write in batch:
                match write:
                    case LedgerEntry():
                        ledger.insert(self._db, write)
                        self._since_prune += 1
                    case _Opened(entry) if id(entry) not in ending:  # a run that ends in this batch needs none
                        ledger.opened(self._db, entry)
                    case _Placed(entry, number, attempt) if id(entry) not in ending:
                        ledger.placed(self._db, entry, number, attempt)
                    case (str() as sql, params):
                        self._db.execute(sql, params)
                        if sql is _STATE_CHANGED:
                            self._events_since_prune += 1
            if self._since_prune >= _PRUNE_EVERY:
                self._since_prune = 0
                ledger.prune(self._db, self.max_runs)
            if self._events_since_prune >= _PRUNE_EVERY:
                self._events_since_prune = 0
                prune = "DELETE FROM node_events WHERE rowid <= (SELECT MAX(rowid) FROM node_events) - ?"
                self._db.execute(prune, (self.max_events,))
