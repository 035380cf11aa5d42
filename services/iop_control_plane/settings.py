"""``iop control-plane`` settings: a YAML file, overridden by ``IOP_`` environment variables.

Nested keys use ``__`` in the environment: ``IOP_LISTEN__PORT=7500`` overrides ``listen.port``.
A bad value raises :class:`ConfigError` whose message is one line naming every bad key.
Relative paths in the file (``tls.*``, ``join.ca_key``, ``store_path``, ``policy_path``) are taken
from its folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from iop_wire.certs import Authority
from iop_wire.framing import DEFAULT_MAX_FRAME_SIZE
from iop_wire.settings import (
    ConfigError,
    ConnectionSettings,
    EventLoop,
    ListenSettings,
    Problem,
    SettingError,
    StartError,
    TlsSettings,
)
from iop_wire.settings import Section as _Section
from iop_wire.settings import load_settings as _load

__all__ = [
    "ConfigError",
    "FairnessSettings",
    "IdentitySettings",
    "JoinSettings",
    "LedgerSettings",
    "PrefixSettings",
    "Problem",
    "Settings",
    "StartError",
    "StoreSettings",
    "load_settings",
]


class ControlPlaneListenSettings(ListenSettings):
    """Where nodes register and edges, workers and admins connect."""

    port: int = Field(7400, ge=0, le=65535)
    """Port to bind; 0 picks a free one."""


class MetricsSettings(_Section):
    """Prometheus exposition."""

    host: str = "127.0.0.1"
    """Address of the /metrics HTTP server."""
    port: int | None = Field(None, ge=0, le=65535)
    """Port of the /metrics HTTP server; unset disables it, 0 picks a free one."""


class JoinSettings(_Section):
    """Machines joining with a token: the control-plane signs their node certificates."""

    ca_key: Path | None = None
    """The private key of the CA in ``tls.ca``; unset: joining is off (join.* is refused UNAVAILABLE)."""
    certificate_lifetime: float = Field(604800.0, ge=60)
    """Seconds a node certificate (joined or renewed) is valid; nodes renew after 2/3 of it."""
    max_failures: int = Field(10, ge=1)
    """Failed join attempts one source address may make per ``failure_window``; more are refused
    RESOURCE_EXHAUSTED (TOO_MANY_ATTEMPTS) without looking at the token."""
    failure_window: float = Field(60.0, gt=0)
    """Seconds over which ``max_failures`` is counted."""
    max_failure_sources: int = Field(4096, ge=1)
    """Source addresses (IPv6: /64s) whose failed join attempts are remembered; a new one beyond
    them forgets the one that failed first (``iop_wire_limit_hits_total{limit="join_failure_sources"}``)."""
    anonymous_timeout: float = Field(30.0, gt=0)
    """Seconds a connection without a certificate (a machine joining) stays open."""
    max_anonymous: int = Field(32, ge=1)
    """Connections without a certificate open at once, from all addresses; more are refused
    RESOURCE_EXHAUSTED at the preface, so they never take the room of nodes and edges."""
    max_anonymous_per_address: int = Field(4, ge=1)
    """Connections without a certificate open at once from one source address."""


class StoreSettings(_Section):
    """Where the control-plane keeps its state: a SQLite file (``store_path``), or PostgreSQL shared by
    every control-plane given the same ``url`` (policy, drains, removals and the ledger follow)."""

    url: str | None = None
    """``postgresql://user[:password]@host[:port]/database``; unset: the SQLite file ``store_path``."""
    poll_interval: float = Field(0.5, gt=0, le=10)
    """Seconds between two looks at a shared store for what other control-planes changed (policy,
    drains, revoked certificates): a change made on one is in force on all within about this."""
    max_connections: int = Field(4, ge=2, le=100)
    """Connections to PostgreSQL this control-plane keeps at most."""
    timeout: float = Field(5.0, gt=0)
    """Seconds one connection attempt or statement may take before it fails (and is retried)."""

    @field_validator("url")
    @classmethod
    def _postgresql(cls, url: str | None) -> str | None:
        if url is None:
            return None
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError as exc:
            raise ValueError(f"not a URL: {exc}") from None
        if parts.scheme not in ("postgresql", "postgres"):
            raise ValueError(f"must start with postgresql:// (got {parts.scheme + '://' if parts.scheme else url!r})")
        if not parts.hostname or not parts.path.strip("/"):
            raise ValueError("name the host and the database: postgresql://user@host:5432/database")
        return url


class FairnessSettings(_Section):
    """How service is counted between callers of a contended model (policy ``fairness: tokens``)."""

    prompt_weight: float = Field(1.0, ge=0)
    """Service one prompt token counts for."""
    completion_weight: float = Field(2.0, ge=0)
    """Service one completion token counts for (decoding costs a GPU more per token than prefill)."""
    max_callers: int = Field(10_000, ge=1)
    """Callers whose service is remembered, per control-plane; past it the one idle longest is forgotten."""
    caller_labels: int = Field(32, ge=0, le=1000)
    """Callers given their own label on the per-caller metrics besides those the policy names; the rest
    are counted as ``other``."""


