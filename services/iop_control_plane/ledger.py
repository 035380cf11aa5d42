"""The run ledger: every run the control-plane placed or refused, with each attempt, in SQLite.

A run's row is built in memory while it runs (:class:`LedgerEntry`) and handed to the audit
store's writer when it ends, which commits it with whatever else is queued in one transaction,
off the path that relays events. Rows beyond ``max_runs`` are pruned, oldest first.

A run in progress has a row in ``open_runs`` (written when it is received, its node set when
it is placed), deleted in the transaction that writes its ledger row: a run that starts and
ends within one commit window writes neither. Rows still open when the control-plane starts
were in flight when it stopped without ending them (killed, crashed): :func:`recover` moves
them to the ledger as ``interrupted``. Every string is clipped (:mod:`iop_control_plane.text`). Read by
``runs.list`` (admin; ``iop runs ls/show --control-plane``) from a connection of its own, in a
thread: a long query never blocks the event loop or the writer (WAL).
"""

from __future__ import annotations

import datetime
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from iop_control_plane.text import TEXT_CHARS, clip
from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = ["MAX_LIST", "STATUSES", "Attempt", "LedgerEntry", "insert", "opened", "placed", "prune", "query", "recover"]

STATUSES = ("completed", "failed", "cancelled", "interrupted")
"""A run's final status in the ledger."""
MAX_LIST = 1000
"""Most runs one runs.list returns."""
_DEFAULT_LIST = 50

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, requester TEXT NOT NULL, connection TEXT NOT NULL,
    caller TEXT NOT NULL, model TEXT NOT NULL, node_id TEXT NOT NULL, status TEXT NOT NULL,
    error_code INTEGER NOT NULL, error_message TEXT NOT NULL, received_at REAL NOT NULL,
    ttft REAL, duration REAL NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    usage_estimated INTEGER NOT NULL, finish_reason INTEGER NOT NULL, outputs INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS runs_by_run_id ON runs (run_id);
CREATE TABLE IF NOT EXISTS run_attempts (
    run INTEGER NOT NULL, attempt INTEGER NOT NULL, node_id TEXT NOT NULL, model TEXT NOT NULL,
    outcome TEXT NOT NULL, reason TEXT NOT NULL, started_after REAL NOT NULL, duration REAL NOT NULL,
    PRIMARY KEY (run, attempt));
CREATE INDEX IF NOT EXISTS run_attempts_by_node ON run_attempts (node_id);
CREATE TABLE IF NOT EXISTS open_runs (
    id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, requester TEXT NOT NULL, connection TEXT NOT NULL,
    caller TEXT NOT NULL, model TEXT NOT NULL, received_at REAL NOT NULL,
    node_id TEXT NOT NULL DEFAULT '', node_model TEXT NOT NULL DEFAULT '', attempt INTEGER NOT NULL DEFAULT 0,
    placed_after REAL NOT NULL DEFAULT 0);
"""
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
    recorded: bool | None = None
    """Whether the ledger takes the run, decided when it starts (the write backlog may be full); None before."""
    open_row: int | None = None
    """Its row in ``open_runs`` once the writer committed it (the writer's thread alone sets and reads it)."""

    def ending(self, event: pb.RunEvent | None, cancel_reason: str = "") -> None:
        """Take the status from the run's terminal event; None: cancelled (by the requester, or its connection)."""
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


def opened(db: sqlite3.Connection, entry: LedgerEntry) -> None:
    """Note a run in progress in ``open_runs`` (inside the caller's transaction)."""
    cursor = db.execute(
        "INSERT INTO open_runs (run_id, requester, connection, caller, model, received_at) VALUES (?, ?, ?, ?, ?, ?)",
        (*_names(entry), entry.received_at),
    )
    entry.open_row = cursor.lastrowid


def placed(db: sqlite3.Connection, entry: LedgerEntry, attempt: int, at: Attempt) -> None:
    """Note in ``open_runs`` the node of the run's attempt number ``attempt``."""
    if entry.open_row is not None:
        update = "UPDATE open_runs SET node_id = ?, node_model = ?, attempt = ?, placed_after = ? WHERE id = ?"
        db.execute(update, (clip(at.node_id), clip(at.model), attempt, at.started - entry.received, entry.open_row))


def insert(db: sqlite3.Connection, entry: LedgerEntry) -> None:
    """Write one run and its attempts, and close its row in ``open_runs`` (inside the caller's transaction)."""
    usage = entry.usage or pb.Usage()
    ttft = None if entry.first_output is None else entry.first_output - entry.received
    node_id = entry.attempts[-1].node_id if entry.attempts else ""
    cursor = db.execute(
        "INSERT INTO runs VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            *_names(entry),
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
        ),
    )
    db.executemany(
        "INSERT INTO run_attempts VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (
                cursor.lastrowid,
                number,
                clip(attempt.node_id),
                clip(attempt.model),
                attempt.outcome,
                clip(attempt.reason, TEXT_CHARS),
                attempt.started - entry.received,
                attempt.ended - attempt.started,
            )
            for number, attempt in enumerate(entry.attempts, 1)
        ],
    )
    if entry.open_row is not None:
        db.execute("DELETE FROM open_runs WHERE id = ?", (entry.open_row,))


