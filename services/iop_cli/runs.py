"""``iop runs ls`` / ``iop runs show``: the node's run history, as a table or as JSON.

The history file is ``--db FILE``, else ``store_path`` of ``--config node.yaml``, else that of
``DIR/node.yaml`` for ``--dir DIR`` (default ``$IOP_STATE_DIR`` or ``.iop``, where ``iop up``
keeps it). Reading never changes a row.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from iop_cli.output import CliError, emit, warn
from iop_cli.shell import state_file
from iop_node.domain import RunRecord, RunStatus
from iop_node.history import format_record, format_table, parse_since
from iop_node.settings import ConfigError, load_settings
from iop_node.store import SqliteRunStore

__all__ = ["ls", "show"]


async def ls(args: argparse.Namespace) -> int:
    """List runs, newest first; says so when ``--limit`` cut the list short."""
    try:
        status = _status(args.status) if args.status else None
        since = parse_since(args.since) if args.since else None
        if args.limit < 1:
            raise CliError(f"--limit must be at least 1, not {args.limit}")
        async with _history(args) as store:
            records = await store.list(status=status, model=args.model, since=since, limit=args.limit + 1)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    shown = records[: args.limit]
    emit([_plain(record) for record in shown], as_json=args.json, text=format_table(shown))
    if len(records) > args.limit:
        warn("runs", f"showing the newest {args.limit} runs; more match (--limit N shows more)")
    return 0


async def show(args: argparse.Namespace) -> int:
    """Every field of one run."""
    try:
        async with _history(args) as store:
            record = await store.get(args.run_id)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if record is None:
        raise CliError(f"no run {args.run_id!r}", 1)
    emit(_plain(record), as_json=args.json, text=format_record(record))
    return 0


def _history_file(args: argparse.Namespace) -> tuple[Path, str]:
    """The history file to read, and where that choice came from (for the message when it is missing)."""
    try:
        return state_file(
            args,
            config_name="node.yaml",
            default="node-runs.db",
            setting="store_path",
            read=lambda config: load_settings(config).store_path,
        )
    except ConfigError as exc:
        raise CliError(f"bad config: {exc}") from None


@asynccontextmanager
async def _history(args: argparse.Namespace) -> AsyncIterator[SqliteRunStore]:
    path, source = _history_file(args)
    if not path.is_file():
        raise CliError(
            f"no run history at {path} ({source}); point at it with --db FILE, --config node.yaml "
            "or --dir DIR (the folder 'iop up' ran with; or set IOP_STATE_DIR)"
        )
    store = SqliteRunStore(path, node_id="")
    try:
        await store.open(mark_interrupted=False)
    except (sqlite3.Error, OSError, RuntimeError) as exc:
        raise CliError(f"cannot read the run history {path}: {exc}") from None
    try:
        yield store
    finally:
        await store.aclose()


def _status(text: str) -> RunStatus:
    try:
        return RunStatus(text)
    except ValueError:
        valid = ", ".join(status.value for status in RunStatus)
        raise CliError(f"unknown status {text!r}; valid: {valid}") from None


def _plain(record: RunRecord) -> dict[str, Any]:
    """A run as JSON-ready values: times in ISO 8601 (UTC), time to first token and duration in ms."""
    fields = {field.name: _json_value(getattr(record, field.name)) for field in dataclasses.fields(record)}
    return {
        **fields,
        "ttft_ms": _milliseconds(record.started_at, record.first_token_at),
        "duration_ms": _milliseconds(record.received_at, record.finished_at),
    }


def _json_value(value: object) -> object:
    if isinstance(value, datetime.datetime):
        return value.astimezone(datetime.UTC).isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _milliseconds(start: datetime.datetime | None, end: datetime.datetime | None) -> float | None:
    return None if start is None or end is None else round((end - start).total_seconds() * 1000, 3)
