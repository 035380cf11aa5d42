"""``iop edge`` settings: a YAML file, overridden by ``IOP_`` environment variables.

Nested keys use ``__`` in the environment: ``IOP_LISTEN__PORT=8080`` overrides ``listen.port``.
A bad value raises :class:`ConfigError` whose message is one line naming every bad key.
Relative paths in the file (``tls.*``, ``keys_path``) are taken from its folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from iop_wire.failover import DEFAULT_MIGRATIONS
from iop_wire.settings import (
    ConfigError,
    ConnectionSettings,
    ControlPlaneAddress,
    EventLoop,
    Problem,
    StartError,
    TlsSettings,
)
from iop_wire.settings import Section as _Section
from iop_wire.settings import load_settings as _load

__all__ = [
    "ConfigError",
    "ConsoleSettings",
    "Problem",
    "ResponsesSettings",
    "Settings",
    "StartError",
    "StoreSettings",
    "load_settings",
]


class HttpSettings(_Section):
    """The OpenAI-compatible HTTP API."""

    host: str | list[str] = "127.0.0.1"
    """Address to bind, or a list of them (``[127.0.0.1, 10.0.0.5]``): one socket each, the same port."""
    port: int = Field(8000, ge=0, le=65535)
    """Port to bind; 0 picks a free one."""
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Largest request body; a larger one is answered 413."""
    max_in_flight: int = Field(4096, ge=1)
    """Requests served at once (streams included); more are answered 429 at once."""
    max_connections: int = Field(8192, ge=1)
    """HTTP connections open at once (uvicorn's limit_concurrency: more get 503)."""
    keep_alive: float = Field(5.0, gt=0)
    """Seconds an idle keep-alive connection stays open."""
    body_timeout: float = Field(60.0, gt=0)
    """Seconds a JSON request body may take to arrive in full; a slower one is answered 408.
    (A file upload is bounded by the worker instead: 60 s between chunks, an hour in all.)"""
    header_timeout: float = Field(10.0, gt=0)
    """Seconds a request's head (request line and headers) may take to arrive, from the
    connection's opening or the request's first byte; a slower client's connection is closed."""
    max_head_bytes: int = Field(64 * 1024, ge=1024)
    """Largest request head (request line and headers); a larger one is answered 431 and its
    connection closed. (nginx allows 32 KiB of headers by default, Node.js 16 KiB.)"""
    max_headers: int = Field(100, ge=10)
    """Most headers in one request; more are answered 431 and the connection closed (Apache's default)."""

    @field_validator("host")
    @classmethod
    def _some_host(cls, host: str | list[str]) -> str | list[str]:
        if not host or (isinstance(host, list) and not all(host)):
            raise ValueError("name an address to bind, or a list of them")
        return host

    @property
    def hosts(self) -> tuple[str, ...]:
        """Every address to bind, in order (duplicates once)."""
        return tuple(dict.fromkeys([self.host] if isinstance(self.host, str) else self.host))

    max_file_bytes: int = Field(512 * 1024 * 1024, ge=1)
    """Largest file POST /v1/files takes (streamed to the worker, never held); a larger one is answered 413."""


class UpstreamSettings(ControlPlaneAddress):
    """The control-plane(s) the edge submits runs to, over a small pool of mTLS connections to each."""

    address: str | None = "127.0.0.1:7400"
    connections: int = Field(2, ge=1, le=64)
    """Connections to each control-plane; runs are spread over every one that is up."""
    capabilities_ttl: float = Field(2.0, ge=0)
    """Seconds a capability answer (GET /v1/models) is reused."""
    migrations: int = Field(DEFAULT_MIGRATIONS, ge=0, le=16)
    """Times a run whose control-plane connection is lost after its first output is continued through
    another control-plane (0: never, it ends node_lost)."""


class WorkerSettings(ControlPlaneAddress):
    """The worker that keeps files and batches (POST /v1/files, /v1/batches), over mTLS connections."""

    address: str | None = None
    """``host:port`` of the worker; unset: the file and batch endpoints answer 503."""
    connections: int = Field(1, ge=1, le=64)
    """Connections in the pool; requests are spread over those that are up (an upload keeps to one)."""