class PrefixSettings(_Section):
    """What the ``prefix`` policy remembers: prompt prefix hashes per node, least recently used out."""

    entries_per_node: int = Field(4096, ge=1)
    """Prefixes remembered per node (a chat message boundary or 256 characters of a completion prompt each)."""
    max_entries: int = Field(100_000, ge=1)
    """Prefixes remembered for all nodes together (about 200 bytes each)."""


class LedgerSettings(_Section):
    """What the run ledger waits for."""

    cancel_usage_wait: float = Field(2.0, ge=0, le=60)
    """Seconds a run its requester cancelled waits, off the requester's path, for its node's end of it, to
    record what the node counted it used; past it (or 0) the ledger keeps the control-plane's estimate."""
    cancel_usage_waits: int = Field(1024, ge=0)
    """Cancelled runs that may wait so at once; more are recorded at once with the estimate."""


class IdentitySettings(_Section):
    """How a node's certificate names it."""

    shared_node_certificate: bool = True
    """Let the shared development certificate (CN ``node``, from ``iop certs init``) register any
    node id: for one machine only. Every other node certificate registers only its own CN."""


class Settings(BaseSettings):
    """Everything ``iop control-plane`` reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="IOP_", env_nested_delimiter="__", extra="forbid", frozen=True)

    listen: ControlPlaneListenSettings = ControlPlaneListenSettings()
    tls: TlsSettings = TlsSettings()
    connection: ConnectionSettings = ConnectionSettings()
    """Limits every connection gets (runs, requests, frame time, unread bytes, heartbeat clamp)."""
    metrics: MetricsSettings = MetricsSettings()
    join: JoinSettings = JoinSettings()
    identity: IdentitySettings = IdentitySettings()
    store: StoreSettings = StoreSettings()
    prefix: PrefixSettings = PrefixSettings()
    heartbeat_interval: float = Field(5.0, gt=0)
    """Seconds between heartbeats on every connection: peers judge the control-plane by it (3
    missed: dead). It judges each peer by the interval that peer announces (node: 1 s)."""
    max_frame_size: int = Field(DEFAULT_MAX_FRAME_SIZE, ge=1024)
    """Largest frame accepted, bytes."""
    store_path: Path = Path(".iop/control-plane.db")
    """SQLite file of the control-plane's state (node audit, run ledger, policies, drains, join
    tokens, certificates) when ``store.url`` is unset."""
    ledger_max_runs: int = Field(1_000_000, ge=1)
    """Runs the ledger (in ``store_path``) keeps; older ones are deleted."""
    ledger: LedgerSettings = LedgerSettings()
    """What the run ledger waits for: a cancelled run's count from its node."""
    policy_path: Path | None = None
    """The policy file (YAML) put in force at start when the store holds none (a store's newest policy
    wins: one applied since, or by another control-plane); unset: the default policy."""
    attempts: int = Field(3, ge=1, le=10)
    """Nodes a run may be tried on, where the policy file sets no ``attempts``."""
    queue_size: int = Field(256, ge=0)
    """Runs that may wait for a slot, per model; one more is refused RESOURCE_EXHAUSTED (0: none wait)."""
    queue_timeout: float = Field(30.0, gt=0)
    """Seconds a run without a deadline may wait for a slot before RESOURCE_EXHAUSTED."""
    registration_grace: float = Field(30.0, ge=0)
    """Seconds after start during which a run for a model that nodes served before the restart
    (the audit file says so), and none serves yet, is refused UNAVAILABLE (retryable, retry in
    1 s) instead of MODEL_NOT_FOUND: its nodes may not have dialed back yet."""
    fairness: FairnessSettings = FairnessSettings()
    """Counting each caller's service for the admission queue's fair order."""
    background_yield: float = Field(1.0, ge=0)
    """Seconds at most a background run (priority < 0: batch lines) is held back from nodes
    where interactive runs await their first output; past it, it is placed with them (0: never held)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level logged."""
    event_loop: EventLoop = "uvloop"
    """The event loop ``iop control-plane`` runs on: uvloop (libuv) or the standard library's."""

    @model_validator(mode="after")
    def _join_signs_with_the_ca(self) -> Settings:
        key = self.join.ca_key
        if key is None:
            return self
        if not self.tls.enabled or self.tls.ca is None:
            raise SettingError(("join.ca_key", "needs tls.enabled and tls.ca: it is the key of that CA"))
        try:
            Authority.load(self.tls.ca, key)
        except OSError as exc:
            raise SettingError(("join.ca_key", f"cannot read {key}: {exc.strerror or exc}")) from None
        except (ValueError, TypeError):  # not a key, not EC, encrypted, or another CA's
            raise SettingError(("join.ca_key", f"{key} is not the unencrypted EC key of the CA in tls.ca")) from None
        return self


def load_settings(path: Path | None) -> Settings:
    """Read ``path`` (YAML) with ``IOP_`` overrides; ConfigError on any bad value."""
    return _load(Settings, path)
