"""The console's JSON (and CSV) shapes, made from the control-plane's answers.

Pure functions of protobuf messages (no I/O): times are unix seconds (float), durations
milliseconds, an unset time or duration is null. The shapes are the console API's
(``/console/api/*``); the OpenAI usage shape is :mod:`iop_edge.usage_api`'s.
"""

from __future__ import annotations

import csv
import datetime
import io
from collections.abc import Iterable, Sequence
from typing import Any

from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = [
    "CSV_COLUMNS",
    "NODE_STATES",
    "grouped",
    "milliseconds",
    "node_view",
    "nodes_view",
    "overview_view",
    "run_view",
    "seconds",
    "summed_overview",
    "usage_csv",
]

NODE_STATES = {
    pb.NODE_STATE_READY: "ready",
    pb.NODE_STATE_DRAINING: "draining",
    pb.NODE_STATE_UNAVAILABLE: "unavailable",
}
_FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
    pb.FINISH_REASON_CONTENT_FILTER: "content_filter",
}
CSV_COLUMNS = ("start", "key", "model", "requests", "prompt_tokens", "completion_tokens", "cached_tokens", "failed")
_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "failed")


def seconds(timestamp: Any) -> float | None:
    """A set ``google.protobuf.Timestamp`` as unix seconds; None when unset (zero)."""
    if not timestamp.seconds and not timestamp.nanos:
        return None
    return float(timestamp.seconds) + float(timestamp.nanos) / 1e9


def milliseconds(message: Any, name: str) -> float | None:
    """The ``google.protobuf.Duration`` field ``name`` of ``message`` in milliseconds; None when unset."""
    if not message.HasField(name):
        return None
    return round(float(getattr(message, name).ToNanoseconds()) / 1e6, 3)


def _rate(count: int, window: int) -> float:
    return round(count / window, 3) if window else 0.0


def _duration(target: Any, nanoseconds: float | None) -> None:
    if nanoseconds is not None:
        target.FromNanoseconds(round(nanoseconds))


def _weighted_p50(parts: Sequence[Any]) -> float | None:
    """The request-weighted mean of the parts' medians (nanoseconds); None when none has one."""
    weighted: list[tuple[int, int]] = [
        (int(part.requests), int(part.ttft_p50.ToNanoseconds())) for part in parts if part.HasField("ttft_p50")
    ]
    total = sum(requests for requests, _ in weighted)
    if not weighted:
        return None
    if not total:
        return sum(p50 for _, p50 in weighted) / len(weighted)
    return sum(requests * p50 for requests, p50 in weighted) / total


def summed_overview(answers: Sequence[pb.OverviewShown]) -> pb.OverviewShown:
    """Several control-planes' overviews as one: counts summed, per model too; the TTFT median the
    request-weighted mean of theirs and the p95 the largest of theirs (percentiles do not add up:
    these are estimates, exact with one control-plane); ``control_plane`` names every one."""
    if len(answers) == 1:
        return answers[0]
    total = pb.OverviewShown(
        window_seconds=max(answer.window_seconds for answer in answers),
        control_plane=", ".join(answer.control_plane for answer in answers),
    )
    for name in ("requests", "failed", "prompt_tokens", "completion_tokens", "queued", "running"):
        setattr(total, name, sum(getattr(answer, name) for answer in answers))
    _duration(total.ttft_p50, _weighted_p50(answers))
    p95s = [answer.ttft_p95.ToNanoseconds() for answer in answers if answer.HasField("ttft_p95")]
    _duration(total.ttft_p95, max(p95s) if p95s else None)
    by_model: dict[str, list[pb.ModelTraffic]] = {}
    for answer in answers:
        for traffic in answer.models:
            by_model.setdefault(traffic.model, []).append(traffic)
    for model in sorted(by_model):
        parts = by_model[model]
        traffic = total.models.add(model=model)
        for name in ("requests", "failed", "completion_tokens", "queued", "running"):
            setattr(traffic, name, sum(getattr(part, name) for part in parts))
        _duration(traffic.ttft_p50, _weighted_p50(parts))
    return total


def overview_view(
    shown: pb.OverviewShown, nodes: Sequence[pb.NodeInfo], at: float, control_planes: Sequence[str] = ()
) -> dict[str, Any]:
    """``GET /console/api/overview``: the control-planes' traffic figures (summed, see
    :func:`summed_overview`), who answered, and the nodes' states."""
    window = shown.window_seconds or 60
    states = dict.fromkeys(("ready", "draining", "unavailable"), 0)
    serving: dict[str, int] = {}
    for node in nodes:
        state = NODE_STATES.get(node.state, "unavailable")
        states[state] += 1
        for load in node.models:
            if state == "ready":
                serving[load.model] = serving.get(load.model, 0) + 1
    models = [
        {
            "id": traffic.model,
            "nodes": serving.get(traffic.model, 0),
            "queued": traffic.queued,
            "running": traffic.running,
            "requests": traffic.requests,
            "failed": traffic.failed,
            "completion_tokens": traffic.completion_tokens,
            "ttft_p50_ms": milliseconds(traffic, "ttft_p50"),
        }
        for traffic in shown.models
    ]
    return {
        "at": at,
        "window_seconds": window,
        "control_plane": shown.control_plane,
        "control_planes": list(control_planes) or [shown.control_plane],
        "nodes": {**states, "total": len(nodes)},
        "requests_per_s": _rate(shown.requests, window),
        "completion_tokens_per_s": _rate(shown.completion_tokens, window),
        "prompt_tokens_per_s": _rate(shown.prompt_tokens, window),
        "ttft_p50_ms": milliseconds(shown, "ttft_p50"),
        "ttft_p95_ms": milliseconds(shown, "ttft_p95"),
        "queued": shown.queued,
        "running": shown.running,
        "failed": shown.failed,
        "error_rate": round(shown.failed / shown.requests, 4) if shown.requests else 0.0,
        "models": models,
    }