class StoreSettings(_Section):
    """Where the API keys, their usage and their shared limits live: unset, the SQLite ``keys_path``."""

    url: str | None = None
    """``postgresql://user[:password]@host:5432/database``, shared by every edge (and ``iop keys --store-url``):
    keys created or revoked anywhere hold on every edge within ``refresh`` seconds, and each key's
    limits hold across the edges. Unset: the key file ``keys_path``, limits kept by this edge alone."""
    refresh: float = Field(0.5, gt=0, le=1.0)
    """Seconds between two looks for created or revoked keys."""
    usage_backlog: int = Field(10_000, ge=1)
    """Usage rows (one per key and minute) kept while the store is away; past it, requests go unrecorded (counted)."""

    @field_validator("url")
    @classmethod
    def _postgres(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (unset: the SQLite file keys_path)")
        return url


class ResponsesSettings(_Section):
    """The Responses API's stored responses (``store: true``, the default), kept in the key store."""

    retention_days: float = Field(30.0, gt=0)
    """Days a stored response is kept (OpenAI keeps them 30); older ones are gone and deleted by the next sweep."""
    max_per_key: int = Field(10_000, ge=1)
    """Stored responses one key (``anonymous`` with ``auth: none``) may have; storing one more drops its
    oldest (logged, counted in ``iop_edge_responses_dropped_total{reason="max_per_key"}``)."""
    max_bytes_per_key: int = Field(256 * 1024 * 1024, ge=1024)
    """Bytes of stored JSON (responses, their input items and conversations) one key may have; storing
    past it drops its oldest, as ``max_per_key`` does (the newest is always kept)."""
    sweep_interval: float = Field(60.0, gt=0)
    """Seconds between two deletions of expired responses (done by the next store after it)."""


class ConsoleSettings(_Section):
    """The web console (``/console``) and its API (``/console/api/*``)."""

    push_interval: float = Field(2.0, ge=0.05, le=60)
    """Seconds between two pushes of the live stream (``/console/api/live``): one poll of the
    control-plane per edge, whatever the number of watchers."""
    max_watchers: int = Field(64, ge=1, le=10_000)
    """Live streams open at once; more are answered 429. Keys that are not admin share all but the last
    ``max_watchers_per_key`` (at most half): the operators always get in."""
    max_watchers_per_key: int = Field(4, ge=1, le=10_000)
    """Live streams one key may have open at once; more are answered 429 (one key cannot take
    the whole ``max_watchers``)."""
    admin_cert: Path | None = None
    """An admin certificate (role admin, signed by ``tls.ca``) for what the edge's own certificate may
    not do: drain, undrain and remove nodes, every caller's batches and files. Written by ``iop up``;
    unset: those console actions answer 503."""
    admin_key: Path | None = None
    """The admin certificate's private key."""

    @model_validator(mode="after")
    def _both_or_neither(self) -> ConsoleSettings:
        if (self.admin_cert is None) != (self.admin_key is None):
            raise ValueError("set both console.admin_cert and console.admin_key, or neither")
        return self


class Settings(BaseSettings):
    """Everything ``iop edge`` reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="IOP_", env_nested_delimiter="__", extra="forbid", frozen=True)

    http: HttpSettings = HttpSettings()
    control_plane: UpstreamSettings = UpstreamSettings()
    worker: WorkerSettings = WorkerSettings()
    tls: TlsSettings = TlsSettings()
    """The edge's certificate (role edge) for the control-plane and the worker, and the CA that signed it."""
    connection: ConnectionSettings = ConnectionSettings()
    """Limits of the connections to the control-plane and the worker."""
    heartbeat_interval: float = Field(5.0, gt=0)
    """Seconds between heartbeats on the control-plane and worker connections."""
    auth: Literal["keys", "none"] = "keys"
    """keys: every request needs an API key from ``keys_path``; none: no keys (local development only)."""
    keys_path: Path = Path(".iop/edge-keys.db")
    """SQLite file of API keys (hashed), written by ``iop keys``; used when ``store.url`` is unset."""
    store: StoreSettings = StoreSettings()
    """The key store shared by several edges (PostgreSQL)."""
    console: ConsoleSettings = ConsoleSettings()
    """The web console: its live stream's pace and bound, and the admin certificate for its admin actions."""
    responses: ResponsesSettings = ResponsesSettings()
    """How long stored responses (the Responses API) are kept, and how many per key."""
    request_timeout: float = Field(600.0, gt=0)
    """Seconds a request may take, queueing included; then 504. Sent as the run's deadline."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level logged."""
    event_loop: EventLoop = "uvloop"
    """The event loop ``iop edge`` runs on: uvloop (libuv) or the standard library's."""

    @model_validator(mode="after")
    def _has_control_plane(self) -> Settings:
        if not self.control_plane.all_addresses:
            raise ValueError("control_plane.address is required: the edge submits every run to a control-plane")
        return self


def load_settings(path: Path | None) -> Settings:
    """Read ``path`` (YAML) with ``IOP_`` overrides; ConfigError on any bad value."""
    return _load(Settings, path)
