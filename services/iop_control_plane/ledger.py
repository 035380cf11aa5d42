"""The run ledger: every run the control-plane placed or refused, with each attempt.

A run's row is built in memory while it runs (:class:`LedgerEntry`) and handed to the audit
store's writer when it ends, which commits it with whatever else is queued in one transaction,
off the path that relays events, and adds it to the usage rollup in that transaction
(:mod:`iop_control_plane.usage`). Rows beyond ``max_runs`` are pruned, oldest first. This module
builds the rows and reads them back; the SQL runs in the state store
(:mod:`iop_control_plane.state`: SQLite or PostgreSQL).

A run in progress has a row in ``open_runs`` (written when it is received, its node set when
it is placed, with the control-plane that holds it), deleted in the transaction that writes its
ledger row: a run that starts and ends within one commit window writes neither. Rows left open
by a control-plane that stopped without ending them (killed, crashed) are moved to the ledger as
``interrupted`` (:func:`interrupted`): at start for a SQLite file, and by any live replica once
that control-plane has been silent for a while in a shared store. Every string is clipped
(:mod:`iop_control_plane.text`). Read by ``runs.list`` (admin; ``iop runs ls/show
--control-plane``) off the event loop: a long query never blocks it or the writer.
"""

from __future__ import annotations

import datetime
import math
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iop_control_plane.text import TEXT_CHARS, clip
from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = [
    "ATTEMPT_COLUMNS",
    "MAX_LIST",
    "NEWEST_FIRST",
    "OPEN_COLUMNS",
    "RUN_COLUMNS",
    "SETTLED",
    "STATUSES",
    "Attempt",
    "LedgerEntry",
    "LeftOpen",
    "attempt_rows",
    "filters",
    "interrupted",
    "left_open",
    "names",
    "open_row",
    "placed_row",
    "query",
    "run_message",
    "run_row",
    "settle_attempt_sql",
    "settle_run_sql",
    "settled_rows",
]

STATUSES = ("completed", "failed", "cancelled", "interrupted")
"""A run's final status in the ledger."""
MAX_LIST = 1000
"""Most runs one runs.list returns."""
NEWEST_FIRST = "received_at DESC, id DESC"
"""runs.list's order: by arrival, so that paging by ``before`` (the oldest arrival of a page) misses no run
that ended out of order (a long run received before a short one ends after it)."""
_DEFAULT_LIST = 50

SETTLED = ("completed", "failed", "cancelled")
"""The statuses a node's record of a run left open may put in the ledger in place of ``interrupted``."""

_INTERRUPTED = "the control-plane stopped while the run was in progress"


@dataclass(slots=True)
class Attempt:
    """One node a run was tried on."""

    node_id: str
    model: str
    started: float
    """time.monotonic() when it was placed."""
    outcome: str = "failed"
    """completed, failed, node_lost or cancelled."""
    reason: str = ""
    ended: float = 0.0
    outputs: int = 0
    """Deltas it relayed to the requester."""
    continued: bool = False
    """Whether it continued output earlier attempts delivered (its request carried a continuation)."""
    continuation_prompt_tokens: int = 0
    """Its migration's cost: delivered tokens it re-read as prompt (the node's count, else the estimate sent)."""
    gap: float | None = None
    """Seconds from the last output before the previous attempt was lost to its first output (migrations)."""