def recover(db: sqlite3.Connection) -> int:
    """Move the runs left in ``open_runs`` to the ledger as ``interrupted``; how many (at start, one transaction)."""
    with db:
        rows = db.execute("SELECT * FROM open_runs ORDER BY id").fetchall()
        for _, *names, received_at, node_id, node_model, attempt, placed_after in rows:
            where = f"; attempt {attempt} on node {node_id}" if node_id else "; not yet placed"
            cursor = db.execute(
                "INSERT INTO runs VALUES (NULL, ?, ?, ?, ?, ?, ?, 'interrupted', ?, ?, ?, NULL, 0, 0, 0, 0, 0, 0)",
                (*names, node_id, pb.ERROR_CODE_UNAVAILABLE, _INTERRUPTED + where, received_at),
            )
            if node_id:
                row = (cursor.lastrowid, attempt, node_id, node_model, "interrupted", _INTERRUPTED, placed_after)
                db.execute("INSERT INTO run_attempts VALUES (?, ?, ?, ?, ?, ?, ?, 0)", row)
        db.execute("DELETE FROM open_runs")
    return len(rows)


def _names(entry: LedgerEntry) -> tuple[str, ...]:
    """(run id, requester, connection, caller, model), each clipped."""
    return tuple(clip(name) for name in (entry.run_id, entry.requester, entry.connection, entry.caller, entry.model))


def prune(db: sqlite3.Connection, keep: int) -> int:
    """Delete all but the newest ``keep`` runs; how many went."""
    (newest,) = db.execute("SELECT COALESCE(MAX(id), 0) FROM runs").fetchone()
    cut = newest - keep
    if cut <= 0:
        return 0
    db.execute("DELETE FROM run_attempts WHERE run <= ?", (cut,))
    return db.execute("DELETE FROM runs WHERE id <= ?", (cut,)).rowcount


def query(path: Path, request: pb.RunsList) -> pb.RunsListed:
    """The runs ``request`` asks for, newest first, from a read-only connection of its own.

    ValueError (one line) for a status that is not one of :data:`STATUSES`.
    """
    if request.status and request.status not in STATUSES:
        raise ValueError(f"unknown status {request.status!r}; valid: {', '.join(STATUSES)}")
    where, params = [], list[object]()
    for column in ("run_id", "status", "model"):
        if value := getattr(request, column):
            where.append(f"{column} = ?")
            params.append(value)
    if request.HasField("since"):
        where.append("received_at >= ?")
        params.append(request.since.ToNanoseconds() / 1e9)
    if request.node_id:
        where.append("id IN (SELECT run FROM run_attempts WHERE node_id = ?)")
        params.append(request.node_id)
    limit = min(request.limit or _DEFAULT_LIST, MAX_LIST)
    clauses = f"WHERE {' AND '.join(where)}" if where else ""
    sql = f"SELECT * FROM runs {clauses} ORDER BY id DESC LIMIT ?"  # noqa: S608 - fixed clauses; values bound
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute(sql, (*params, limit + 1)).fetchall()
        runs = [_run(db, row) for row in rows[:limit]]
    finally:
        db.close()
    return pb.RunsListed(runs=runs, more=len(rows) > limit)


def _run(db: sqlite3.Connection, row: tuple[object, ...]) -> pb.LedgerRun:
    (id_, run_id, requester, connection, caller, model, node_id, status, code, message, received_at, ttft,
     duration, prompt, completion, estimated, finish, outputs) = row  # fmt: skip
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
        usage=pb.Usage(prompt_tokens=_int(prompt), completion_tokens=_int(completion), estimated=bool(estimated)),
        finish_reason=pb.FinishReason.ValueType(_int(finish)),
        outputs=_int(outputs),
    )
    run.received_at.FromNanoseconds(int(_float(received_at) * 1e9))
    if ttft is not None:
        run.ttft.FromTimedelta(datetime.timedelta(seconds=_float(ttft)))
    run.duration.FromTimedelta(datetime.timedelta(seconds=_float(duration)))
    attempts = db.execute("SELECT * FROM run_attempts WHERE run = ? ORDER BY attempt", (id_,))
    for _, _, node, attempt_model, outcome, reason, started_after, took in attempts:
        attempt = run.attempts.add(node_id=node, model=attempt_model, outcome=outcome, reason=reason)
        attempt.started_after.FromTimedelta(datetime.timedelta(seconds=started_after))
        attempt.duration.FromTimedelta(datetime.timedelta(seconds=took))
    return run


def _int(value: object) -> int:
    assert isinstance(value, int)
    return value


def _float(value: object) -> float:
    assert isinstance(value, int | float)
    return float(value)
