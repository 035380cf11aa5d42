"""The worker's job store: files, batches and batch lines, one interface over SQLite and PostgreSQL.

A batch's input lines are its unit of work. A worker *leases* lines (``lease``): each taken line
is marked with the worker's name and an expiry, and its ``attempts`` grows by one. The worker
keeps its leases alive (``renew``) while it runs the lines, then records each outcome
(``finish``). ``finish`` is fenced: it writes only while the line is still leased by that same
worker, so a worker that stalled past its expiry and lost the line to another writes nothing,
and every line ends in the output or error file exactly once. A worker that dies simply stops
renewing; once its leases expire, ``lease`` hands the lines to the others (counted in
``lease_takeovers``). Expiry is judged by the store's clock: PostgreSQL's for the shared store,
so machines with skewed clocks agree.

Lines are leased only from batches ``in_progress``, oldest batch first, in input order. Cancelling
a batch (``transition`` to ``cancelling``, then ``cancel_pending``) marks its unstarted lines
``cancelled``: never leased, neither completed nor failed (a cancelled batch keeps only the lines
that finished).

File contents are kept in chunks of at most :data:`CHUNK_SIZE` bytes, written and read one at a
time, so a 100 MB upload never needs one 100 MB row or buffer.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import secrets
import string
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

__all__ = [
    "CHUNK_SIZE",
    "OPEN_BATCH_STATUSES",
    "BatchRecord",
    "BatchStatus",
    "FileRecord",
    "JobStore",
    "LineKey",
    "LineRecord",
    "LineStatus",
    "RequestCounts",
    "Usage",
    "new_batch_id",
    "new_file_id",
]

CHUNK_SIZE = 1 << 20  # bytes in one stored chunk of a file's content
_ID_ALPHABET = string.ascii_letters + string.digits


def new_file_id() -> str:
    """A new file id: ``file-`` and 24 random letters and digits."""
    return "file-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def new_batch_id() -> str:
    """A new batch id: ``batch_`` and 24 random letters and digits."""
    return "batch_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


Outcome = tuple[str, int, "LineStatus", str, "Usage"]
"""A finished line: batch id, line, status, result and usage."""


class BatchStatus(enum.StrEnum):
    """A batch's status, as OpenAI names them."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


# What a restarted worker resumes: the batches not yet in a final status.
OPEN_BATCH_STATUSES = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.CANCELLING,
)


