"""``iop usage``: token usage per API key (caller) and model, per UTC hour or day, from a control-plane.

Asks the control-plane's usage.list over IOP with the admin certificate, as ``iop nodes`` does
(:func:`iop_cli.ops.ask`: the same options, exit codes and one-line errors), grouped by key and
model, and prints one row per bucket, key and model, oldest first, then a total line. ``--since``
is an ISO time or a duration back from now (default: 24 hours for ``--by hour``, 7 days for
``--by day``); a bad one is one line naming it, exit 2.
"""

from __future__ import annotations

import argparse
from typing import Any

from iop_cli.ops import ask, iso
from iop_cli.output import CliError, emit, table
from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = ["usage"]

_BUCKETS = {"hour": pb.USAGE_BUCKET_HOUR, "day": pb.USAGE_BUCKET_DAY}
_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "failed", "estimated")


def usage(args: argparse.Namespace) -> int:
    """Print the usage ``args`` ask for, as a table with a total line or as JSON."""
    query = pb.UsageList(
        bucket=_BUCKETS[args.by], caller=args.key or "", model=args.model or "", by_caller=True, by_model=True
    )
    if args.since:
        from iop_node.history import parse_since  # here: the other commands start without the services'

        try:
            query.start.FromDatetime(parse_since(args.since))
        except ValueError as exc:
            raise CliError(f"--since: {exc}", 2) from None
    listed = ask(args, pb.Envelope(usage_list=query)).usage_listed
    rows = [_row(entry) for entry in listed.entries]
    totals = {count: sum(row[count] for row in rows) for count in _COUNTS}
    emit({"bucket": args.by, "rows": rows, "totals": totals}, as_json=args.json, text=_table(rows, totals))
    return 0


def _row(entry: pb.UsageEntry) -> dict[str, Any]:
    return {
        "start": iso(entry.start.seconds),
        "key": entry.caller,
        "model": entry.model,
        **{count: getattr(entry, count) for count in _COUNTS},
    }


def _table(rows: list[dict[str, Any]], totals: dict[str, int]) -> str:
    if not rows:
        return "no usage"
    header: tuple[str, ...] = ("START", "KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "FAILED")
    lines = [header, *((row["start"][:16] + "Z", row["key"] or "-", row["model"], *_numbers(row)) for row in rows)]
    return table([*lines, ("TOTAL", "", "", *_numbers(totals))])


def _numbers(counts: dict[str, Any]) -> tuple[str, ...]:
    """REQUESTS, PROMPT, COMPLETION, FAILED; a ``~`` after the tokens when some of them are estimated."""
    mark = "~" if counts["estimated"] else ""
    return (
        str(counts["requests"]),
        f"{counts['prompt_tokens']}{mark}",
        f"{counts['completion_tokens']}{mark}",
        str(counts["failed"]),
    )
