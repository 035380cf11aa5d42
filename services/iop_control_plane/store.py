"""The node audit in SQLite: every node seen (labels, address, models, first and last seen) and
every state change with its reason. Writes are queued and committed in batches by one
background task, off the paths that serve runs and reports.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import structlog

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
_Write = tuple[str, tuple[object, ...]]


class AuditStore:
    """Nodes and their state changes; ``first_seen`` is kept in memory for ``nodes.list``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.first_seen: dict[str, float] = {}
        """Node id -> when it first registered (from the file, across restarts)."""
        self._db: sqlite3.Connection | None = None
        self._pending: list[_Write] = []
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._closing = False

    async def open(self) -> None:
        """Create the file and tables, read first-seen times, start the writer."""
        self._db = await asyncio.to_thread(self._connect)
        rows = await asyncio.to_thread(self._db.execute("SELECT node_id, first_seen FROM nodes").fetchall)
        self.first_seen = dict(rows)
        self._writer = asyncio.create_task(self._write_loop(), name="iop-audit")

    async def aclose(self) -> None:
        """Commit what is queued and close the file."""
        self._closing = True
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

    def events(self, node_id: str) -> list[tuple[str, str]]:
        """(state, reason) of a node's committed changes, oldest first (for tests and tools)."""
        assert self._db is not None
        query = "SELECT state, reason FROM node_events WHERE node_id = ? ORDER BY at"
        return [(state, reason) for state, reason in self._db.execute(query, (node_id,))]

    def _queue(self, sql: str, params: tuple[object, ...]) -> None:
        self._pending.append((sql, params))
        self._wake.set()

    def _take(self) -> list[_Write]:
        batch, self._pending = self._pending, []
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
        db.executescript(_SCHEMA)
        return db

    def _commit(self, batch: list[_Write]) -> None:
        if not batch or self._db is None:
            return
        with self._db:
            for sql, params in batch:
                self._db.execute(sql, params)
