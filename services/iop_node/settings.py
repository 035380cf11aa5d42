"""``iop node`` settings: a YAML file, overridden by ``IOP_`` environment variables.

Nested keys use ``__`` in the environment: ``IOP_LISTEN__PORT=7500`` overrides ``listen.port``.
A bad value raises :class:`ConfigError` whose message is one line naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from iop_wire.framing import DEFAULT_MAX_FRAME_SIZE
from iop_wire.tls import TlsConfig

__all__ = ["ConfigError", "RouteSettings", "Settings", "load_settings"]


class ConfigError(Exception):
    """A configuration problem, as one line naming the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenSettings(_Section):
    """Where the node serves clients directly (standalone mode)."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = Field(7401, ge=0, le=65535)
    """Port to bind; 0 picks a free one."""
    enabled: bool = True
    """Serve direct clients; false for a node that only takes runs from its control-plane."""


class TlsSettings(_Section):
    """The seed's ``tls`` keys."""

    enabled: bool = False
    """Use mTLS (required on any network but loopback)."""
    cert: Path | None = None
    """This node's certificate (role ``node``)."""
    key: Path | None = None
    """Its private key."""
    ca: Path | None = None
    """The CA that signs every peer."""

    @model_validator(mode="after")
    def _files_when_enabled(self) -> TlsSettings:
        if self.enabled:
            for name in ("cert", "key", "ca"):
                path = getattr(self, name)
                if path is None:
                    raise ValueError(f"tls.{name} is required when tls.enabled is true")
                if not path.is_file():
                    raise ValueError(f"tls.{name}: no such file {path}")
        return self

    def config(self) -> TlsConfig:
        """The wire's frozen form."""
        return TlsConfig(enabled=self.enabled, cert=self.cert, key=self.key, ca=self.ca)


class SamplingDefaults(_Section):
    """Sampling values a route applies when the request leaves them unset."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, gt=0)
    stop: list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


class RouteSettings(_Section):
    """One entry of the route table: a model name clients use and how it is served."""

    model: str = Field(min_length=1)
    """The name clients ask for."""
    adapter: str = Field(min_length=1)
    """Adapter that serves it: mock, cli, ..."""
    target: str | None = None
    """The backend's name for the model; defaults to ``model``."""
    max_concurrency: int = Field(4, ge=1)
    """Runs of this model executed at once."""
    queue_size: int = Field(64, ge=0)
    """Runs that may wait for a slot; more are rejected with RESOURCE_EXHAUSTED."""
    defaults: SamplingDefaults = SamplingDefaults()
    """Sampling defaults."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Adapter options, checked by the adapter's options model at start-up."""


class ControlPlaneSettings(_Section):
    """Registered mode: the control-plane this node dials."""

    address: str | None = None
    """``host:port`` of the control-plane; unset means standalone."""
    server_name: str | None = None
    """Name to verify in the control-plane's certificate; defaults to the host."""
    status_step: int = Field(1, ge=1)
    """Send node.status between heartbeats once in-flight + queued changed by this much."""
    reconnect_initial: float = Field(0.5, gt=0)
    """First reconnect delay, seconds; doubles per failure, with jitter."""
    reconnect_max: float = Field(30.0, gt=0)
    """Largest reconnect delay, seconds."""


class MetricsSettings(_Section):
    """Prometheus exposition."""

    host: str = "127.0.0.1"
    """Address of the /metrics HTTP server."""
    port: int | None = Field(None, ge=0, le=65535)
    """Port of the /metrics HTTP server; unset disables it, 0 picks a free one."""


class Settings(BaseSettings):
    """Everything ``iop node`` reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="IOP_", env_nested_delimiter="__", extra="forbid", frozen=True)

    node_id: str = Field("node-1", min_length=1)
    """This node's id, unique in the cluster."""
    listen: ListenSettings = ListenSettings()
    tls: TlsSettings = TlsSettings()
    control_plane: ControlPlaneSettings = ControlPlaneSettings()
    metrics: MetricsSettings = MetricsSettings()
    store_path: Path = Path(".iop/node-runs.db")
    """SQLite file of the run history."""
    heartbeat_interval: float = Field(30.0, gt=0)
    """Seconds between heartbeats on every connection; a peer silent for 3 is dead."""
    max_frame_size: int = Field(DEFAULT_MAX_FRAME_SIZE, ge=1024)
    """Largest frame accepted, bytes."""
    max_prompt_chars: int = Field(1_000_000, ge=1)
    """Largest prompt (all message text together), characters."""
    max_tokens_limit: int = Field(131_072, ge=1)
    """Largest max_tokens a request may ask for."""
    shutdown_grace: float = Field(30.0, ge=0)
    """On SIGTERM, seconds in-flight runs get to finish before they are cancelled."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level logged."""
    routes: list[RouteSettings] = Field(default_factory=list)
    """The route table."""

    @model_validator(mode="after")
    def _unique_models(self) -> Settings:
        seen: set[str] = set()
        for index, route in enumerate(self.routes):
            if route.model in seen:
                raise ValueError(f"routes.{index}.model: {route.model!r} is routed twice")
            seen.add(route.model)
        return self


def one_line(error: ValidationError, prefix: str = "") -> str:
    """The first error as ``key: message``, its key under ``prefix`` (e.g. "routes.0.options")."""
    first = error.errors()[0]
    key = ".".join((prefix, *(str(part) for part in first["loc"])) if prefix else (str(p) for p in first["loc"]))
    message = first["msg"].removeprefix("Value error, ")
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{key}: {message}{more}" if key else f"{message}{more}"


def load_settings(path: Path | None) -> Settings:
    """Read ``path`` (YAML) with ``IOP_`` overrides; ConfigError on any bad value."""
    data: Any = {}
    if path is not None:
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping of keys")

    class _FromFile(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return env_settings, InitSettingsSource(settings_cls, data)

    try:
        return _FromFile()
    except ValidationError as exc:
        raise ConfigError(one_line(exc)) from None