def node_view(node: pb.NodeInfo, now: float) -> dict[str, Any]:
    """One node of ``GET /console/api/nodes``."""
    heartbeat = seconds(node.last_heartbeat)
    return {
        "id": node.node_id,
        "state": NODE_STATES.get(node.state, "unavailable"),
        "reason": node.reason,
        "models": [{"id": load.model, "in_flight": load.in_flight, "capacity": load.capacity} for load in node.models],
        "in_flight": node.in_flight,
        "capacity": node.capacity,
        "heartbeat_age_s": None if heartbeat is None else round(max(now - heartbeat, 0.0), 3),
        "address": node.address,
        "labels": dict(node.labels),
        "first_seen": seconds(node.first_seen),
        "certificate_serial": node.certificate_serial,
    }


def nodes_view(nodes: Iterable[pb.NodeInfo], now: float) -> dict[str, Any]:
    """``GET /console/api/nodes``: every node, ordered by id."""
    return {"nodes": [node_view(node, now) for node in sorted(nodes, key=lambda node: node.node_id)]}


def run_view(run: pb.LedgerRun) -> dict[str, Any]:
    """One run of ``GET /console/api/runs``, as the ledger recorded it."""
    error = None
    if run.error_code or run.error_message:
        code = _error_code(run.error_code)
        error = {"code": code, "message": run.error_message}
    usage = run.usage
    return {
        "id": run.run_id,
        "caller": run.caller,
        "model": run.model,
        "node": run.node_id or None,
        "status": run.status,
        "error": error,
        "received_at": seconds(run.received_at),
        "ttft_ms": milliseconds(run, "ttft"),
        "duration_ms": milliseconds(run, "duration"),
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.cached_tokens,
        "estimated": usage.estimated,
        "finish_reason": _FINISH.get(run.finish_reason) if run.status == "completed" else None,
        "outputs": run.outputs,
        "migrations": run.migrations,
        "attempts": [
            {
                "node": attempt.node_id,
                "model": attempt.model,
                "outcome": attempt.outcome,
                "reason": attempt.reason,
                "started_ms": milliseconds(attempt, "started_after") or 0.0,
                "duration_ms": milliseconds(attempt, "duration"),
                "outputs": attempt.outputs,
            }
            for attempt in run.attempts
        ],
    }


def _error_code(number: pb.ErrorCode.ValueType) -> str:
    """An error code's name (``ERROR_CODE_OVERLOADED``: ``overloaded``); its number as text when
    this edge does not know it (a newer control-plane's)."""
    try:
        return pb.ErrorCode.Name(number).removeprefix("ERROR_CODE_").lower()
    except ValueError:
        return str(number)


def grouped(
    entries: Iterable[pb.UsageEntry], *, by_key: bool, by_model: bool, keys: frozenset[str] | None = None
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Usage rows (oldest first; by key, then model) summed over what is not grouped, and the totals.

    ``entries`` are the control-plane's, grouped by caller and model and in this order; ``keys``
    (None: every key's) keeps only those callers' entries. Each entry's fields are read once: a
    month by hour is some 26,000 entries, and reading each count by name twice into a dict per
    row took 250 ms of the edge's loop for them (about half of that now).
    """
    rows: dict[tuple[float, str, str], tuple[int, int, int, int, int]] = {}
    in_order, last = True, (-1.0, "", "")
    for entry in entries:
        caller = entry.caller
        if keys is not None and caller not in keys:
            continue
        stamp = entry.start
        group = (stamp.seconds + stamp.nanos / 1e9, caller if by_key else "", entry.model if by_model else "")
        counts = (entry.requests, entry.prompt_tokens, entry.completion_tokens, entry.cached_tokens, entry.failed)
        if (before := rows.get(group)) is not None:  # the control-plane groups them: only a defence
            counts = (
                before[0] + counts[0],
                before[1] + counts[1],
                before[2] + counts[2],
                before[3] + counts[3],
                before[4] + counts[4],
            )
        else:
            in_order = in_order and last < group  # the newest group so far: order is judged on new ones
            last = group
        rows[group] = counts
    listed = [
        {
            "start": start,
            "key": key if by_key else None,
            "model": model if by_model else None,
            "requests": requests,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "cached_tokens": cached,
            "failed": failed,
        }
        for (start, key, model), (requests, prompt, completion, cached, failed) in (
            rows.items() if in_order else sorted(rows.items())
        )
    ]
    totals = [sum(column) for column in zip(*rows.values(), strict=True)] if rows else [0] * len(_COUNTS)
    return listed, dict(zip(_COUNTS, totals, strict=True))


def _iso(start: float) -> str:
    return datetime.datetime.fromtimestamp(start, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _cell(text: str) -> str:
    """``text`` safe in a spreadsheet: a leading ``'`` when it would start a formula (key and model
    names are a caller's choice; ``=HYPERLINK(...)`` must stay text when the CSV is opened)."""
    return "'" + text if text.startswith(_FORMULA_STARTS) else text


def usage_csv(rows: Sequence[dict[str, Any]]) -> str:
    """The usage rows as CSV: a header line, then one line per row (start as ISO 8601 UTC); a name
    that would start a spreadsheet formula (= + - @ tab CR) gets a leading ``'``."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        cells = [_iso(row["start"]), _cell(row["key"] or ""), _cell(row["model"] or "")]
        writer.writerow([*cells, *(row[name] for name in _COUNTS)])
    return out.getvalue()
