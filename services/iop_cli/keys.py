"""``iop keys create|ls|revoke``: the edge's API keys.

The key file is ``--db FILE``, else ``keys_path`` of ``--config edge.yaml``, else that of
``DIR/edge.yaml`` for ``--dir DIR`` (default ``$IOP_STATE_DIR`` or ``.iop``), else
``DIR/edge-keys.db``. ``create`` makes the file when missing; ``ls`` and ``revoke`` refuse a
missing file (exit 2). A running edge sees every change within about a second.
"""

from __future__ import annotations

import argparse
import datetime
import sqlite3
from pathlib import Path

from iop_cli.output import CliError, emit, table, warn
from iop_cli.shell import state_file
from iop_edge.keys import KeyInfo, create_key, list_keys, revoke_key
from iop_edge.settings import ConfigError, load_settings

__all__ = ["create", "ls", "revoke"]

_HEADERS = ("NAME", "KEY ID", "CREATED", "RPM", "TPM", "MAX-CONCURRENT", "STATUS")


def create(args: argparse.Namespace) -> int:
    """Create a key and print its secret (stdout, alone on its line); it is never shown again."""
    path, _ = _key_file(args)
    try:
        secret = create_key(path, args.name, rpm=args.rpm, tpm=args.tpm, max_concurrent=args.max_concurrent)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    except (sqlite3.Error, OSError) as exc:
        raise CliError(f"cannot write the key file {path}: {exc}") from None
    print(secret)
    warn("keys", f"key {args.name} created in {path}; this is the only time it is shown")
    return 0


def ls(args: argparse.Namespace) -> int:
    """List the keys (never their secrets) as a table, or JSON with ``--json``."""
    path = _existing_file(args)
    try:
        keys = list_keys(path)
    except (sqlite3.Error, OSError) as exc:
        raise CliError(f"cannot read the key file {path}: {exc}") from None
    emit([_plain(key) for key in keys], as_json=args.json, text=_table(keys) if keys else "no keys")
    return 0


def revoke(args: argparse.Namespace) -> int:
    """Revoke a key: exit 1 if there is no active key of that name."""
    path = _existing_file(args)
    try:
        revoked = revoke_key(path, args.name)
    except (sqlite3.Error, OSError) as exc:
        raise CliError(f"cannot write the key file {path}: {exc}") from None
    if not revoked:
        raise CliError(f"no key {args.name!r}", 1)
    print(f"key {args.name} revoked")
    return 0


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
            "or point at it with --db FILE, --config edge.yaml or --dir DIR"
        )
    return path


def _table(keys: list[KeyInfo]) -> str:
    rows = [_HEADERS, *(_row(key) for key in keys)]
    return table(rows)


def _row(key: KeyInfo) -> tuple[str, ...]:
    limits = (str(value) if value is not None else "-" for value in (key.rpm, key.tpm, key.max_concurrent))
    status = "active" if key.revoked_at is None else "revoked"
    created = datetime.datetime.fromtimestamp(key.created_at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return (key.name, key.key_id, created, *limits, status)


def _plain(key: KeyInfo) -> dict[str, object]:
    return {
        "name": key.name,
        "key_id": key.key_id,
        "created_at": _time(key.created_at),
        "revoked_at": None if key.revoked_at is None else _time(key.revoked_at),
        "rpm": key.rpm,
        "tpm": key.tpm,
        "max_concurrent": key.max_concurrent,
        "status": "active" if key.revoked_at is None else "revoked",
    }


def _time(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()
