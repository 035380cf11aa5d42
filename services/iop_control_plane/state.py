"""The control-plane's state store: one interface (:class:`StateStore`), two implementations.

:class:`iop_control_plane.sqlite_store.SqliteStore` keeps it in one SQLite file (the default, one
machine); :class:`iop_control_plane.pg_store.PgStore` in PostgreSQL, shared by every control-plane
given the same ``store.url``. What it keeps: the node audit (nodes seen, state changes), the run
ledger and its journal of runs in progress, token usage per caller, model and UTC hour or day
(:mod:`iop_control_plane.usage`, written with the ledger's rows), the applied policies (every one, numbered; the newest
is in force), the drained nodes, join tokens, join attempts, and node certificates issued and
revoked. Each change that other control-planes must follow (a policy, a drain, a revocation)
also bumps its counter in ``changes`` in the same transaction: replicas poll those counters
(:mod:`iop_control_plane.replicas`).

The schema's version is kept in ``control_plane_schema`` (one row). Opening a store applies the
missing steps of :data:`MIGRATIONS` in one transaction; a store written by a newer control-plane
refuses to open. A SQLite file made before versions were kept is version 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from iop_control_plane.ledger import Attempt, LedgerEntry, LeftOpen
from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = [
    "CHANGE_KINDS",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "Dialect",
    "NodeSeen",
    "Opened",
    "Placed",
    "PolicyRecord",
    "StateChanged",
    "StateStore",
    "StoreTooNew",
    "TokenRow",
    "Write",
]

CHANGE_KINDS = ("policy", "drains", "revocations")
"""What replicas follow; each has a counter in ``changes``."""


@dataclass(frozen=True, slots=True)
class Dialect:
    """The column types that differ between SQLite and PostgreSQL."""

    real: str
    int: str
    serial: str
    """An auto-numbered integer primary key."""
    floor: str
    """The whole number at or below the REAL expression ``%s`` (SQLite truncates, PostgreSQL rounds, a cast)."""
    clustered: str
    """What makes a table's rows live in its primary key's order (SQLite: WITHOUT ROWID; read in key order
    with no lookup per row)."""


_V1 = (  # the tables of the SQLite file before versions were kept (CREATE ... IF NOT EXISTS: it may hold them)
    """CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY, labels TEXT NOT NULL, address TEXT NOT NULL, models TEXT NOT NULL,
    first_seen {real} NOT NULL, last_seen {real} NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS node_events (
    node_id TEXT NOT NULL, at {real} NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS node_events_by_node ON node_events (node_id, at)",
    """CREATE TABLE IF NOT EXISTS runs (
    id {serial}, run_id TEXT NOT NULL, requester TEXT NOT NULL, connection TEXT NOT NULL,
    caller TEXT NOT NULL, model TEXT NOT NULL, node_id TEXT NOT NULL, status TEXT NOT NULL,
    error_code {int} NOT NULL, error_message TEXT NOT NULL, received_at {real} NOT NULL,
    ttft {real}, duration {real} NOT NULL, prompt_tokens {int} NOT NULL, completion_tokens {int} NOT NULL,
    usage_estimated {int} NOT NULL, finish_reason {int} NOT NULL, outputs {int} NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS runs_by_run_id ON runs (run_id)",
    """CREATE TABLE IF NOT EXISTS run_attempts (
    run {int} NOT NULL, attempt {int} NOT NULL, node_id TEXT NOT NULL, model TEXT NOT NULL,
    outcome TEXT NOT NULL, reason TEXT NOT NULL, started_after {real} NOT NULL, duration {real} NOT NULL,
    PRIMARY KEY (run, attempt))""",
    "CREATE INDEX IF NOT EXISTS run_attempts_by_node ON run_attempts (node_id)",
    """CREATE TABLE IF NOT EXISTS open_runs (
    id {serial}, run_id TEXT NOT NULL, requester TEXT NOT NULL, connection TEXT NOT NULL,
    caller TEXT NOT NULL, model TEXT NOT NULL, received_at {real} NOT NULL,
    node_id TEXT NOT NULL DEFAULT '', node_model TEXT NOT NULL DEFAULT '', attempt {int} NOT NULL DEFAULT 0,
    placed_after {real} NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS join_tokens (
    id TEXT PRIMARY KEY, secret_sha256 TEXT NOT NULL, created_at {real} NOT NULL, expires_at {real} NOT NULL,
    uses {int} NOT NULL, used {int} NOT NULL, name_prefix TEXT NOT NULL, created_by TEXT NOT NULL,
    revoked_at {real})""",
    """CREATE TABLE IF NOT EXISTS join_audit (
    at {real} NOT NULL, token_id TEXT NOT NULL, address TEXT NOT NULL, name TEXT NOT NULL, outcome TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS node_certificates (
    serial TEXT PRIMARY KEY, node_id TEXT NOT NULL, issued_at {real} NOT NULL, not_after {real} NOT NULL,
    revoked_at {real}, reason TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS node_certificates_by_node ON node_certificates (node_id)",
)
_V2 = (  # shared by replicas: whose runs are open, numbered policies, drains, change counters
    "ALTER TABLE open_runs ADD COLUMN owner TEXT NOT NULL DEFAULT ''",
    """CREATE TABLE policies (
    version {serial}, text TEXT NOT NULL, sha256 TEXT NOT NULL, source TEXT NOT NULL,
    applied_by TEXT NOT NULL, applied_at {real} NOT NULL)""",
    """CREATE TABLE drains (
    node_id TEXT PRIMARY KEY, reason TEXT NOT NULL, drained_by TEXT NOT NULL, at {real} NOT NULL)""",
    "CREATE TABLE changes (kind TEXT PRIMARY KEY, serial {int} NOT NULL)",
    "INSERT INTO changes (kind, serial) VALUES ('policy', 0), ('drains', 0), ('revocations', 0)",
    "CREATE TABLE replicas (owner TEXT PRIMARY KEY, seen_at {real} NOT NULL)",
    "CREATE INDEX node_certificates_revoked ON node_certificates (revoked_at)",
)
_V3 = (  # runs continued on another node after their node was lost mid-stream: each attempt's share and cost
    "ALTER TABLE runs ADD COLUMN migrations {int} NOT NULL DEFAULT 0",
    "ALTER TABLE run_attempts ADD COLUMN outputs {int} NOT NULL DEFAULT 0",
    "ALTER TABLE run_attempts ADD COLUMN continued {int} NOT NULL DEFAULT 0",
    "ALTER TABLE run_attempts ADD COLUMN continuation_prompt_tokens {int} NOT NULL DEFAULT 0",
    "ALTER TABLE run_attempts ADD COLUMN gap {real}",
)
_USAGE_TABLE = """CREATE TABLE {table} (
    start {int} NOT NULL, caller TEXT NOT NULL, model TEXT NOT NULL, requests {int} NOT NULL,
    prompt_tokens {int} NOT NULL, completion_tokens {int} NOT NULL, cached_tokens {int} NOT NULL,
    failed {int} NOT NULL, estimated {int} NOT NULL, PRIMARY KEY (start, caller, model)){clustered}"""
_USAGE_BACKFILL = """INSERT INTO {table} (start, caller, model, requests, prompt_tokens, completion_tokens,
    cached_tokens, failed, estimated)
SELECT {bucket} * {width}, caller, model, count(*), sum(prompt_tokens), sum(completion_tokens),
    sum(cached_tokens), sum(CASE WHEN status = 'completed' THEN 0 ELSE 1 END), sum(usage_estimated)
FROM runs GROUP BY {bucket}, caller, model"""
_V4 = (  # token usage per caller, model and UTC hour or day (the console), filled from the runs already kept
    "ALTER TABLE runs ADD COLUMN cached_tokens {int} NOT NULL DEFAULT 0",
    "CREATE INDEX runs_by_received ON runs (received_at, id)",  # runs.list's order: newest first, no sort
    "CREATE INDEX runs_by_caller ON runs (caller, received_at, id)",
    _USAGE_TABLE.replace("{table}", "usage_hours"),
    _USAGE_TABLE.replace("{table}", "usage_days"),
    _USAGE_BACKFILL.replace("{table}", "usage_hours").replace("{width}", "3600").replace("{bucket}", "{hour}"),
    _USAGE_BACKFILL.replace("{table}", "usage_days").replace("{width}", "86400").replace("{bucket}", "{day}"),
)
_V5 = (  # usage.list of one caller (the console's own-key view) reads its rows, not every caller's in the range
    "CREATE INDEX usage_hours_by_caller ON usage_hours (caller, start)",
    "CREATE INDEX usage_days_by_caller ON usage_days (caller, start)",
)
MIGRATIONS: tuple[tuple[str, ...], ...] = (_V1, _V2, _V3, _V4, _V5)
"""Step ``n`` (from 0) takes the schema from version ``n`` to ``n + 1``."""
SCHEMA_VERSION = len(MIGRATIONS)


class StoreTooNew(RuntimeError):
    """The store's schema is newer than this control-plane's."""


def steps(version: int, dialect: Dialect) -> list[str]:
    """The SQL that takes a store at ``version`` to :data:`SCHEMA_VERSION`; StoreTooNew past it."""
    if version > SCHEMA_VERSION:
        raise StoreTooNew(f"its schema is version {version}, newer than this control-plane's {SCHEMA_VERSION}")
    names = {
        "real": dialect.real,
        "int": dialect.int,
        "serial": dialect.serial,
        "clustered": dialect.clustered,
        "hour": dialect.floor % "(received_at / 3600)",
        "day": dialect.floor % "(received_at / 86400)",
    }
    return [sql.format(**names) for step in MIGRATIONS[version:] for sql in step]


@dataclass(frozen=True, slots=True)
class NodeSeen:
    """A node registered (the audit's ``nodes`` row)."""

    node_id: str
    labels: str
    """JSON object."""
    address: str
    models: str
    """JSON list."""
    at: float


@dataclass(frozen=True, slots=True)
class StateChanged:
    """A node changed state."""

    node_id: str
    at: float
    state: str
    reason: str


@dataclass(frozen=True, slots=True)
class Opened:
    """A run started: its row in ``open_runs``."""

    entry: LedgerEntry


@dataclass(frozen=True, slots=True)
class Placed:
    """A run's attempt number ``number`` was placed on a node."""

    entry: LedgerEntry
    number: int
    attempt: Attempt


Write = NodeSeen | StateChanged | Opened | Placed | LedgerEntry
"""What the audit's writer commits in batches."""


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    """One applied policy."""

    version: int
    """Its number: the newest is in force."""
    text: str
    source: str
    applied_by: str
    applied_at: float


TokenRow = tuple[str, str, float, float, int, int, str, str, float | None]
"""A join token's columns: id, secret_sha256, created_at, expires_at, uses, used, name_prefix,
created_by, revoked_at."""


class StateStore(Protocol):
    """Where a control-plane keeps what must outlive it (and, shared, what its replicas follow)."""

    shared: bool
    """Whether other control-planes may use it at once (PostgreSQL)."""
    name: str
    """The file or URL (without password), for messages."""
    sessions_lost: int
    """Operations that met sessions the database server had ended, and ran again."""

    async def open(self, owner: str) -> None:
        """Connect and migrate; ``owner`` names this control-plane's runs in progress."""

    async def aclose(self) -> None:
        """Disconnect."""

    async def commit(self, batch: Sequence[Write], touched: Mapping[str, float]) -> None:
        """Write a batch (and nodes' last-seen times) in one transaction; sets ``open_row`` of opened entries."""

    async def recover(self, stale_after: float) -> list[LeftOpen]:
        """Move to the ledger as interrupted the open runs of control-planes not seen for ``stale_after`` s."""

    async def settle(self, left: LeftOpen, found: pb.LedgerRun) -> bool:
        """Put a node's record of a run left open in place of its interrupted row; False if it is not
        (or no longer) interrupted with that node as the last attempt's."""

    async def heartbeat(self) -> None:
        """Note this control-plane alive (its open runs are not recovered by others)."""

    async def prune(self, max_runs: int, max_events: int) -> None:
        """Keep the newest ``max_runs`` runs and ``max_events`` state changes."""

    async def nodes(self) -> list[tuple[str, float, str]]:
        """Every node seen: (node id, first seen, models as JSON)."""

    async def events(self, node_id: str) -> list[tuple[str, str]]:
        """(state, reason) of a node's changes, oldest first."""

    async def runs(self, request: pb.RunsList) -> pb.RunsListed:
        """The ledger's runs ``request`` asks for, newest first; ValueError for a bad status."""

    async def usage(self, request: pb.UsageList) -> pb.UsageListed:
        """Token usage per bucket (:mod:`iop_control_plane.usage`); ValueError for a bad window or too many rows."""

    async def changes(self) -> dict[str, int]:
        """Each kind of :data:`CHANGE_KINDS` with its counter."""

    async def add_policy(self, text: str, sha256: str, source: str, applied_by: str) -> PolicyRecord:
        """Record a policy put in force (it becomes the newest)."""

    async def newest_policy(self) -> PolicyRecord | None:
        """The policy in force, if any was recorded."""

    async def policies(self) -> list[PolicyRecord]:
        """Every applied policy, newest first."""

    async def set_drain(self, node_id: str, reason: str, drained_by: str, *, drained: bool) -> None:
        """Drain (or undrain) a node."""

    async def drains(self) -> dict[str, str]:
        """Drained node id -> reason."""

    async def add_token(self, row: TokenRow) -> None:
        """Store a new join token."""

    async def tokens(self, token_id: str | None = None) -> list[TokenRow]:
        """Every token (or the one with ``token_id``), newest first."""

    async def revoke_token(self, token_id: str, at: float) -> bool:
        """Mark a token revoked; False when there is none."""

    async def use_token(self, token_id: str) -> bool:
        """Count one use; False when it was used up."""

    async def add_attempt(self, at: float, token_id: str, address: str, name: str, outcome: str) -> None:
        """Record one join attempt."""

    async def attempts(self) -> list[tuple[str, str, str, str]]:
        """Join attempts, oldest first: (token id, address, name, outcome)."""

    async def issue(self, node_id: str, serial: str, not_after: float, at: float) -> None:
        """Record a certificate issued to ``node_id``."""

    async def revoke_node(self, node_id: str, reason: str, at: float, also: tuple[str, float] | None) -> list[str]:
        """Revoke ``node_id``'s certificates not revoked yet (and ``also``: serial, expiry); the serials."""

    async def revoked(self) -> set[str]:
        """Every revoked serial."""
