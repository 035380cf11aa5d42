"""``iop batches ls|show|cancel``: a worker's batch jobs, over IOP with the admin certificate.

Each command dials the worker (``--worker HOST:PORT``; default ``$IOP_WORKER``, else the port in
the state folder's ``worker.ready`` (what ``iop up`` started), else ``127.0.0.1:7402``) the way
``iop_cli.ops`` dials the control-plane: ``--certs DIR`` (default the state folder's ``certs``),
``--server-name`` (default ``localhost``), one request, its answer printed. ``show`` prints a
batch's status and line counts and, while its lines run, a progress bar with the rate since they
started and an ETA.

Exit codes as ``iop_cli.ops``: 0 done; 1 the worker refused (an unknown batch, or a cancel of
one that has ended); 2 it could not be asked (unreachable, certificate refused, a file missing).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from iop_cli.ops import ask, iso
from iop_cli.output import CliError, emit, table, warn
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.messages import BATCH_TIMES
from iop_wire.openai import batches as rules

__all__ = ["batches_cancel", "batches_ls", "batches_show"]

_BAR = 20


def batches_ls(args: argparse.Namespace) -> int:
    """The newest batches, as a table or JSON."""
    if not 1 <= args.limit <= rules.BATCHES_PAGE.maximum:
        raise CliError(f"--limit must be from 1 to {rules.BATCHES_PAGE.maximum}, not {args.limit}", 2)
    listed = _ask(args, pb.Envelope(batches_list=pb.BatchesList(limit=args.limit))).batches_listed
    batches = [batch_dict(batch) for batch in listed.batches]
    emit(batches, as_json=args.json, text=_table(batches))
    if listed.has_more:
        warn("batches", f"showing the newest {args.limit}; more exist (--limit N shows more)")
    return 0


def batches_show(args: argparse.Namespace) -> int:
    """One batch: status, counts and, while it runs, its progress."""
    info = _batch(args, pb.Envelope(batch_get=pb.BatchGet(batch_id=args.batch_id)))
    batch = batch_dict(info)
    if args.json:
        print(json.dumps(batch, indent=2))
        return 0
    counts = batch["request_counts"]
    for key in ("id", "status", "endpoint", "input_file_id", "output_file_id", "error_file_id", *BATCH_TIMES):
        if batch[key] is not None:
            print(f"{key}: {batch[key]}")
    done = counts["completed"] + counts["failed"]
    print(f"requests: {done}/{counts['total']} done ({counts['completed']} completed, {counts['failed']} failed)")
    for error in batch["errors"]:
        where = f"line {error['line']}: " if error["line"] is not None else ""
        print(f"error: {where}{error['code']}: {error['message']}")
    if batch["status"] == "in_progress":
        started = info.in_progress_at.ToNanoseconds() / 1e9 if info.HasField("in_progress_at") else None
        print(progress(done, counts["total"], None if started is None else time.time() - started))
    return 0


def batches_cancel(args: argparse.Namespace) -> int:
    """Stop a batch: no new lines start, running ones are cancelled."""
    batch = batch_dict(_batch(args, pb.Envelope(batch_cancel=pb.BatchCancel(batch_id=args.batch_id))))
    counts = batch["request_counts"]
    done = f"{counts['completed'] + counts['failed']} of {counts['total']} lines done"
    if batch["status"] in rules.ENDED - {"cancelled"}:
        raise CliError(f"batch {batch['id']} already {batch['status']} ({done}); nothing to cancel", 1)
    print(f"batch {batch['id']} {batch['status']} ({done})")
    return 0


def _ask(args: argparse.Namespace, envelope: pb.Envelope) -> pb.Envelope:
    return ask(args, envelope, service="worker")


def _batch(args: argparse.Namespace, envelope: pb.Envelope) -> pb.BatchInfo:
    try:
        return _ask(args, envelope).batch_info
    except CliError as exc:
        if exc.error != pb.ERROR_CODE_NOT_FOUND:
            raise
        raise CliError(f"no batch {args.batch_id!r} on the worker at {args.worker}", 1, error=exc.error) from None


def batch_dict(batch: pb.BatchInfo) -> dict[str, Any]:
    """A batch as OpenAI's batch object names its fields (times as ISO 8601, UTC)."""
    return {
        "id": batch.id,
        "status": rules.STATUS_NAMES[batch.status],
        "endpoint": batch.endpoint,
        "input_file_id": batch.input_file_id,
        "output_file_id": batch.output_file_id or None,
        "error_file_id": batch.error_file_id or None,
        "completion_window": batch.completion_window,
        **{name: _time(batch, name) for name in BATCH_TIMES},
        "request_counts": {
            "total": batch.request_counts.total,
            "completed": batch.request_counts.completed,
            "failed": batch.request_counts.failed,
        },
        "errors": [
            {
                "code": e.code,
                "message": e.message,
                "param": e.param or None,
                "line": e.line if e.HasField("line") else None,
            }
            for e in batch.errors
        ],
        "metadata": dict(batch.metadata),
        "usage": {"prompt_tokens": batch.usage.prompt_tokens, "completion_tokens": batch.usage.completion_tokens},
    }


def progress(done: int, total: int, elapsed: float | None) -> str:
    """``[#####.....] 452/1000 45%  38 lines/s  ETA 14s``: the rate over ``elapsed`` seconds."""
    share = done / total if total else 0.0
    filled = round(share * _BAR)
    line = f"[{'#' * filled}{'.' * (_BAR - filled)}] {done}/{total} {share:.0%}"
    if not elapsed or elapsed <= 0 or not done:
        return line + "  ETA -"
    rate = done / elapsed
    return f"{line}  {rate:.0f} lines/s  ETA {_duration((total - done) / rate)}"


def _duration(seconds: float) -> str:
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _time(batch: pb.BatchInfo, name: str) -> str | None:
    timestamp = getattr(batch, name)
    return iso(timestamp.ToNanoseconds() / 1e9) if timestamp.seconds or timestamp.nanos else None  # unset: zero


def _table(batches: list[dict[str, Any]]) -> str:
    if not batches:
        return "no batches"
    header = ("ID", "STATUS", "ENDPOINT", "DONE", "FAILED", "CREATED")
    rows = [header]
    for batch in batches:
        counts = batch["request_counts"]
        done = f"{counts['completed'] + counts['failed']}/{counts['total']}"
        created = (batch["created_at"] or "-")[:19] + ("Z" if batch["created_at"] else "")
        rows.append((batch["id"], batch["status"], batch["endpoint"], done, str(counts["failed"]), created))
    return table(rows)
