"""The key store in a SQLite file (``keys_path``): the default, for edges on one machine.

Every statement is short and the file is in WAL mode, so the async methods run them inline;
the edge's only repeated read (``changes``) is ``PRAGMA data_version`` and the file's inode,
run in a thread. Time is this machine's clock. Several edges on one machine may share the file:
``BEGIN IMMEDIATE`` serializes their budget takes as PostgreSQL's row lock does.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from iop_edge.key_storage import (
    MIGRATIONS,
    SCHEMA_VERSION,
    USAGE_WRITES_KEPT,
    ApiKey,
    Grant,
    KeyInfo,
    UsageRow,
    UsageTotal,
    api_key,
    check_version,
    key_info,
    name_taken,
    retry_after,
)

__all__ = ["SqliteKeyStorage", "connect"]

_ACTIVE = "SELECT hash, name, key_id, rpm, tpm, max_concurrent, admin FROM keys WHERE revoked_at IS NULL"
# Notes a usage batch as the edge's last; changes nothing (no row counted) when it already was.
_NOTE_BATCH = (
    "INSERT INTO key_usage_writes VALUES (?, ?, ?) ON CONFLICT (edge) DO UPDATE "
    "SET batch = excluded.batch, at = excluded.at WHERE key_usage_writes.batch != excluded.batch"
)
_INSERT = (
    "INSERT OR REPLACE INTO keys (name, key_id, hash, created_at, revoked_at, rpm, tpm, max_concurrent, admin) "
    "VALUES (?, ?, ?, ?, NULL, ?, ?, ?, ?)"
)
_LIST = (
    "SELECT name, key_id, created_at, revoked_at, rpm, tpm, max_concurrent, admin FROM keys ORDER BY created_at, name"
)


def connect(path: Path, *, create: bool = True) -> sqlite3.Connection:
    """The key file, created (owner-only, WAL mode) and migrated to this edge's schema.

    FileNotFoundError when it is missing and ``create`` is false; SchemaTooNew for a newer file.
    """
    if not create and not path.is_file():
        raise FileNotFoundError(f"no key file {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA busy_timeout=5000")
        _migrate(db, str(path))
    except BaseException:
        db.close()
        raise
    return db


def _migrate(db: sqlite3.Connection, store: str) -> None:
    with _immediate(db):
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = db.execute("SELECT version FROM schema_version").fetchone()
        if row is None:  # a file from before versions: version 1 if it has its table
            has_keys = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'keys'").fetchone()
            version = 1 if has_keys else 0
            db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
        else:
            version = row[0]
        check_version(version, store)
        for step in MIGRATIONS[version:]:
            for statement in step:
                db.execute(statement.format(real="REAL", id="INTEGER PRIMARY KEY"))
        if version < SCHEMA_VERSION:
            db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))


@contextlib.contextmanager
def _immediate(db: sqlite3.Connection) -> Iterator[None]:
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


class SqliteKeyStorage:
    """The key store in one SQLite file; conforms to ``key_storage.KeyStorage``.

    With ``create`` false, a missing file is FileNotFoundError (``iop keys ls``); an open store
    follows a file replaced under it, and keeps its connection to a deleted one.
    """

    sessions_lost = 0  # a file has no sessions for a server to end

    def __init__(self, path: Path, *, create: bool = True) -> None:
        self.path = path
        self.name = str(path)
        self._create = create
        self._db: sqlite3.Connection | None = None
        self._inode = -1

    async def open(self) -> None:
        """Open (creating it if allowed) and migrate the file."""
        self.open_sync()

    def open_sync(self) -> None:
        """:meth:`open` for the command line."""
        self._db = connect(self.path, create=self._create)
        self._inode = os.stat(self.path).st_ino

    async def aclose(self) -> None:
        """Close the file."""
        self.close()

    def close(self) -> None:
        """:meth:`aclose` for the command line."""
        db, self._db = self._db, None
        if db is not None:
            db.close()

    @property
    def db(self) -> sqlite3.Connection:
        """The open connection."""
        if self._db is None:
            raise RuntimeError(f"the key store {self.name} is not open")
        return self._db

    async def create(
        self,
        name: str,
        digest: str,
        *,
        rpm: int | None,
        tpm: int | None,
        max_concurrent: int | None,
        admin: bool = False,
    ) -> None:
        """Add a key; ValueError if ``name`` was ever used (revoked keys keep theirs)."""
        self.create_sync(name, digest, rpm=rpm, tpm=tpm, max_concurrent=max_concurrent, admin=admin)

    def create_sync(
        self,
        name: str,
        digest: str,
        *,
        rpm: int | None,
        tpm: int | None,
        max_concurrent: int | None,
        admin: bool = False,
    ) -> None:
        """:meth:`create` for the command line."""
        db = self.db
        with _immediate(db):
            row = db.execute("SELECT revoked_at FROM keys WHERE name = ?", (name,)).fetchone()
            if row is not None:
                raise ValueError(name_taken(name, revoked=row[0] is not None))
            db.execute(
                _INSERT,
                (name, f"key_{digest[:12]}", digest, time.time(), rpm, tpm, max_concurrent, admin),
            )
            db.execute("UPDATE key_changes SET version = version + 1")

    async def revoke(self, name: str) -> bool:
        """Revoke the active key ``name``; whether there was one."""
        return self.revoke_sync(name)

    def revoke_sync(self, name: str) -> bool:
        """:meth:`revoke` for the command line."""
        db = self.db
        with _immediate(db):
            cursor = db.execute(
                "UPDATE keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL", (time.time(), name)
            )
            db.execute("UPDATE key_changes SET version = version + 1")
        return cursor.rowcount > 0

    async def list_keys(self) -> list[KeyInfo]:
        """Every key, oldest first."""
        return self.list_sync()

    def list_sync(self) -> list[KeyInfo]:
        """:meth:`list_keys` for the command line."""
        return [key_info(row) for row in self.db.execute(_LIST).fetchall()]

    async def changes(self) -> object:
        """The file's inode and the counter (another file moved into place is a change too)."""
        inode = os.stat(self.path).st_ino  # a deleted file: OSError, the caller keeps its keys
        if inode != self._inode:
            self.close()
            self.open_sync()
        return (inode, self.db.execute("SELECT version FROM key_changes").fetchone()[0])

    async def active(self) -> dict[str, ApiKey]:
        """The active keys by digest."""
        return {row[0]: api_key(row[1:]) for row in self.db.execute(_ACTIVE)}

    async def add_usage(self, rows: Sequence[UsageRow], edge: str, batch: str) -> None:
        """Add the rows, in one transaction, unless ``batch`` was the last written."""
        now = time.time()
        with _immediate(self.db):
            if not self.db.execute(_NOTE_BATCH, (edge, batch, now)).rowcount:
                return
            self.db.execute("DELETE FROM key_usage_writes WHERE at < ?", (now - USAGE_WRITES_KEPT,))
            self.db.executemany(
                "INSERT INTO key_usage VALUES (?, ?, ?, ?, ?) ON CONFLICT (name, edge, minute) DO UPDATE SET "
                "requests = requests + excluded.requests, tokens = tokens + excluded.tokens",
                [(row.name, edge, row.minute, row.requests, row.tokens) for row in rows],
            )

    async def usage(self) -> Mapping[str, UsageTotal]:
        """Recorded usage per key."""
        rows = self.db.execute("SELECT name, sum(requests), sum(tokens) FROM key_usage GROUP BY name")
        return {name: UsageTotal(requests, tokens) for name, requests, tokens in rows}

    async def take(self, name: str, kind: str, edge: str, *, want: int, debt: int, limit: int, window: float) -> Grant:
        """Grant up to ``want`` units within ``limit`` per ``window``, and record ``debt``."""
        db, now = self.db, time.time()
        with _immediate(db):
            db.execute("DELETE FROM key_grants WHERE name = ? AND kind = ? AND at <= ?", (name, kind, now - window))
            grants = db.execute(
                "SELECT at, units FROM key_grants WHERE name = ? AND kind = ? ORDER BY at", (name, kind)
            ).fetchall()
            granted = max(0, min(want, limit - debt - sum(units for _, units in grants)))
            grant_id = None
            if granted + debt > 0:
                cursor = db.execute(
                    "INSERT INTO key_grants (name, kind, edge, at, units) VALUES (?, ?, ?, ?, ?)",
                    (name, kind, edge, now, granted + debt),
                )
                grant_id = cursor.lastrowid
                grants.append((now, granted + debt))
        wait = retry_after(grants, limit, now, window) if granted < want else 0.0
        return Grant(grant_id, granted, wait)

    async def give_back(self, returns: Sequence[tuple[int, int]]) -> None:
        """Take unused units off their grants."""
        with _immediate(self.db):
            self.db.executemany(
                "UPDATE key_grants SET units = max(units - ?, 0) WHERE id = ?",
                [(units, grant_id) for grant_id, units in returns],
            )

    async def hold_slots(self, name: str, edge: str, *, want: int, limit: int, ttl: float) -> int:
        """Hold up to ``want`` of the ``limit`` slots not held by other edges."""
        db, now = self.db, time.time()
        with _immediate(db):
            db.execute("DELETE FROM key_slots WHERE name = ? AND at <= ?", (name, now - ttl))
            others = db.execute(
                "SELECT coalesce(sum(slots), 0) FROM key_slots WHERE name = ? AND edge != ?", (name, edge)
            ).fetchone()[0]
            held = max(0, min(want, limit - int(others)))
            db.execute(
                "INSERT INTO key_slots VALUES (?, ?, ?, ?) ON CONFLICT (name, edge) DO UPDATE SET "
                "slots = excluded.slots, at = excluded.at",
                (name, edge, held, now),
            )
        return held

    async def heartbeat(self, edge: str, *, ttl: float) -> int:
        """Note ``edge`` alive; the edges seen within ``ttl`` seconds."""
        db, now = self.db, time.time()
        with _immediate(db):
            db.execute(
                "INSERT INTO key_edges VALUES (?, ?) ON CONFLICT (edge) DO UPDATE SET at = excluded.at", (edge, now)
            )
            db.execute("DELETE FROM key_edges WHERE at <= ?", (now - 10 * ttl,))
            count = db.execute("SELECT count(*) FROM key_edges WHERE at > ?", (now - ttl,)).fetchone()[0]
        return int(count)