@dataclass(slots=True)
class LedgerEntry:
    """A run being served; recorded once it ends."""

    run_id: str
    requester: str
    connection: str
    caller: str
    model: str
    received_at: float = field(default_factory=time.time)
    received: float = field(default_factory=time.monotonic)
    attempts: list[Attempt] = field(default_factory=list)
    status: str = "failed"
    error_code: int = 0
    error_message: str = ""
    first_output: float | None = None
    """time.monotonic() of the first delta relayed."""
    ended: float = 0.0
    usage: pb.Usage | None = None
    finish_reason: int = 0
    outputs: int = 0
    migrations: int = 0
    """Times it was continued on another node after its node was lost mid-stream."""
    prompt_estimate: int = 0
    """Its prompt's tokens as the control-plane estimated them (the usage of a run its node did not count)."""
    recorded: bool | None = None
    """Whether the ledger takes the run, decided when it starts (the write backlog may be full); None before."""
    open_row: int | None = None
    """Its row in ``open_runs`` once the writer committed it (the writer's thread alone sets and reads it)."""

    def ending(self, event: pb.RunEvent | None, cancel_reason: str = "") -> None:
        """Take the status and usage from the run's terminal event; None: cancelled (by the requester, or its
        connection). A run placed on a node whose end carries no count of its tokens (cancelled here before
        its node answered, its node lost, the node's deadline passed) gets the control-plane's estimate:
        the prompt's, and one token per delta relayed, flagged estimated (for a run its requester cancelled,
        until its node's count comes: :meth:`counted`)."""
        self._take(event, cancel_reason)
        if self.usage is None and self.attempts:
            self.usage = pb.Usage(prompt_tokens=self.prompt_estimate, completion_tokens=self.outputs, estimated=True)

    def counted(self, event: pb.RunEvent) -> bool:
        """Take the usage its node counted from the terminal event of the attempt its requester cancelled
        (:mod:`iop_control_plane.cancelled`): the error's, or the complete's if the run finished meanwhile.
        False when the event carries none (made here: the node's connection closed)."""
        if event.WhichOneof("event") == "complete" and event.complete.HasField("usage"):
            self.usage = event.complete.usage
        elif event.WhichOneof("event") == "error" and event.error.HasField("usage"):
            self.usage = event.error.usage
        else:
            return False
        return True

    def _take(self, event: pb.RunEvent | None, cancel_reason: str) -> None:
        self.ended = time.monotonic()
        if event is None:
            self.status, self.error_code = "cancelled", pb.ERROR_CODE_CANCELLED
            self.error_message = cancel_reason or "cancelled"
        elif event.WhichOneof("event") == "complete":
            self.status, self.usage = "completed", event.complete.usage
            self.finish_reason = event.complete.finish_reason
        else:
            self.error_code, self.error_message = event.error.code, event.error.message
            self.status = "cancelled" if event.error.code == pb.ERROR_CODE_CANCELLED else "failed"
            if event.error.HasField("usage"):  # what the run used before it ended, as its node counted it
                self.usage = event.error.usage


RUN_COLUMNS = (
    "run_id, requester, connection, caller, model, node_id, status, error_code, error_message, received_at, "
    "ttft, duration, prompt_tokens, completion_tokens, usage_estimated, finish_reason, outputs, migrations, "
    "cached_tokens"
)
ATTEMPT_COLUMNS = (
    "run, attempt, node_id, model, outcome, reason, started_after, duration, outputs, continued, "
    "continuation_prompt_tokens, gap"
)
OPEN_COLUMNS = "run_id, requester, connection, caller, model, received_at, node_id, node_model, attempt, placed_after"


def open_row(entry: LedgerEntry, owner: str) -> tuple[object, ...]:
    """``open_runs`` (run_id, requester, connection, caller, model, received_at, owner) of a run received."""
    return (*names(entry), entry.received_at, owner)


def placed_row(entry: LedgerEntry, attempt: int, at: Attempt) -> tuple[object, ...]:
    """``open_runs`` (node_id, node_model, attempt, placed_after) of a run's attempt placed."""
    return (clip(at.node_id), clip(at.model), attempt, at.started - entry.received)


def run_row(entry: LedgerEntry) -> tuple[object, ...]:
    """A ended run's ``runs`` row, in :data:`RUN_COLUMNS` order."""
    usage = entry.usage or pb.Usage()
    ttft = None if entry.first_output is None else entry.first_output - entry.received
    node_id = entry.attempts[-1].node_id if entry.attempts else ""
    return (
        *names(entry),
        clip(node_id),
        entry.status,
        entry.error_code,
        clip(entry.error_message, TEXT_CHARS),
        entry.received_at,
        ttft,
        entry.ended - entry.received,
        usage.prompt_tokens,
        usage.completion_tokens,
        int(usage.estimated),
        entry.finish_reason,
        entry.outputs,
        entry.migrations,
        usage.cached_tokens,
    )


def attempt_rows(entry: LedgerEntry) -> list[tuple[object, ...]]:
    """Its ``run_attempts`` rows without the run's id (:data:`ATTEMPT_COLUMNS` after ``run``)."""
    return [
        (
            number,
            clip(attempt.node_id),
            clip(attempt.model),
            attempt.outcome,
            clip(attempt.reason, TEXT_CHARS),
            attempt.started - entry.received,
            attempt.ended - attempt.started,
            attempt.outputs,
            int(attempt.continued),
            attempt.continuation_prompt_tokens,
            attempt.gap,
        )
        for number, attempt in enumerate(entry.attempts, 1)
    ]


def interrupted(row: tuple[Any, ...]) -> tuple[tuple[object, ...], tuple[object, ...] | None]:
    """The ``runs`` row (and attempt row without the run's id) of an ``open_runs`` row in
    :data:`OPEN_COLUMNS` order, left open by a control-plane that stopped."""
    *run_names, received_at, node_id, node_model, attempt, placed_after = row
    where = f"; attempt {attempt} on node {node_id}" if node_id else "; not yet placed"
    run = (*run_names, node_id, "interrupted", pb.ERROR_CODE_UNAVAILABLE, _INTERRUPTED + where, received_at,
           None, 0.0, 0, 0, 0, 0, 0, 0, 0)  # fmt: skip
    tried = (attempt, node_id, node_model, "interrupted", _INTERRUPTED, placed_after, 0.0, 0, 0, 0, None)
    return run, tried if node_id else None


