"""Token usage per caller, model and UTC hour or day: the rollup the ledger's writer keeps, and usage.list.

Every run recorded in the ledger adds to one row of ``usage_hours`` and one of ``usage_days``
(keyed by the bucket's start, caller and model as requested; the bucket is the run's
``received_at``), in the transaction that writes its ``runs`` row: the writer sums its batch
per key first and upserts each key once, so a batch of runs costs one statement per table, not
one per run. The rollup is exact (completed, failed, cancelled and interrupted runs alike) and
outlives the ledger's pruning: a year of hourly rows for 100 callers of 10 models is under 9
million small rows, where the runs they sum would be billions. A run left open and later
settled from its node's record moves its tokens and status into the rollup then (:func:`delta`).

usage.list reads the rows of the buckets asked for, summed over what is not grouped; at most
:data:`MAX_ENTRIES` rows and :data:`MAX_BYTES` of names (the answer fits the 4 MiB frame), else
ValueError naming the way out: a month by hour for 10 keys of 4 models is 28,800 rows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from iop_control_plane.text import NAME_CHARS
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.continuation import STOPPED_CODES

__all__ = [
    "HOUR",
    "MAX_ENTRIES",
    "MAX_SPAN",
    "TABLES",
    "UNKNOWN",
    "UsageRow",
    "delta",
    "handed_on",
    "listed",
    "rollup",
    "run_usage",
    "select",
    "upsert_sql",
    "usage_model",
]

HOUR, DAY = 3600, 86400
TABLES = (("usage_hours", HOUR), ("usage_days", DAY))
"""Each rollup table and its bucket's width in seconds."""
MAX_ENTRIES = 50_000
"""Most rows one usage.listed carries (about 60 bytes each with short names)."""
MAX_BYTES = 3 << 20
"""Most bytes of rows one usage.listed carries, counting each row's names and 64 bytes for the rest:
inside the 4 MiB frame whatever the names' length (up to 256 characters each)."""
MAX_SPAN = {HOUR: 31 * DAY + HOUR, DAY: 400 * DAY}
"""The longest range one usage.list may ask for, per bucket width (a month by hour, about a year by day):
one request reads at most 745 hours' or 400 days' rows, never years of them."""
UNKNOWN = "(unknown)"
"""The model the rollup and the overview count a run under when it was refused for its model (no node
serves it, or its name is over the limit): any key may name thousands of models that do not exist, and
each would otherwise stay a row of its own for ever. Its ledger row keeps the name asked for (clipped)."""
_DEFAULT_SPAN = {HOUR: 24 * HOUR, DAY: 7 * DAY}
"""How far back an unset start is, per bucket width."""
_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "failed", "estimated")
_COLUMNS = ("start", "caller", "model", *_COUNTS)

UsageRow = tuple[int, str, str, int, int, int, int, int, int]
"""A rollup row: (bucket start, caller, model, requests, prompt, completion, cached, failed, estimated)."""


def upsert_sql(table: str, mark: Callable[[int], str]) -> str:
    """The statement that adds one :data:`UsageRow` to ``table`` (placeholders from ``mark(n)``)."""
    values = ", ".join(mark(n) for n in range(1, len(_COLUMNS) + 1))
    adds = ", ".join(f"{column} = {table}.{column} + excluded.{column}" for column in _COUNTS)
    return (
        f"INSERT INTO {table} ({', '.join(_COLUMNS)}) VALUES ({values}) "  # noqa: S608 - fixed names; values bound
        f"ON CONFLICT (start, caller, model) DO UPDATE SET {adds}"
    )


def usage_model(model: str, error_code: int, node_id: str) -> str:
    """The model a run is counted under in the rollup and the overview: :data:`UNKNOWN` for a run never
    placed because no node serves its model (MODEL_NOT_FOUND) or whose model's name is over the limit
    (its ledger row holds it clipped: longer than NAME_CHARS), else ``model``."""
    refused = error_code == pb.ERROR_CODE_MODEL_NOT_FOUND and not node_id
    return UNKNOWN if refused or len(model) > NAME_CHARS else model


def handed_on(row: Sequence[Any]) -> bool:
    """Whether a ``runs`` row is a run this control-plane gave back unplaced for its requester to open on
    another replica: never placed on a node (no tokens), and ended UNAVAILABLE or SHUTTING_DOWN (refused
    retryably: no node yet, the control-plane stopping; or ``interrupted`` before placement, the
    control-plane gone). An edge's failover opens that same run on another control-plane before any
    output, which counts it: counted here too, the key's one request would be two."""
    node_id, error_code = row[5], row[7]
    return not node_id and error_code in STOPPED_CODES  # the codes an edge's failover reopens on


def run_usage(row: Sequence[Any]) -> tuple[float, str, str, int, int, int, int, int]:
    """What a ``runs`` row (in ``ledger.RUN_COLUMNS`` order) adds to the rollup: (received_at, caller, model,
    prompt, completion, cached, failed, estimated)."""
    caller, node_id, status, error_code, received_at = row[3], row[5], row[6], row[7], row[9]
    model = usage_model(row[4], error_code, node_id)
    prompt, completion, estimated, cached = row[12], row[13], row[14], row[18]
    return (received_at, caller, model, prompt, completion, cached, int(status != "completed"), int(estimated))