class LineStatus(enum.StrEnum):
    """A batch line's status."""

    PENDING = "pending"
    LEASED = "leased"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Usage(NamedTuple):
    """Token counts, summed over a batch's finished lines."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class RequestCounts(NamedTuple):
    """A batch's lines by outcome (OpenAI's request_counts, plus the cancelled ones)."""

    total: int
    completed: int
    failed: int
    cancelled: int = 0

    @property
    def unfinished(self) -> int:
        """Lines still pending or leased: the batch is done when this is 0."""
        return self.total - self.completed - self.failed - self.cancelled


LineKey = tuple[str, int]  # (batch_id, line)


@dataclasses.dataclass(frozen=True, slots=True)
class FileRecord:
    """An uploaded or generated file (its content is stored apart, in chunks)."""

    id: str
    filename: str
    purpose: str
    bytes: int
    """Size of the content; ``put_file`` returns the record with the size it wrote."""
    created_at: int
    """Unix seconds."""
    status: str = "processed"
    expires_at: int | None = None
    caller: str = ""
    """Whose it is: the caller the edge acted for (an API key's name); only that caller sees it."""


@dataclasses.dataclass(frozen=True, slots=True)
class BatchRecord:
    """A batch as OpenAI's Batch object shows it, less request_counts (``JobStore.counts``)."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    """Unix seconds, like every ``*_at`` field."""
    expires_at: int | None = None
    status: BatchStatus = BatchStatus.VALIDATING
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: tuple[dict[str, Any], ...] = ()
    """Batch-level errors, each ``{code, message, param, line}``."""
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    caller: str = ""
    """Whose it is (as ``FileRecord.caller``); its lines run with it as their caller."""
    usage: Usage = dataclasses.field(default_factory=Usage)
    """Summed by ``finish`` over the batch's finished lines."""


@dataclasses.dataclass(frozen=True, slots=True)
class LineRecord:
    """One input line of a batch: the request, its lease and its outcome."""

    batch_id: str
    line: int
    """0-based line number in the input file."""
    custom_id: str
    body: str
    """The request body, JSON text."""
    status: LineStatus = LineStatus.PENDING
    attempts: int = 0
    """How many times the line was leased."""
    lease_owner: str | None = None
    lease_expires: float | None = None
    """Unix seconds by the store's clock."""
    result: str | None = None
    """The output or error file's line, JSON text, once finished."""

    @property
    def key(self) -> LineKey:
        """The line's key, as ``renew`` and ``release`` take it."""
        return (self.batch_id, self.line)


class JobStore(Protocol):
    """Files, batches and their lines; ``SqliteJobStore`` and ``PgJobStore`` conform."""

    lease_takeovers: int
    """Lines this store's ``lease`` took from another owner whose lease had expired (a metric)."""

    async def open(self) -> None:
        """Connect, and create or check the schema."""
        ...

    async def aclose(self) -> None:
        """Close the connections."""
        ...

    async def put_file(self, record: FileRecord, chunks: AsyncIterable[bytes]) -> FileRecord:
        """Store a file's content as it arrives; the record with the size written."""
        ...

    async def get_file(self, file_id: str) -> FileRecord | None:
        """A stored file, or None."""
        ...

    async def list_files(
        self, *, after: str | None = None, limit: int = 20, purpose: str | None = None, caller: str | None = None
    ) -> tuple[list[FileRecord], bool]:
        """Files (of ``caller``; None: everyone's) newest first, after ``after``; and whether more follow."""
        ...

    def read_file(self, file_id: str) -> AsyncIterator[bytes]:
        """A file's content, chunk by chunk (nothing for an unknown file)."""
        ...

    async def drop_uploads(self, started_before: int) -> int:
        """Delete the files still being written that were started before ``started_before`` (unix
        seconds), with their content: uploads of a worker that died. How many."""
        ...

    async def delete_file(self, file_id: str) -> bool:
        """Delete a file and its content; whether it existed."""
        ...

    async def create_batch(self, batch: BatchRecord, lines: Sequence[LineRecord]) -> None:
        """Store a batch and its lines, in one transaction."""
        ...

    async def add_lines(self, lines: Sequence[LineRecord]) -> None:
        """Store more lines of a batch being validated, in one transaction; a line already stored is kept."""
        ...

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        """A batch, or None."""
        ...

    async def list_batches(
        self, *, after: str | None = None, limit: int = 20, caller: str | None = None
    ) -> tuple[list[BatchRecord], bool]:
        """Batches (of ``caller``; None: everyone's) newest first, after ``after``; and whether more follow."""
        ...

    async def update_batch(self, batch_id: str, **fields: Any) -> BatchRecord | None:
        """Set the named fields (see :data:`UPDATABLE`); the batch as it is now, or None."""
        ...

    async def transition(
        self, batch_id: str, from_statuses: Sequence[BatchStatus], to_status: BatchStatus, **fields: Any
    ) -> bool:
        """Set status (and fields) only if the status is one of ``from_statuses``, atomically."""
        ...

    async def lease(
        self, owner: str, *, limit: int, lease_seconds: float, batch_id: str | None = None
    ) -> list[LineRecord]:
        """Take up to ``limit`` pending or expired lines of batches in progress, oldest first."""
        ...

    async def renew(self, owner: str, keys: Sequence[LineKey], lease_seconds: float) -> int:
        """Extend ``owner``'s leases on ``keys``; how many it still held."""
        ...

    async def finish(  # noqa: PLR0917 - the line's key, its outcome and usage: the order callers expect
        self, owner: str, batch_id: str, line: int, status: LineStatus, result: str, usage: Usage
    ) -> bool:
        """Record a line's outcome and add its usage to the batch, only if ``owner`` still leases it."""
        ...

    async def finish_many(self, owner: str, outcomes: Sequence[Outcome]) -> list[bool]:
        """``finish`` for several lines in one transaction; for each, whether ``owner`` still leased it."""
        ...

    async def release(self, owner: str, keys: Sequence[LineKey]) -> int:
        """Give ``owner``'s leases on ``keys`` back (pending again); how many."""
        ...

    async def cancel_pending(self, batch_id: str) -> int:
        """Mark the batch's pending lines, and those with expired leases, cancelled; how many."""
        ...

    async def counts(self, batch_id: str) -> RequestCounts:
        """The batch's lines by outcome."""
        ...

    def results(self, batch_id: str) -> AsyncIterator[LineRecord]:
        """The batch's completed and failed lines, in input order."""
        ...

    async def unfinished_batches(self) -> list[BatchRecord]:
        """Batches in an open status (:data:`OPEN_BATCH_STATUSES`), oldest first."""
        ...


# The rest is shared by the two stores: the tables' columns and the rows' conversions.

FILE_COLUMNS = tuple(field.name for field in dataclasses.fields(FileRecord))
LINE_COLUMNS = tuple(field.name for field in dataclasses.fields(LineRecord))
_BATCH_FIELDS = tuple(field.name for field in dataclasses.fields(BatchRecord) if field.name != "usage")
BATCH_COLUMNS = (*_BATCH_FIELDS, *Usage._fields)
# What update_batch and transition may set (usage only grows, through finish).
UPDATABLE = frozenset(_BATCH_FIELDS) - {"id", "endpoint", "input_file_id", "completion_window", "created_at", "caller"}
UPLOADING = "uploading"  # a file's status while put_file writes it: hidden from get_file and list_files


def file_from_row(row: Iterable[Any]) -> FileRecord:
    """A FileRecord from a row in FILE_COLUMNS order."""
    return FileRecord(*row)


def line_from_row(row: Iterable[Any]) -> LineRecord:
    """A LineRecord from a row in LINE_COLUMNS order."""
    values = dict(zip(LINE_COLUMNS, row, strict=True))
    values["status"] = LineStatus(values["status"])
    return LineRecord(**values)


def line_row(line: LineRecord) -> tuple[Any, ...]:
    """A line's values in LINE_COLUMNS order."""
    return tuple(
        str(value) if name == "status" else value
        for name, value in zip(LINE_COLUMNS, dataclasses.astuple(line), strict=True)
    )


def batch_from_row(row: Iterable[Any]) -> BatchRecord:
    """A BatchRecord from a row in BATCH_COLUMNS order."""
    values = dict(zip(BATCH_COLUMNS, row, strict=True))
    values["usage"] = Usage(*(int(values.pop(name)) for name in Usage._fields))
    values["status"] = BatchStatus(values["status"])
    values["errors"] = tuple(json.loads(values["errors"]))
    values["metadata"] = json.loads(values["metadata"])
    return BatchRecord(**values)


def batch_row(batch: BatchRecord) -> tuple[Any, ...]:
    """A batch's values in BATCH_COLUMNS order."""
    values = encode_fields({name: getattr(batch, name) for name in _BATCH_FIELDS}, allowed=frozenset(_BATCH_FIELDS))
    return (*values.values(), *batch.usage)


def encode_fields(fields: Mapping[str, Any], *, allowed: frozenset[str] = UPDATABLE) -> dict[str, Any]:
    """Batch fields as column values (JSON text for errors and metadata); ValueError names a field not allowed."""
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise ValueError(f"batch fields that cannot be set: {', '.join(unknown)}")
    values = dict(fields)
    if "status" in values:
        values["status"] = str(BatchStatus(values["status"]))
    if "errors" in values:
        values["errors"] = json.dumps(list(values["errors"]), sort_keys=True)
    if "metadata" in values:
        values["metadata"] = json.dumps(values["metadata"], sort_keys=True)
    return values


async def rechunk(chunks: AsyncIterable[bytes], size: int = CHUNK_SIZE) -> AsyncIterator[bytes]:
    """The same bytes in chunks of exactly ``size`` (the last one shorter), buffering less than one chunk."""
    pending = bytearray()
    async for chunk in chunks:
        view = memoryview(chunk)
        if pending:
            take = size - len(pending)
            pending += view[:take]
            view = view[take:]
            if len(pending) < size:
                continue
            yield bytes(pending)
            pending.clear()
        while len(view) >= size:
            yield bytes(view[:size])
            view = view[size:]
        pending += view
    if pending:
        yield bytes(pending)


SCHEMA_VERSION = 2
"""1: the first tables; 2: files and batches have a caller."""
MIGRATIONS: dict[int, tuple[str, ...]] = {
    2: (
        "ALTER TABLE files ADD COLUMN caller TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE batches ADD COLUMN caller TEXT NOT NULL DEFAULT ''",
    ),
}
"""The statements that bring a store written at the version before each key to that version
(run before SCHEMA, which then only adds what is missing). Rows from before version 2 have
the caller '' and are seen by admins only."""


def migrations(version: int) -> list[str]:
    """The statements that bring a store at ``version`` to SCHEMA_VERSION (none for 0: a new store)."""
    if not version:
        return []
    return [statement for target in range(version + 1, SCHEMA_VERSION + 1) for statement in MIGRATIONS.get(target, ())]


# The tables, for both stores: {blob}, {real} and {int} are the backend's names for those types.
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes {int} NOT NULL, created_at {int} NOT NULL, status TEXT NOT NULL, expires_at {int},
    caller TEXT NOT NULL DEFAULT ''
)""",
    "CREATE INDEX IF NOT EXISTS files_created ON files (created_at, id)",
    "CREATE INDEX IF NOT EXISTS files_caller ON files (caller, created_at, id)",
    """CREATE TABLE IF NOT EXISTS file_chunks (
    file_id TEXT NOT NULL, seq {int} NOT NULL, data {blob} NOT NULL, PRIMARY KEY (file_id, seq)
)""",
    """CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    created_at {int} NOT NULL, expires_at {int}, status TEXT NOT NULL,
    in_progress_at {int}, finalizing_at {int}, completed_at {int}, failed_at {int},
    expired_at {int}, cancelling_at {int}, cancelled_at {int},
    output_file_id TEXT, error_file_id TEXT,
    errors TEXT NOT NULL DEFAULT '[]',  -- JSON list of {{code, message, param, line}}
    metadata TEXT NOT NULL DEFAULT '{{}}',  -- JSON object of strings
    caller TEXT NOT NULL DEFAULT '',
    prompt_tokens {int} NOT NULL DEFAULT 0, completion_tokens {int} NOT NULL DEFAULT 0,
    total_tokens {int} NOT NULL DEFAULT 0
)""",
    "CREATE INDEX IF NOT EXISTS batches_created ON batches (created_at, id)",
    "CREATE INDEX IF NOT EXISTS batches_caller ON batches (caller, created_at, id)",
    "CREATE INDEX IF NOT EXISTS batches_status ON batches (status)",
    """CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line {int} NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    status TEXT NOT NULL, attempts {int} NOT NULL DEFAULT 0,
    lease_owner TEXT, lease_expires {real},  -- unix seconds by the store's clock
    result TEXT,  -- the output or error line, JSON text
    PRIMARY KEY (batch_id, line)
)""",
    # What lease() scans: only the lines still to do, so a finished batch costs nothing.
    "CREATE INDEX IF NOT EXISTS lines_open ON lines (batch_id, line) WHERE status IN ('pending', 'leased')",
)