@dataclass(frozen=True, slots=True)
class LeftOpen:
    """A run left open by a control-plane that stopped, recorded ``interrupted`` as its ``runs`` row ``row``."""

    row: int
    """Its row in ``runs``."""
    node_id: str
    """The node of its last attempt; empty if it was never placed."""
    attempt: int
    """That attempt's number."""
    node_run_id: str
    """The id that attempt had on the node (the relay's ``<connection>.<run id>.<attempt>``)."""


def left_open(row_id: int, row: Sequence[Any]) -> LeftOpen:
    """The run an ``open_runs`` row (:data:`OPEN_COLUMNS` order) recorded interrupted as ``runs`` row ``row_id``."""
    run_id, _, connection, *_, node_id, _, attempt, _ = row
    node_id = node_id or ""
    return LeftOpen(row_id, node_id, attempt or 0, f"{connection}.{run_id}.{attempt}" if node_id else "")


def settle_run_sql(mark: Callable[[int], str]) -> str:
    """The UPDATE that puts a node's record (:func:`settled_rows`) in place of an interrupted ``runs`` row:
    only while it is interrupted, only for the node of its last attempt (run again, it changes nothing),
    and not when the run has another row."""
    columns = ("status", "error_code", "error_message", "duration", "prompt_tokens", "completion_tokens",
               "usage_estimated", "finish_reason", "cached_tokens")  # fmt: skip
    sets = ", ".join(f"{column} = {mark(n)}" for n, column in enumerate(columns, 1))
    where = f"id = {mark(10)} AND node_id = {mark(11)} AND status = 'interrupted'"
    # Not a run opened again through another control-plane (the edge's failover before output) that has
    # a row of its own: that row is the run's record, as recovery decides (the client saw that attempt).
    again = (
        "NOT EXISTS (SELECT 1 FROM runs AS other WHERE other.run_id = runs.run_id AND other.requester = "
        "runs.requester AND other.caller = runs.caller AND other.id != runs.id)"
    )
    return f"UPDATE runs SET {sets} WHERE {where} AND {again}"  # noqa: S608 - fixed columns; values bound


def settle_attempt_sql(mark: Callable[[int], str]) -> str:
    """The UPDATE of the last attempt's row to its outcome on the node (once :func:`settle_run_sql` changed the run)."""
    where = f"run = {mark(3)} AND attempt = {mark(4)} AND node_id = {mark(5)} AND outcome = 'interrupted'"
    return f"UPDATE run_attempts SET outcome = {mark(1)}, reason = {mark(2)} WHERE {where}"  # noqa: S608


def settled_rows(left: LeftOpen, found: pb.LedgerRun) -> tuple[tuple[object, ...], tuple[object, ...]]:
    """The parameters of :func:`settle_run_sql` and :func:`settle_attempt_sql` for the node's record ``found``."""
    usage = found.usage
    message = clip(found.error_message, TEXT_CHARS)
    run = (found.status, found.error_code, message, found.duration.ToTimedelta().total_seconds(),
           usage.prompt_tokens, usage.completion_tokens, int(usage.estimated), found.finish_reason,
           usage.cached_tokens, left.row, left.node_id)  # fmt: skip
    attempt = (found.status, message, left.row, left.attempt, left.node_id)
    return run, attempt


def names(entry: LedgerEntry) -> tuple[str, ...]:
    """(run id, requester, connection, caller, model), each clipped."""
    return tuple(clip(name) for name in (entry.run_id, entry.requester, entry.connection, entry.caller, entry.model))


def filters(request: pb.RunsList, mark: Callable[[int], str]) -> tuple[str, list[object], int]:
    """``request``'s WHERE clause (placeholders from ``mark(n)``, n from 1), its values, and its limit.

    ValueError (one line) for a status that is not one of :data:`STATUSES`.
    """
    if request.status and request.status not in STATUSES:
        raise ValueError(f"unknown status {request.status!r}; valid: {', '.join(STATUSES)}")
    where, params = [], list[object]()
    for column in ("run_id", "status", "model", "caller"):
        if value := getattr(request, column):
            params.append(value)
            where.append(f"{column} = {mark(len(params))}")
    if request.HasField("since"):
        params.append(request.since.ToNanoseconds() / 1e9)
        where.append(f"received_at >= {mark(len(params))}")
    if request.HasField("before"):
        params.append(_below(request.before.ToNanoseconds()))
        where.append(f"received_at <= {mark(len(params))}")
    if request.node_id:
        params.append(request.node_id)
        where.append(f"id IN (SELECT run FROM run_attempts WHERE node_id = {mark(len(params))})")  # noqa: S608 - a placeholder
    limit = min(request.limit or _DEFAULT_LIST, MAX_LIST)
    return (f"WHERE {' AND '.join(where)}" if where else ""), params, limit


