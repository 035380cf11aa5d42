"""The edge's API keys: a SQLite file of hashed secrets, and per-key request and token limits.

``iop keys`` writes the file with the sync functions (:func:`create_key`, :func:`list_keys`,
:func:`revoke_key`); a running edge reads it with :class:`KeyStore`, which keeps every active key
in memory and re-reads the table within ``refresh`` seconds of a change made by another process.
A secret is ``sk-iop-`` and 43 random URL-safe characters; the file keeps only its SHA-256.

:class:`Limiter` enforces a key's ``rpm`` (requests a minute), ``tpm`` (prompt + completion
tokens a minute) and ``max_concurrent`` (requests in progress) over sliding 60-second windows,
raising :class:`LimitExceeded` (the edge's 429, with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import os
import secrets
import sqlite3
import time
from pathlib import Path

import structlog

from iop_wire.settings import Problem, StartError

__all__ = [
    "SECRET_PREFIX",
    "ApiKey",
    "KeyInfo",
    "KeyStore",
    "Lease",
    "LimitExceeded",
    "Limiter",
    "create_key",
    "list_keys",
    "revoke_key",
]

_log = structlog.get_logger("iop.edge.keys")

SECRET_PREFIX = "sk-iop-"  # noqa: S105 - the public prefix of every secret, not a secret
_SECRET_BYTES = 32  # 43 URL-safe characters, 256 bits
_MAX_TOKEN_CHARS = 256  # longer bearer tokens are refused before hashing
_MAX_NAME_CHARS = 128
_LIMITS = ("rpm", "tpm", "max_concurrent")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    name TEXT PRIMARY KEY,
    key_id TEXT NOT NULL UNIQUE,  -- public: safe to log and show
    hash TEXT NOT NULL UNIQUE,  -- SHA-256 hex of the secret
    created_at REAL NOT NULL,  -- unix seconds
    revoked_at REAL,  -- unix seconds; NULL while active
    rpm INTEGER CHECK (rpm IS NULL OR rpm >= 1),
    tpm INTEGER CHECK (tpm IS NULL OR tpm >= 1),
    max_concurrent INTEGER CHECK (max_concurrent IS NULL OR max_concurrent >= 1)
)
"""


@dataclasses.dataclass(frozen=True, slots=True)
class ApiKey:
    """An active key as the edge sees it: who is calling and their limits."""

    name: str
    """Who the key is for; the run's caller."""
    key_id: str
    """Public id of the key (``key_`` and 12 hex digits), for logs."""
    rpm: int | None
    """Requests a minute; None: no limit."""
    tpm: int | None
    """Prompt + completion tokens a minute; None: no limit."""
    max_concurrent: int | None
    """Requests in progress at once; None: no limit."""

    @property
    def limited(self) -> bool:
        """Whether any limit applies."""
        return self.rpm is not None or self.tpm is not None or self.max_concurrent is not None


@dataclasses.dataclass(frozen=True, slots=True)
class KeyInfo:
    """One row of the key file, as ``iop keys ls`` shows it (never the secret)."""

    name: str
    """Who the key is for."""
    key_id: str
    """Public id of the key."""
    created_at: float
    """Unix seconds."""
    revoked_at: float | None
    """Unix seconds; None while active."""
    rpm: int | None
    """Requests a minute; None: no limit."""
    tpm: int | None
    """Tokens a minute; None: no limit."""
    max_concurrent: int | None
    """Requests in progress at once; None: no limit."""


def _hash(secret: str) -> str:
    # A fast hash is right here: secrets are 256 random bits, so there is nothing to brute-force
    # and no need for a slow password hash (bcrypt, scrypt) that would cost every request.
    return hashlib.sha256(secret.encode()).hexdigest()


