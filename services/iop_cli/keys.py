"""``iop keys create|ls|revoke``: the edge's API keys.

The store is ``--store-url postgresql://...`` (shared by edges), else ``--db FILE``, else
``store.url`` or ``keys_path`` of ``--config edge.yaml``, else of ``DIR/edge.yaml`` for ``--dir
DIR`` (default ``$IOP_STATE_DIR`` or ``.iop``), else ``DIR/edge-keys.db``. ``create`` makes a key
file when missing; ``ls`` and ``revoke`` refuse a missing file (exit 2). Running edges see every
change within about a second.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from iop_cli.output import CliError, emit, table, warn
from iop_cli.shell import state_file
from iop_edge.key_storage import STORE_ERRORS, KeyInfo, KeyStorage, SchemaTooNew
from iop_edge.keys import check_limits, check_name, create_key, digest, list_keys, new_secret, revoke_key
from iop_edge.pg_keys import PgKeyStorage
from iop_edge.settings import ConfigError, load_settings

__all__ = ["create", "ls", "revoke"]

_HEADERS = ("NAME", "KEY ID", "CREATED", "RPM", "TPM", "MAX-CONCURRENT", "ADMIN", "STATUS")
T = TypeVar("T")


def create(args: argparse.Namespace) -> int:
    """Create a key and print its secret (stdout, alone on its line); it is never shown again."""
    limits = {"rpm": args.rpm, "tpm": args.tpm, "max_concurrent": args.max_concurrent}
    admin = bool(args.admin)
    url = _store_url(args)
    if url is not None:
        try:
            check_name(args.name)
            check_limits(args.rpm, args.tpm, args.max_concurrent)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        secret = new_secret()
        _in_store(url, "write", lambda store: store.create(args.name, digest(secret), **limits, admin=admin))
        where = PgKeyStorage(url).name
    else:
        path, _ = _key_file(args)
        try:
            secret = create_key(path, args.name, **limits, admin=admin)
        except (ValueError, SchemaTooNew) as exc:
            raise CliError(str(exc)) from None
        except STORE_ERRORS as exc:
            raise CliError(f"cannot write the key file {path}: {exc}") from None
        where = str(path)
    print(secret)
    kind = "admin key" if admin else "key"
    warn("keys", f"{kind} {args.name} created in {where}; this is the only time it is shown")
    return 0


def ls(args: argparse.Namespace) -> int:
    """List the keys (never their secrets) as a table, or JSON with ``--json``."""
    url = _store_url(args)
    if url is not None:
        keys = _in_store(url, "read", lambda store: store.list_keys())
    else:
        path = _existing_file(args)
        try:
            keys = list_keys(path)
        except SchemaTooNew as exc:
            raise CliError(str(exc)) from None
        except STORE_ERRORS as exc:
            raise CliError(f"cannot read the key file {path}: {exc}") from None
    emit([_plain(key) for key in keys], as_json=args.json, text=_table(keys) if keys else "no keys")
    return 0


def revoke(args: argparse.Namespace) -> int:
    """Revoke a key: exit 1 if there is no active key of that name."""
    url = _store_url(args)
    if url is not None:
        revoked = _in_store(url, "write", lambda store: store.revoke(args.name))
    else:
        path = _existing_file(args)
        try:
            revoked = revoke_key(path, args.name)
        except SchemaTooNew as exc:
            raise CliError(str(exc)) from None
        except STORE_ERRORS as exc:
            raise CliError(f"cannot write the key file {path}: {exc}") from None
    if not revoked:
        raise CliError(f"no key {args.name!r}", 1)
    print(f"key {args.name} revoked")
    return 0


def _in_store(url: str, verb: str, work: Callable[[KeyStorage], Awaitable[T]]) -> T:
    """``work`` done on the PostgreSQL store at ``url``; CliError (one line) when it cannot be."""

    async def run() -> T:
        store = PgKeyStorage(url, max_connections=1, timeout=10.0)
        await store.open()
        try:
            return await work(store)
        finally:
            await store.aclose()

    try:
        return asyncio.run(run())
    except (ValueError, SchemaTooNew) as exc:
        raise CliError(" ".join(str(exc).split())) from None
    except STORE_ERRORS as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise CliError(f"cannot {verb} the key store {PgKeyStorage(url).name}: {message}") from None


def _store_url(args: argparse.Namespace) -> str | None:
    """``--store-url``, else ``store.url`` of the config (``--config``, ``DIR/edge.yaml``) unless ``--db`` is given."""
    if args.store_url is not None:
        if not args.store_url.startswith(("postgresql://", "postgres://")):
            raise CliError(f"--store-url must be a postgresql:// URL, not {args.store_url!r}")
        return str(args.store_url)
    if args.db is not None:
        return None
    config: Path | None = args.config
    if config is None and (args.dir / "edge.yaml").is_file():
        config = args.dir / "edge.yaml"
    if config is None:
        return None
    try:
        return load_settings(config).store.url
    except ConfigError as exc:
        raise CliError(f"bad config: {exc}") from None


def _key_file(args: argparse.Namespace) -> tuple[Path, str]:
    """The key file, and where that choice came from (for the message when it is missing)."""
    try:
        return state_file(
            args,
            config_name="edge.yaml",
            default="edge-keys.db",
            setting="keys_path",
            read=lambda config: load_settings(config).keys_path,
        )
    except ConfigError as exc:
        raise CliError(f"bad config: {exc}") from None


def _existing_file(args: argparse.Namespace) -> Path:
    path, source = _key_file(args)
    if not path.is_file():
        raise CliError(
            f"no key file at {path} ({source}); 'iop keys create NAME' makes one, "
            "or point at it with --db FILE, --config edge.yaml, --dir DIR or --store-url URL"
        )
    return path


def _table(keys: list[KeyInfo]) -> str:
    rows = [_HEADERS, *(_row(key) for key in keys)]
    return table(rows)


def _row(key: KeyInfo) -> tuple[str, ...]:
    limits = (str(value) if value is not None else "-" for value in (key.rpm, key.tpm, key.max_concurrent))
    status = "active" if key.revoked_at is None else "revoked"
    created = datetime.datetime.fromtimestamp(key.created_at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return (key.name, key.key_id, created, *limits, "yes" if key.admin else "no", status)


def _plain(key: KeyInfo) -> dict[str, object]:
    return {
        "name": key.name,
        "key_id": key.key_id,
        "created_at": _time(key.created_at),
        "revoked_at": None if key.revoked_at is None else _time(key.revoked_at),
        "rpm": key.rpm,
        "tpm": key.tpm,
        "max_concurrent": key.max_concurrent,
        "admin": key.admin,
        "status": "active" if key.revoked_at is None else "revoked",
    }


def _time(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()
