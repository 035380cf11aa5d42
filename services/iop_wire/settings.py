"""Settings pieces every IOP service shares: TLS, listening, connection limits, and the loader.

A service's settings are one pydantic-settings class read from a YAML file and overridden by
``IOP_`` environment variables (nested keys joined by ``__``: ``IOP_LISTEN__PORT=7500``).
:func:`load_settings` reads them; any bad value raises :class:`ConfigError`, whose message is
one line naming every bad key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource

from iop_wire.connection import ConnectionConfig
from iop_wire.endpoint import ListenerConfig
from iop_wire.framing import DEFAULT_MAX_FRAME_SIZE
from iop_wire.tls import Role, TlsConfig

__all__ = [
    "ConfigError",
    "ConnectionSettings",
    "ListenSettings",
    "Section",
    "TlsSettings",
    "load_settings",
    "one_line",
]

_Settings = TypeVar("_Settings", bound=BaseSettings)


class ConfigError(Exception):
    """A configuration problem, as one line naming the key."""


class Section(BaseModel):
    """A settings section: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TlsSettings(Section):
    """The seed's ``tls`` keys."""

    enabled: bool = False
    """Use mTLS (required on any network but loopback)."""
    cert: Path | None = None
    """This service's certificate (its role in the OU)."""
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


class ConnectionSettings(Section):
    """Per-connection limits (see ``iop_wire.connection.ConnectionConfig``)."""

    max_peer_interval: float = Field(120.0, gt=0)
    """Largest heartbeat interval a peer may announce, seconds."""
    frame_timeout: float = Field(30.0, gt=0)
    """Seconds a frame may take to arrive whole once its first byte came."""
    max_runs: int = Field(1024, ge=1)
    """Runs one connection may have in progress here; more are refused RESOURCE_EXHAUSTED."""
    max_requests: int = Field(64, ge=1)
    """Other requests (capabilities, node.*) answered at once per connection."""
    read_pause_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024)
    """Reading from a peer pauses while this many bytes wait to be sent to it."""

    def config(self, *, heartbeat_interval: float, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> ConnectionConfig:
        """The wire's frozen form, with the service's heartbeat interval and frame limit."""
        return ConnectionConfig(
            heartbeat_interval=heartbeat_interval,
            max_frame_size=max_frame_size,
            **self.model_dump(),
        )


class ListenSettings(Section):
    """Where a service listens, and how many connections it takes."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = Field(0, ge=0, le=65535)
    """Port to bind; 0 picks a free one."""
    enabled: bool = True
    """Listen at all."""
    max_connections: int = Field(1024, ge=1)
    """Connections open at once; more are closed at accept."""
    max_connections_per_peer: int = Field(64, ge=1)
    """Connections open at once per certificate name."""
    max_handshakes: int = Field(64, ge=1)
    """TLS handshakes under way at once; more are closed at accept."""
    handshake_timeout: float = Field(10.0, gt=0)
    """Seconds a dialer has for the TLS handshake and the preface."""

    def config(
        self, tls: TlsSettings, connection: ConnectionConfig, allowed_roles: frozenset[Role] | None
    ) -> ListenerConfig:
        """The wire's listener config; roles are checked only with TLS (there are none without)."""
        return ListenerConfig(
            host=self.host,
            port=self.port,
            tls=tls.config(),
            allowed_roles=allowed_roles if tls.enabled else None,
            handshake_timeout=self.handshake_timeout,
            max_connections=self.max_connections,
            max_connections_per_peer=self.max_connections_per_peer,
            max_handshakes=self.max_handshakes,
            connection=connection,
        )


def one_line(error: ValidationError, prefix: str = "") -> str:
    """Every error as ``key: message``, joined by ``; `` (keys under ``prefix``, e.g. "routes.0.options")."""
    problems = []
    for item in error.errors():
        key = ".".join(str(part) for part in (*([prefix] if prefix else []), *item["loc"]))
        message = item["msg"].removeprefix("Value error, ")
        problems.append(f"{key}: {message}" if key else message)
    return "; ".join(problems)


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file's top-level mapping; ConfigError naming the file otherwise."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of keys")
    return data


def load_settings(cls: type[_Settings], path: Path | None) -> _Settings:
    """``cls`` read from ``path`` (YAML) with ``IOP_`` overrides; ConfigError on any bad value."""
    data = read_yaml(path) if path is not None else {}

    class _FromFile(cls):  # type: ignore[valid-type,misc]  # a subclass that knows the file
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
        settings: _Settings = _FromFile()
    except ValidationError as exc:
        raise ConfigError(one_line(exc)) from None
    return settings