def _connect(path: Path) -> sqlite3.Connection:
    """The key file, created (owner-only, WAL mode) with its table when missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(_SCHEMA)
    except BaseException:
        db.close()
        raise
    return db


def _existing(path: Path) -> sqlite3.Connection:
    if not path.is_file():
        raise FileNotFoundError(f"no key file {path}")
    return _connect(path)


def _check_name(name: str) -> None:
    if not name or len(name) > _MAX_NAME_CHARS or any(ch.isspace() or not ch.isprintable() for ch in name):
        raise ValueError(f"key name {name!r} must be 1-{_MAX_NAME_CHARS} printable characters without spaces")


def create_key(
    path: Path, name: str, *, rpm: int | None = None, tpm: int | None = None, max_concurrent: int | None = None
) -> str:
    """Add a key named ``name`` to ``path`` (created when missing) and return its secret.

    A revoked key's name may be reused: its row is replaced. ValueError (one line) for a bad name,
    a limit below 1, or a name whose key is active.
    """
    _check_name(name)
    for option, value in zip(_LIMITS, (rpm, tpm, max_concurrent), strict=True):
        if value is not None and value < 1:
            raise ValueError(f"--{option.replace('_', '-')} must be at least 1, not {value}")
    secret = SECRET_PREFIX + secrets.token_urlsafe(_SECRET_BYTES)
    digest = _hash(secret)
    with contextlib.closing(_connect(path)) as db:
        db.execute("BEGIN IMMEDIATE")
        try:
            row = db.execute("SELECT revoked_at FROM keys WHERE name = ?", (name,)).fetchone()
            if row is not None and row[0] is None:
                raise ValueError(f"key {name!r} exists; revoke it first or pick another name")
            db.execute(
                "INSERT OR REPLACE INTO keys VALUES (?, ?, ?, ?, NULL, ?, ?, ?)",
                (name, f"key_{digest[:12]}", digest, time.time(), rpm, tpm, max_concurrent),
            )
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
    return secret


def list_keys(path: Path) -> list[KeyInfo]:
    """Every key in ``path``, revoked ones included, oldest first; FileNotFoundError if it is missing."""
    with contextlib.closing(_existing(path)) as db:
        rows = db.execute(
            "SELECT name, key_id, created_at, revoked_at, rpm, tpm, max_concurrent FROM keys ORDER BY created_at, name"
        ).fetchall()
    return [KeyInfo(*row) for row in rows]


def revoke_key(path: Path, name: str) -> bool:
    """Revoke the key named ``name``; False if there is no such active key. FileNotFoundError if ``path`` is missing."""
    with contextlib.closing(_existing(path)) as db:
        cursor = db.execute("UPDATE keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL", (time.time(), name))
        return cursor.rowcount > 0


def _active(db: sqlite3.Connection) -> dict[str, ApiKey]:
    rows = db.execute("SELECT hash, name, key_id, rpm, tpm, max_concurrent FROM keys WHERE revoked_at IS NULL")
    return {digest: ApiKey(*rest) for digest, *rest in rows}


class KeyStore:
    """The active keys of a key file, in memory, re-read within ``refresh`` seconds of a change.

    A change is noticed cheaply (``PRAGMA data_version`` and the file's inode) before the table
    is read again. A failed re-read is logged once and the keys already loaded stay in use.
    """

    def __init__(self, path: Path, *, refresh: float = 1.0) -> None:
        self._path = path
        self._refresh = refresh
        self._keys: dict[str, ApiKey] = {}
        self._db: sqlite3.Connection | None = None
        self._fingerprint: tuple[int, int] = (-1, -1)
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._failing = False

    async def open(self) -> None:
        """Load the keys (creating an empty file if missing) and start watching the file.

        StartError naming ``keys_path`` when the file cannot be opened or read.
        """
        try:
            await asyncio.to_thread(self._reload)
        except (sqlite3.Error, OSError) as exc:
            raise StartError([Problem("keys_path", f"cannot use the key file {self._path}: {exc}")]) from None
        self._task = asyncio.create_task(self._watch(), name="iop-edge-keys")

    async def aclose(self) -> None:
        """Stop watching (after a re-read under way: it uses the connection) and close the file."""
        self._closing.set()
        if self._task is not None:
            await self._task
            self._task = None
        if self._db is not None:
            self._db.close()
            self._db = None

    def authenticate(self, token: str) -> ApiKey | None:
        """The active key whose secret is ``token``, else None.

        A dict lookup by SHA-256: no secret is compared, so there is no timing side channel to
        close with ``hmac.compare_digest``.
        """
        if len(token) > _MAX_TOKEN_CHARS or not token.startswith(SECRET_PREFIX):
            return None
        return self._keys.get(_hash(token))

    def __len__(self) -> int:
        """Active keys."""
        return len(self._keys)

    def _reload(self) -> bool:
        """Re-read the table if the file changed (runs in a thread); whether it did.

        The file is created only by :meth:`open`: one deleted later is an error (logged, the
        loaded keys kept), not an empty key file that would lock every client out.
        """
        first = self._fingerprint[1] == -1
        if self._db is None:
            self._db = _connect(self._path) if first else _existing(self._path)
        inode = os.stat(self._path).st_ino
        if not first and inode != self._fingerprint[1]:  # replaced: read the new file
            self._db.close()
            self._db = None
            self._db = _existing(self._path)
        version: int = self._db.execute("PRAGMA data_version").fetchone()[0]
        if (version, inode) == self._fingerprint:
            return False
        self._keys = _active(self._db)
        self._fingerprint = (version, inode)
        return True

    async def _watch(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self._refresh)
                return
            try:
                changed = await asyncio.to_thread(self._reload)
            except (sqlite3.Error, OSError) as exc:
                if not self._failing:
                    _log.error("keys_reload_failed", path=str(self._path), error=str(exc), keys=len(self._keys))
                self._failing = True
                continue
            if self._failing:
                _log.info("keys_reload_recovered", path=str(self._path))
                self._failing = False
            if changed:
                _log.info("keys_reloaded", path=str(self._path), keys=len(self._keys))


class LimitExceeded(Exception):
    """A key is at one of its limits: answer 429 with ``Retry-After``."""

    def __init__(self, message: str, *, retry_after: float, limit: str) -> None:
        super().__init__(message)
        self.message = message
        """One line for the client, naming the key and the limit."""
        self.retry_after = retry_after
        """Seconds (> 0) until the request would be let through, all else unchanged."""
        self.limit = limit
        """Which limit: ``rpm``, ``tpm`` or ``max_concurrent``."""


_WINDOW = 60.0  # seconds: rpm and tpm are per minute
_BUCKET = 0.1  # events this close together share one entry: a window holds at most 600 entries
_BUSY_RETRY = 1.0  # seconds to suggest when max_concurrent is reached: a request's end is unknown


@dataclasses.dataclass(slots=True)
class _Entry:
    first: float
    last: float
    count: int


class _Window:
    """Counts over the last 60 s, as at most 600 entries however many events come.

    An entry leaves the window 60 s after its *last* event, so merged events are counted a little
    longer (up to 0.1 s), never shorter: the limit is never exceeded.
    """

    __slots__ = ("entries", "total")

    def __init__(self) -> None:
        self.entries: collections.deque[_Entry] = collections.deque()
        self.total = 0

    def add(self, now: float, count: int) -> None:
        if self.entries:
            entry = self.entries[-1]
            now = max(now, entry.last)  # entries stay in time order whatever clock the caller passed
            if now - entry.first < _BUCKET:
                entry.last, entry.count = now, entry.count + count
                self.total += count
                return
        self.entries.append(_Entry(now, now, count))
        self.total += count

    def prune(self, now: float) -> None:
        while self.entries and self.entries[0].last <= now - _WINDOW:
            self.total -= self.entries.popleft().count

    def wait(self, now: float, limit: int) -> float:
        """Seconds until the total is below ``limit`` (after :meth:`prune`)."""
        remaining = self.total
        for entry in self.entries:
            remaining -= entry.count
            if remaining < limit:
                return entry.last + _WINDOW - now
        return 0.0  # unreachable while total >= limit >= 1


@dataclasses.dataclass(slots=True)
class _KeyState:
    touched: float
    in_progress: int = 0
    requests: _Window = dataclasses.field(default_factory=_Window)
    tokens: _Window = dataclasses.field(default_factory=_Window)

    def idle(self) -> bool:
        return self.in_progress == 0 and not self.requests.entries and not self.tokens.entries


class Lease:
    """One admitted request; :meth:`release` it when the request ends, however it ends."""

    __slots__ = ("_limiter", "_name", "_state")

    def __init__(self, limiter: Limiter | None, name: str, state: _KeyState | None) -> None:
        self._limiter = limiter
        self._name = name
        self._state = state

    def release(self, tokens: int = 0, *, now: float | None = None) -> None:
        """Free the request's slot and count ``tokens`` (prompt + completion) against tpm; idempotent."""
        state, self._state = self._state, None
        if state is not None and self._limiter is not None:
            self._limiter._release(self._name, state, max(tokens, 0), time.monotonic() if now is None else now)


_FREE = Lease(None, "", None)  # the lease of a key without limits: nothing to release


class Limiter:
    """Per-key rpm, tpm and max_concurrent over sliding 60-second windows, for one event loop.

    tpm counts the tokens of finished requests: a request is admitted while the last minute's
    tokens are below tpm, so one long request may overshoot it. A key's state is dropped once it
    is idle (nothing in progress, nothing in the last minute): memory follows the active keys.
    Keys without limits cost nothing.
    """

    def __init__(self) -> None:
        # Least recently touched first, so the idle states are swept from the front.
        self._states: collections.OrderedDict[str, _KeyState] = collections.OrderedDict()

    def acquire(self, key: ApiKey, now: float | None = None) -> Lease:
        """Admit one request of ``key`` or raise :class:`LimitExceeded` (the longest wait of the limits hit)."""
        if not key.limited:
            return _FREE
        now = time.monotonic() if now is None else now
        self._sweep(now)
        state = self._states.get(key.name) or _KeyState(now)
        state.requests.prune(now)
        state.tokens.prune(now)
        refusals = _refusals(key, state, now)
        if refusals:
            raise max(refusals, key=lambda refusal: refusal.retry_after)
        state.in_progress += 1
        if key.rpm is not None:
            state.requests.add(now, 1)
        self._touch(key.name, state, now)
        return Lease(self, key.name, state)

    def in_progress(self, key_name: str) -> int:
        """Requests of the key in progress (0 for keys without limits: they are not tracked)."""
        state = self._states.get(key_name)
        return 0 if state is None else state.in_progress

    def __len__(self) -> int:
        """Keys with state kept."""
        return len(self._states)

    def _release(self, name: str, state: _KeyState, tokens: int, now: float) -> None:
        state.in_progress -= 1
        if tokens:
            state.tokens.add(now, tokens)
        state.requests.prune(now)
        state.tokens.prune(now)
        if self._states.get(name) is not state:
            return
        if state.idle():
            del self._states[name]
        else:
            self._touch(name, state, now)

    def _touch(self, name: str, state: _KeyState, now: float) -> None:
        state.touched = max(state.touched, now)
        self._states[name] = state
        self._states.move_to_end(name)

    def _sweep(self, now: float) -> None:
        """Drop the states untouched for a window; those still in progress go to the back."""
        for _ in range(len(self._states)):
            name, state = next(iter(self._states.items()))
            if state.touched > now - _WINDOW - _BUCKET:
                return
            del self._states[name]
            state.requests.prune(now)
            state.tokens.prune(now)
            if not state.idle():
                self._touch(name, state, now)


def _refusals(key: ApiKey, state: _KeyState, now: float) -> list[LimitExceeded]:
    found: list[LimitExceeded] = []
    if key.max_concurrent is not None and state.in_progress >= key.max_concurrent:
        found.append(
            LimitExceeded(
                f"key {key.name!r} has {state.in_progress} requests in progress, its limit (max_concurrent)",
                retry_after=_BUSY_RETRY,
                limit="max_concurrent",
            )
        )
    if key.rpm is not None and state.requests.total >= key.rpm:
        found.append(
            LimitExceeded(
                f"key {key.name!r} is at its limit of {key.rpm} requests per minute (rpm)",
                retry_after=state.requests.wait(now, key.rpm),
                limit="rpm",
            )
        )
    if key.tpm is not None and state.tokens.total >= key.tpm:
        found.append(
            LimitExceeded(
                f"key {key.name!r} is at its limit of {key.tpm} tokens per minute (tpm)",
                retry_after=state.tokens.wait(now, key.tpm),
                limit="tpm",
            )
        )
    return found