def _below(nanoseconds: int) -> float:
    """The largest ``received_at`` (float seconds, as stored) that a run shows as before ``nanoseconds``.

    A run's time is shown as ``int(received_at * 1e9)`` (:func:`run_message`); ``nanoseconds / 1e9``
    back is not always below the run it came from (1 in 30 times it rounds up), and the next page
    would start with the last run of the page before. Stepping to the float neighbour keeps
    ``int(x * 1e9) < nanoseconds`` exactly for every stored ``x <= `` the answer. At or before the
    epoch (a peer may ask for any Timestamp) nothing stored is earlier: -1.0, at once (the stepping
    would crawl through every float near zero: ``int`` truncates towards it).
    """
    if nanoseconds <= 0:
        return -1.0
    seconds = nanoseconds / 1e9
    while int(seconds * 1e9) >= nanoseconds:
        seconds = math.nextafter(seconds, -math.inf)
    while int((higher := math.nextafter(seconds, math.inf)) * 1e9) < nanoseconds:
        seconds = higher
    return seconds


def query(path: Path, request: pb.RunsList) -> pb.RunsListed:
    """The runs ``request`` asks for, newest first, from a read-only connection of its own to the
    SQLite file ``path``; ValueError (one line) for a status that is not one of :data:`STATUSES`."""
    clauses, params, limit = filters(request, lambda _: "?")
    sql = f"SELECT id, {RUN_COLUMNS} FROM runs {clauses} ORDER BY {NEWEST_FIRST} LIMIT ?"  # noqa: S608 - fixed clauses; values bound
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute(sql, (*params, limit + 1)).fetchall()
        attempts = f"SELECT {ATTEMPT_COLUMNS} FROM run_attempts WHERE run = ? ORDER BY attempt"  # noqa: S608
        runs = [run_message(row, db.execute(attempts, (row[0],)).fetchall()) for row in rows[:limit]]
    finally:
        db.close()
    return pb.RunsListed(runs=runs, more=len(rows) > limit)


def run_message(row: Sequence[object], attempts: Iterable[Sequence[Any]]) -> pb.LedgerRun:
    """A ``runs`` row (id, then :data:`RUN_COLUMNS`) and its attempts' rows as runs.list shows them."""
    (_, run_id, requester, connection, caller, model, node_id, status, code, message, received_at, ttft,
     duration, prompt, completion, estimated, finish, outputs, migrations, cached) = row  # fmt: skip
    run = pb.LedgerRun(
        run_id=str(run_id),
        requester=str(requester),
        connection=str(connection),
        caller=str(caller),
        model=str(model),
        node_id=str(node_id),
        status=str(status),
        error_code=pb.ErrorCode.ValueType(_int(code)),
        error_message=str(message),
        usage=pb.Usage(
            prompt_tokens=_int(prompt),
            completion_tokens=_int(completion),
            cached_tokens=_int(cached),
            estimated=bool(estimated),
        ),
        finish_reason=pb.FinishReason.ValueType(_int(finish)),
        outputs=_int(outputs),
        migrations=_int(migrations),
    )
    run.received_at.FromNanoseconds(int(_float(received_at) * 1e9))
    if ttft is not None:
        run.ttft.FromTimedelta(datetime.timedelta(seconds=_float(ttft)))
    run.duration.FromTimedelta(datetime.timedelta(seconds=_float(duration)))
    for _, _, node, attempt_model, outcome, reason, started_after, took, *migrated in attempts:
        attempt = run.attempts.add(node_id=node, model=attempt_model, outcome=outcome, reason=reason)
        attempt.started_after.FromTimedelta(datetime.timedelta(seconds=started_after))
        attempt.duration.FromTimedelta(datetime.timedelta(seconds=took))
        outputs, continued, cost, gap = migrated
        attempt.outputs, attempt.continued, attempt.continuation_prompt_tokens = outputs, bool(continued), cost
        if gap is not None:
            attempt.gap.FromTimedelta(datetime.timedelta(seconds=gap))
    return run


def _int(value: object) -> int:
    assert isinstance(value, int)
    return value


def _float(value: object) -> float:
    assert isinstance(value, int | float)
    return float(value)
