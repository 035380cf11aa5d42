"""The edge's API keys: hashed secrets in a store, and the running edge's view of them.

``iop keys`` writes a key file with the sync functions (:func:`create_key`, :func:`list_keys`,
:func:`revoke_key`), or a PostgreSQL store through :func:`new_secret` and ``KeyStorage``; a
running edge reads the store with :class:`KeyStore`, which keeps every active key in memory and
re-reads them within ``refresh`` seconds of a change made by anyone (another edge, ``iop keys``).
A secret is ``sk-iop-`` and 43 random URL-safe characters; the store keeps only its SHA-256.
The per-key limits are in ``limits`` (one edge) and ``shared`` (edges sharing a store).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
from collections.abc import Iterator
from pathlib import Path

import structlog

from iop_edge.key_storage import STORE_ERRORS, ApiKey, KeyInfo, KeyStorage, SchemaTooNew
from iop_edge.limits import Lease, Limiter, LimitExceeded
from iop_edge.sqlite_keys import SqliteKeyStorage
from iop_wire.settings import Problem, StartError

__all__ = [
    "RESERVED_NAMES",
    "SECRET_PREFIX",
    "ApiKey",
    "KeyInfo",
    "KeyStore",
    "Lease",
    "LimitExceeded",
    "Limiter",
    "check_limits",
    "check_name",
    "create_key",
    "digest",
    "list_keys",
    "new_secret",
    "revoke_key",
]

_log = structlog.get_logger("iop.edge.keys")

SECRET_PREFIX = "sk-iop-"  # noqa: S105 - the public prefix of every secret, not a secret
_SECRET_BYTES = 32  # 43 URL-safe characters, 256 bits
_MAX_TOKEN_CHARS = 256  # longer bearer tokens are refused before hashing
_MAX_NAME_CHARS = 128
_LIMITS = ("rpm", "tpm", "max_concurrent")
_OPEN_ERRORS: tuple[type[Exception], ...] = (*STORE_ERRORS, ValueError)  # ValueError: a URL asyncpg cannot parse


def digest(secret: str) -> str:
    """The SHA-256 hex of a secret, as stored."""
    # A fast hash is right here: secrets are 256 random bits, so there is nothing to brute-force
    # and no need for a slow password hash (bcrypt, scrypt) that would cost every request.
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    """A new key's secret."""
    return SECRET_PREFIX + secrets.token_urlsafe(_SECRET_BYTES)


RESERVED_NAMES = frozenset({"anonymous"})
"""Names no key may take: ``anonymous`` is the caller of every request when keys are off (``auth: none``)."""


def check_name(name: str) -> None:
    """ValueError (one line) for a name that is empty, too long, has spaces or control characters,
    or is reserved (:data:`RESERVED_NAMES`)."""
    if not name or len(name) > _MAX_NAME_CHARS or any(ch.isspace() or not ch.isprintable() for ch in name):
        shown = repr(name[:40]) + (f" ({len(name)} characters)" if len(name) > 40 else "")  # never the whole of it
        raise ValueError(f"key name {shown} must be 1-{_MAX_NAME_CHARS} printable characters without spaces")
    if name in RESERVED_NAMES:
        raise ValueError(f"key name {name!r} is reserved (the caller of requests with auth: none); pick another")


def check_limits(rpm: int | None, tpm: int | None, max_concurrent: int | None) -> None:
    """ValueError (one line, naming the option) for a limit below 1."""
    for option, value in zip(_LIMITS, (rpm, tpm, max_concurrent), strict=True):
        if value is not None and value < 1:
            raise ValueError(f"--{option.replace('_', '-')} must be at least 1, not {value}")


def create_key(
    path: Path,
    name: str,
    *,
    rpm: int | None = None,
    tpm: int | None = None,
    max_concurrent: int | None = None,
    admin: bool = False,
) -> str:
    """Add a key named ``name`` to the key file ``path`` (created when missing) and return its secret.

    ``admin``: an admin key (the console's platform pages and actions, every caller's records).

    ValueError (one line) for a bad or reserved name, a limit below 1, or a name used before
    (even by a revoked key: records are kept by name).
    """
    check_name(name)
    check_limits(rpm, tpm, max_concurrent)
    secret = new_secret()
    with _file(path, create=True) as store:
        store.create_sync(name, digest(secret), rpm=rpm, tpm=tpm, max_concurrent=max_concurrent, admin=admin)
    return secret


