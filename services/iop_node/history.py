"""What ``iop runs ls`` and ``iop runs show ID`` print: the run history read back and formatted.

A history reader never changes rows: it opens the store without marking running rows interrupted
(those rows may belong to a node that is still running).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Sequence

from iop_node.domain import RunRecord

__all__ = ["format_record", "format_table", "parse_since"]

_UTC = datetime.UTC
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+)([smhd])")
_SINCE_FORMS = "an ISO 8601 time (2026-05-01T12:00:00, naive means UTC) or a duration like 30s, 10m, 2h, 7d"
_HEADERS = ("RUN ID", "MODEL", "PEER", "ADAPTER", "STATUS", "ERROR", "RECEIVED", "TTFT (ms)", "DURATION (ms)", "TOKENS")
_ERROR_WIDTH = 40
_UNKNOWN = "-"


def parse_since(text: str, now: datetime.datetime | None = None) -> datetime.datetime:
    """A point in time from an ISO 8601 datetime (naive means UTC) or a duration before ``now``."""
    text = text.strip()
    try:
        if match := _DURATION.fullmatch(text):
            back = datetime.timedelta(seconds=int(match[1]) * _UNIT_SECONDS[match[2]])
            return _aware(now or datetime.datetime.now(_UTC)) - back
        return _aware(datetime.datetime.fromisoformat(text))
    except (ValueError, OverflowError):
        raise ValueError(f"cannot read since {text!r}: use {_SINCE_FORMS}") from None


def format_table(records: Sequence[RunRecord]) -> str:
    """A fixed-width table of runs with a header line, or ``no runs``."""
    if not records:
        return "no runs"
    rows = [_HEADERS, *(_table_row(record) for record in records)]
    widths = [max(len(row[column]) for row in rows) for column in range(len(_HEADERS))]
    lines = ("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)


def format_record(record: RunRecord) -> str:
    """Every field of a run as ``key: value`` lines, then derived timings, then the stderr tail indented."""
    lines = [
        f"{field.name}: {_value(getattr(record, field.name))}"
        for field in dataclasses.fields(record)
        if field.name != "stderr_tail"
    ]
    lines += [f"ttft_ms: {_ttft_ms(record)}", f"duration_ms: {_duration_ms(record)}"]
    if not record.stderr_tail:
        return "\n".join([*lines, f"stderr_tail: {_UNKNOWN}"])
    tail = ["    " + line for line in record.stderr_tail.splitlines()]
    return "\n".join([*lines, "stderr_tail:", *tail])


def _table_row(record: RunRecord) -> tuple[str, ...]:
    error = record.error_code or record.error_message
    if len(error) > _ERROR_WIDTH:
        error = error[: _ERROR_WIDTH - 3] + "..."
    received = record.received_at.astimezone(_UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if record.received_at else _UNKNOWN
    tokens = f"{record.prompt_tokens}/{record.completion_tokens}" + ("~" if record.usage_estimated else "")
    return (
        record.run_id,
        record.model,
        record.peer or _UNKNOWN,
        record.adapter or _UNKNOWN,
        record.status.value,
        error or _UNKNOWN,
        received,
        _ttft_ms(record),
        _duration_ms(record),
        tokens,
    )


def _ttft_ms(record: RunRecord) -> str:
    return _milliseconds(record.started_at, record.first_token_at)


def _duration_ms(record: RunRecord) -> str:
    return _milliseconds(record.received_at, record.finished_at)


def _milliseconds(start: datetime.datetime | None, end: datetime.datetime | None) -> str:
    if start is None or end is None:
        return _UNKNOWN
    return str(round((end - start).total_seconds() * 1000))


def _value(value: object) -> str:
    if isinstance(value, datetime.datetime):
        return value.astimezone(_UTC).isoformat()
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, ensure_ascii=False) if value else _UNKNOWN
    text = str(value) if value is not None else ""
    return text or _UNKNOWN


def _aware(moment: datetime.datetime) -> datetime.datetime:
    """The same moment in UTC; a naive datetime is taken as UTC."""
    return moment.replace(tzinfo=_UTC) if moment.tzinfo is None else moment.astimezone(_UTC)
