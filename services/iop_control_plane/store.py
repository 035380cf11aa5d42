"""The control-plane's SQLite file: the node audit (every node seen, with labels, address,
models, first and last seen, and every state change with its reason) and the run ledger
(:mod:`iop_control_plane.ledger`). Writes are queued and committed in batches by one background
task, off the paths that serve runs and reports. The ledger's queue is bounded: when the disk
cannot keep up, runs beyond ``backlog`` are not recorded (counted, and logged once a second).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import structlog
from prometheus_client import Counter

from iop_control_plane import ledger
from iop_control_plane.ledger import LedgerEntry
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
_Write = tuple[str, tuple[object, ...]] | LedgerEntry
_COMMIT_WINDOW = 0.02
"""Seconds the writer gathers writes before one commit: one thread hop and transaction for many runs."""
_PRUNE_EVERY = 1000
"""Runs recorded between two prunes of the ledger."""


class AuditStore:
    """Nodes and their state changes; ``first_seen`` is kept in memory for ``nodes.list``."""

    def __init__(
        self, path: Path, *, max_runs: int = 1_000_000, backlog: int = 10_000, dropped: Counter | None = None
    ) -> None:
        self.path = path
        self.max_runs = max_runs
        """Runs the ledger keeps; older ones are pruned."""
        self.backlog = backlog
        """Runs that may wait to be written; more are not recorded."""
        self._dropped = dropped
        self._queued_runs = 0
        self._since_prune = 0
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
        """Create the file and tables, read first-seen times, start the writer."""
        self._db = await asyncio.to_thread(self._connect)
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
        self._queue("INSERT INTO node_events VALUES (?, ?, ?, ?)", (node_id, time.time(), state, reason))

    def run_ended(self, entry: LedgerEntry) -> None:
        """Record a run in the ledger (dropped, counted and logged when the backlog is full)."""
        if self._queued_runs >= self.backlog:
            if self._dropped is not None:
                self._dropped.inc()
            now = time.monotonic()
            if now - self._last_drop_log >= 1.0:
                self._last_drop_log = now
                _log.warning("ledger backlog full: run not recorded", run_id=entry.run_id, backlog=self.backlog)
            return
        self._queued_runs += 1
        self._pending.append(entry)
        self._soon()

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
        with self._db:
            for write in batch:
                if isinstance(write, LedgerEntry):
                    ledger.insert(self._db, write)
                    self._since_prune += 1
                else:
                    self._db.execute(*write)
            if self._since_prune >= _PRUNE_EVERY:
                self._since_prune = 0
                ledger.prune(self._db, self.max_runs)