def list_keys(path: Path) -> list[KeyInfo]:
    """Every key in ``path``, revoked ones included, oldest first; FileNotFoundError if it is missing."""
    with _file(path, create=False) as store:
        return store.list_sync()


def revoke_key(path: Path, name: str) -> bool:
    """Revoke the key named ``name``; False if there is no such active key. FileNotFoundError if ``path`` is missing."""
    with _file(path, create=False) as store:
        return store.revoke_sync(name)


@contextlib.contextmanager
def _file(path: Path, *, create: bool) -> Iterator[SqliteKeyStorage]:
    store = SqliteKeyStorage(path, create=create)
    store.open_sync()
    try:
        yield store
    finally:
        store.close()


class KeyStore:
    """The active keys of a store, in memory, re-read within ``refresh`` seconds of a change.

    A change is noticed cheaply (``KeyStorage.changes``: a counter, and for a file its inode)
    before the keys are read again. A failed read is logged once and the keys already loaded
    stay in use (a store that is away revokes nothing and locks nobody out).
    """

    def __init__(self, store: Path | KeyStorage, *, refresh: float = 0.5) -> None:
        """``store``: a key file's path (SQLite, created when missing), or an unopened store."""
        self.storage: KeyStorage = SqliteKeyStorage(store) if isinstance(store, Path) else store
        self._refresh = refresh
        self._keys: dict[str, ApiKey] = {}
        self._seen: object = None
        self._reading = asyncio.Lock()
        """One read at a time: a poll that began before a change must not put the older keys back after
        the :meth:`reload` that followed it."""
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self.failing = False
        """Whether the last read of the store failed (the keys loaded before are in use)."""

    async def open(self) -> None:
        """Open the store, load the keys and start watching.

        StartError naming ``keys_path`` or ``store.url`` when the store cannot be opened or read.
        """
        setting = "keys_path" if isinstance(self.storage, SqliteKeyStorage) else "store.url"
        what = "the key file" if setting == "keys_path" else "the key store"
        try:
            await self.storage.open()
            await self._reload()
        except SchemaTooNew as exc:
            await self.storage.aclose()
            raise StartError([Problem(setting, str(exc))]) from None
        except _OPEN_ERRORS as exc:
            await self.storage.aclose()
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise StartError([Problem(setting, f"cannot use {what} {self.storage.name}: {message}")]) from None
        self._task = asyncio.create_task(self._watch(), name="iop-edge-keys")

    async def aclose(self) -> None:
        """Stop watching (after a read under way: it uses the connection) and close the store."""
        self._closing.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self.storage.aclose()

    def authenticate(self, token: str) -> ApiKey | None:
        """The active key whose secret is ``token``, else None.

        A dict lookup by SHA-256: no secret is compared, so there is no timing side channel to
        close with ``hmac.compare_digest``.
        """
        if len(token) > _MAX_TOKEN_CHARS or not token.startswith(SECRET_PREFIX):
            return None
        return self._keys.get(digest(token))

    def __len__(self) -> int:
        """Active keys."""
        return len(self._keys)

    async def reload(self) -> None:
        """Re-read the keys now, after this edge changed them: a key made here works at once, a key
        revoked here stops at once (other edges notice within ``refresh``)."""
        await self._reload()

    async def _reload(self) -> bool:
        """Re-read the keys if they changed; whether they did."""
        async with self._reading:
            seen = await self.storage.changes()
            if seen == self._seen:
                return False
            self._keys = await self.storage.active()
            self._seen = seen
            return True

    async def _watch(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self._refresh)
                return
            try:
                changed = await self._reload()
            except STORE_ERRORS as exc:
                if not self.failing:
                    _log.error("keys_reload_failed", store=self.storage.name, error=str(exc), keys=len(self._keys))
                self.failing = True
                continue
            if self.failing:
                _log.info("keys_reload_recovered", store=self.storage.name)
                self.failing = False
            if changed:
                _log.info("keys_reloaded", store=self.storage.name, keys=len(self._keys))
