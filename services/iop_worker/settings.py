"""``iop worker`` settings: a YAML file, overridden by ``IOP_`` environment variables.

Nested keys use ``__`` in the environment: ``IOP_LISTEN__PORT=7402`` overrides ``listen.port``.
A bad value raises :class:`ConfigError` whose message is one line naming every bad key.
Relative paths in the file (``tls.*``, ``store.path``) are taken from its folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from iop_wire.settings import (
    ConfigError,
    ConnectionSettings,
    ControlPlaneAddress,
    EventLoop,
    ListenSettings,
    Problem,
    StartError,
    TlsSettings,
)
from iop_wire.settings import Section as _Section
from iop_wire.settings import load_settings as _load

__all__ = ["ConfigError", "Problem", "Settings", "StartError", "load_settings"]


class WorkerListenSettings(ListenSettings):
    """Where edges (and admins) reach the worker's files and batches."""

    port: int = Field(7402, ge=0, le=65535)
    """Port to bind; 0 picks a free one."""


class StoreSettings(_Section):
    """Where files, batches and their lines are kept."""

    path: Path = Path(".iop/worker.db")
    """SQLite file (WAL), used when ``url`` is unset."""
    url: str | None = None
    """``postgresql://user@host:port/db``: keep everything in PostgreSQL, shared by several workers."""

    @field_validator("url")
    @classmethod
    def _postgres(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"{url!r} is not a postgresql:// URL")
        return url


class BatchSettings(_Section):
    """How batch lines run."""

    concurrency: int = Field(32, ge=1, le=4096)
    """Lines running at once on this worker."""
    priority: int = Field(-10, le=0)
    """Priority of the runs (interactive runs have 0: they always go first)."""
    attempts: int = Field(3, ge=1, le=20)
    """Tries of a line that fails retryably (node lost, unavailable, queue full) before it fails."""
    lease_seconds: float = Field(30.0, gt=0)
    """How long a line this worker takes stays its own without a renewal; a dead worker's lines
    go to the others this long after it stopped renewing."""
    poll_interval: float = Field(0.5, gt=0)
    """Seconds between looks for work (new batches, other workers' expired leases)."""
    max_lines: int = Field(50_000, ge=1)
    """Lines a batch may have (OpenAI's limit)."""


class Settings(BaseSettings):
    """Everything ``iop worker`` reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="IOP_", env_nested_delimiter="__", extra="forbid", frozen=True)

    worker_id: str = Field("worker", min_length=1)
    """A name for this worker in logs and leases (a random suffix is added per process)."""
    listen: WorkerListenSettings = WorkerListenSettings()
    tls: TlsSettings = TlsSettings()
    """The worker's certificate (role worker), for its listener and for the control-plane."""
    connection: ConnectionSettings = ConnectionSettings()
    control_plane: ControlPlaneAddress = ControlPlaneAddress(address="127.0.0.1:7400")
    heartbeat_interval: float = Field(5.0, gt=0)
    """Seconds between heartbeats; peers close the connection after 3 missed. At ``nice: idle`` on a
    host whose cores are all busy the worker runs only every 1-3 s: keep it at 2 s or more."""
    store: StoreSettings = StoreSettings()
    batches: BatchSettings = BatchSettings()
    max_file_bytes: int = Field(512 * 1024 * 1024, ge=1024)
    """Largest file an upload may hold; more is refused (413 at the edge)."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Port of the /metrics HTTP server on 127.0.0.1; unset disables it, 0 picks a free one."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    event_loop: EventLoop = "uvloop"
    nice: int | Literal["idle"] = "idle"
    """The worker's CPU priority on a machine shared with the edge, control-plane and nodes:
    "idle" (SCHED_IDLE: the batch uses only CPU time nothing else wants), or a niceness to add
    to the process's own (0 leaves it)."""

    @field_validator("nice", mode="before")
    @classmethod
    def _idle_or_niceness(cls, value: object) -> int | str:
        if value == "idle":
            return "idle"
        try:
            nice = int(str(value))
        except ValueError:
            nice = -1
        if not 0 <= nice <= 19 or isinstance(value, (bool, float)):
            raise ValueError(f"{value!r} is neither 'idle' nor a niceness from 0 to 19")
        return nice

    @model_validator(mode="after")
    def _has_control_plane(self) -> Settings:
        if not self.control_plane.all_addresses:
            raise ValueError("control_plane.address is required: the worker runs every line through a control-plane")
        return self


def load_settings(path: Path | None) -> Settings:
    """Read ``path`` (YAML) with ``IOP_`` overrides; ConfigError on any bad value."""
    return _load(Settings, path)
