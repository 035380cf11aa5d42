"""Join tokens, the audit of join attempts, and the node certificates issued and revoked, kept in
the control-plane's SQLite file (beside the node audit and the run ledger).

A token is ``iopjt-<id>.<secret>``: the id is public (listed, revoked by it), the secret is kept
only as its SHA-256 and compared in constant time. Token and certificate operations are rare:
each is one short transaction on a connection of its own, run on a thread, one at a time. The
revoked serials are also held in memory, where every TLS handshake looks them up.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import secrets
import sqlite3
import string
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["IdentityStore", "Token", "parse_token"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS join_tokens (
    id TEXT PRIMARY KEY, secret_sha256 TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL,
    uses INTEGER NOT NULL, used INTEGER NOT NULL, name_prefix TEXT NOT NULL, created_by TEXT NOT NULL,
    revoked_at REAL);
CREATE TABLE IF NOT EXISTS join_audit (
    at REAL NOT NULL, token_id TEXT NOT NULL, address TEXT NOT NULL, name TEXT NOT NULL, outcome TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS node_certificates (
    serial TEXT PRIMARY KEY, node_id TEXT NOT NULL, issued_at REAL NOT NULL, not_after REAL NOT NULL,
    revoked_at REAL, reason TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS node_certificates_by_node ON node_certificates (node_id);
"""
_TOKEN = re.compile(r"iopjt-([a-z0-9]{6})\.([0-9a-f]{32})")
_ID_CHARS = string.ascii_lowercase + string.digits
_T = TypeVar("_T")


def parse_token(text: str) -> tuple[str, str] | None:
    """(id, secret) of a token as ``iop join-token create`` prints it; None when it is not shaped so."""
    match = _TOKEN.fullmatch(text.strip())
    return (match[1], match[2]) if match else None


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Token:
    """One join token as stored (its secret only hashed)."""

    id: str
    secret_sha256: str
    created_at: float
    expires_at: float
    uses: int
    """Machines that may join with it."""
    used: int
    """Machines that did."""
    name_prefix: str
    created_by: str
    """The admin certificate's name that created it."""
    revoked_at: float | None

    def opens_with(self, secret: str) -> bool:
        """Whether ``secret`` is this token's (compared in constant time)."""
        return hmac.compare_digest(self.secret_sha256, _digest(secret))


class IdentityStore:
    """Tokens, join attempts and node certificates in ``path``; revoked serials also in :attr:`revoked`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.revoked: set[str] = set()
        """Serials (lower hex) of every revoked certificate."""
        self._db: sqlite3.Connection | None = None
        self._lock = asyncio.Lock()

    async def open(self) -> None:
        """Create the tables if needed and load the revoked serials."""
        self._db = await asyncio.to_thread(self._connect)
        rows = await self._run(
            lambda db: db.execute("SELECT serial FROM node_certificates WHERE revoked_at IS NOT NULL")
        )
        self.revoked = {serial for (serial,) in rows}

    async def aclose(self) -> None:
        """Close the file."""
        if self._db is not None:
            db, self._db = self._db, None
            await asyncio.to_thread(db.close)

    async def create_token(self, *, ttl: float, uses: int, name_prefix: str, created_by: str) -> tuple[str, Token]:
        """A new token: its text (shown once) and what is stored of it."""
        token_id = "".join(secrets.choice(_ID_CHARS) for _ in range(6))
        secret = secrets.token_hex(16)
        now = time.time()
        token = Token(token_id, _digest(secret), now, now + ttl, uses, 0, name_prefix, created_by, None)
        await self._write(
            "INSERT INTO join_tokens VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (token.id, token.secret_sha256, now, token.expires_at, uses, 0, name_prefix, created_by, None),
        )
        return f"iopjt-{token_id}.{secret}", token

    async def tokens(self) -> list[Token]:
        """Every token, newest first."""
        rows = await self._run(lambda db: db.execute("SELECT * FROM join_tokens ORDER BY created_at DESC"))
        return [Token(*row) for row in rows]

    async def token(self, token_id: str) -> Token | None:
        """The token with this id, if there is one."""
        rows = await self._run(lambda db: db.execute("SELECT * FROM join_tokens WHERE id = ?", (token_id,)))
        return Token(*rows[0]) if rows else None

    async def revoke_token(self, token_id: str) -> bool:
        """No machine may join with it any more; False when there is no such token."""
        sql = "UPDATE join_tokens SET revoked_at = coalesce(revoked_at, ?) WHERE id = ?"
        return await self._write(sql, (time.time(), token_id)) > 0

    async def use_token(self, token_id: str) -> bool:
        """Count one use of the token; False when it was used up meanwhile."""
        return await self._write("UPDATE join_tokens SET used = used + 1 WHERE id = ? AND used < uses", (token_id,)) > 0

    async def audit(self, token_id: str, address: str, name: str, outcome: str) -> None:
        """Record one join attempt."""
        await self._write(
            "INSERT INTO join_audit VALUES (?, ?, ?, ?, ?)", (time.time(), token_id, address, name, outcome)
        )

    async def attempts(self) -> list[tuple[str, str, str, str]]:
        """Every join attempt, oldest first: (token id, address, name, outcome)."""
        rows = await self._run(
            lambda db: db.execute("SELECT token_id, address, name, outcome FROM join_audit ORDER BY at")
        )
        return [(str(a), str(b), str(c), str(d)) for a, b, c, d in rows]

    async def issued(self, node_id: str, serial: str, not_after: float, *, replaces: bool) -> list[str]:
        """Record a certificate issued to ``node_id``; with ``replaces`` its earlier ones are revoked
        (returned), so only the newest of a name that joined again is valid."""
        earlier = await self.revoke_node(node_id, "joined again") if replaces else []
        await self._write(
            "INSERT OR REPLACE INTO node_certificates VALUES (?, ?, ?, ?, NULL, '')",
            (serial, node_id, time.time(), not_after),
        )
        return earlier

    async def revoke_node(
        self, node_id: str, reason: str, *, also: tuple[str, float | None] | None = None
    ) -> list[str]:
        """Revoke every certificate of ``node_id`` not revoked yet, and ``also`` (a serial it presented
        that was not issued here, with its expiry); the serials revoked."""
        now = time.time()

        def revoke(db: sqlite3.Connection) -> list[str]:
            if also is not None:
                db.execute(
                    "INSERT OR IGNORE INTO node_certificates VALUES (?, ?, ?, ?, NULL, '')",
                    (also[0], node_id, now, also[1] or now),
                )
            query = "SELECT serial FROM node_certificates WHERE node_id = ? AND revoked_at IS NULL"
            serials = [serial for (serial,) in db.execute(query, (node_id,))]
            db.execute(
                "UPDATE node_certificates SET revoked_at = ?, reason = ? WHERE node_id = ? AND revoked_at IS NULL",
                (now, reason, node_id),
            )
            db.commit()
            return serials

        serials = await self._call(revoke)
        self.revoked.update(serials)
        return serials

    async def _write(self, sql: str, params: tuple[object, ...]) -> int:
        def write(db: sqlite3.Connection) -> int:
            changed = db.execute(sql, params).rowcount
            db.commit()
            return changed

        return await self._call(write)

    async def _run(self, query: Callable[[sqlite3.Connection], sqlite3.Cursor]) -> list[Any]:
        return await self._call(lambda db: query(db).fetchall())

    async def _call(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        assert self._db is not None, "identity store not open"
        db = self._db
        async with self._lock:  # one statement at a time on the one connection
            return await asyncio.to_thread(work, db)

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, timeout=10)
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(_SCHEMA)
        return db