def rollup(runs: Sequence[Sequence[Any]]) -> list[tuple[str, list[UsageRow]]]:
    """What ``runs`` (``runs`` rows) add to each table of :data:`TABLES`: (table, rows summed per bucket start,
    caller and model, in key order: replicas upserting the same keys take their row locks in one order, as
    two orders deadlock in PostgreSQL). A run :func:`handed_on` to another replica adds nothing."""
    usages = [run_usage(run) for run in runs if not handed_on(run)]
    return [(table, _summed(usages, width)) for table, width in TABLES]


def _summed(usages: list[tuple[float, str, str, int, int, int, int, int]], width: int) -> list[UsageRow]:
    sums: dict[tuple[int, str, str], list[int]] = {}
    for received_at, caller, model, prompt, completion, cached, failed, estimated in usages:
        key = (int(received_at // width) * width, caller, model)
        total = sums.get(key)
        if total is None:
            sums[key] = [1, prompt, completion, cached, failed, estimated]
            continue
        total[0] += 1
        total[1] += prompt
        total[2] += completion
        total[3] += cached
        total[4] += failed
        total[5] += estimated
    return [(*key, *total) for key, total in sorted(sums.items())]  # type: ignore[misc] # 9 fields by construction


def delta(before: Sequence[Any], after: Sequence[Any], width: int) -> UsageRow:
    """The row that turns ``before``'s share of the rollup into ``after``'s (one run's two ``runs`` rows,
    the same run received at the same time): a run left open, settled from its node's record."""
    old, new = run_usage(before), run_usage(after)
    received_at, caller, model = new[:3]
    changes = [b - a for a, b in zip(old[3:], new[3:], strict=True)]
    return (int(received_at // width) * width, caller, model, 0, *changes)  # type: ignore[return-value]


def select(request: pb.UsageList, mark: Callable[[int], str], now: float | None = None) -> tuple[str, list[object]]:
    """The query for ``request`` (placeholders from ``mark(n)``) and its values; ValueError (one line) for a
    start not before its end. Its rows: (start, caller, model, sums of :data:`_COUNTS`), ``MAX_ENTRIES + 1`` at most."""
    width = DAY if request.bucket == pb.USAGE_BUCKET_DAY else HOUR
    table = "usage_days" if width == DAY else "usage_hours"
    end = request.end.ToNanoseconds() / 1e9 if request.HasField("end") else (now or time.time())
    start = request.start.ToNanoseconds() / 1e9 if request.HasField("start") else end - _DEFAULT_SPAN[width]
    if start >= end:
        raise ValueError(f"start ({start:.0f}) must be before end ({end:.0f})")
    if end - start > MAX_SPAN[width]:
        most = "31 days and an hour by hour" if width == HOUR else "400 days by day"
        raise ValueError(
            f"start ({start:.0f}) is {(end - start) / DAY:.1f} days before end ({end:.0f}), over the most one "
            f"usage.list reads ({most}): ask for a later start{', or days' if width == HOUR else ''}"
        )
    params: list[object] = [int(start // width) * width, math.ceil(end)]  # whole seconds: the column's type
    where = [f"start >= {mark(1)}", f"start < {mark(2)}"]
    for column in ("caller", "model"):
        if value := getattr(request, column):
            params.append(value)
            where.append(f"{column} = {mark(len(params))}")
    params.append(MAX_ENTRIES + 1)
    limit, found = f"LIMIT {mark(len(params))}", " AND ".join(where)
    if request.by_caller and request.by_model:  # the table's own rows, in its key's order: nothing to sum
        sql = f"SELECT {', '.join(_COLUMNS)} FROM {table} WHERE {found} ORDER BY start, caller, model {limit}"  # noqa: S608
        return sql, params
    caller = "caller" if request.by_caller else "''"
    model = "model" if request.by_model else "''"
    groups = ", ".join(["start"] + [c for c, by in (("caller", request.by_caller), ("model", request.by_model)) if by])
    sums = ", ".join(f"sum({column})" for column in _COUNTS)
    sql = (
        f"SELECT start, {caller}, {model}, {sums} FROM {table} WHERE {found} "  # noqa: S608 - fixed names
        f"GROUP BY {groups} ORDER BY {groups} {limit}"
    )
    return sql, params


def listed(rows: Sequence[Any]) -> pb.UsageListed:
    """The answer from :func:`select`'s rows; ValueError when they are more than :data:`MAX_ENTRIES`."""
    size = sum(len(row[1].encode()) + len(row[2].encode()) + 64 for row in rows)
    if len(rows) > MAX_ENTRIES or size > MAX_BYTES:
        what = f"more than {MAX_ENTRIES} rows" if len(rows) > MAX_ENTRIES else f"{len(rows)} rows of long names"
        raise ValueError(
            f"{what} of usage: ask for a shorter window, days instead of hours, or fewer groups (by caller, by model)"
        )
    answer = pb.UsageListed()
    add = answer.entries.add
    for start, caller, model, requests, prompt, completion, cached, failed, estimated in rows:
        # Field by field, the zeros left out: a third faster than add(**fields) (a month by hour is 28,800 rows).
        entry = add()
        entry.start.seconds = start
        if caller:
            entry.caller = caller
        if model:
            entry.model = model
        entry.requests, entry.prompt_tokens, entry.completion_tokens = int(requests), int(prompt), int(completion)
        if cached:
            entry.cached_tokens = int(cached)
        if failed:
            entry.failed = int(failed)
        if estimated:
            entry.estimated = int(estimated)
    return answer
