"""Settings pieces every IOP service shares: TLS, listening, connection limits, and the loader.

A service's settings are one pydantic-settings class read from a YAML file and overridden by
``IOP_`` environment variables (nested keys joined by ``__``: ``IOP_LISTEN__PORT=7500``).
:func:`load_settings` reads them; relative paths in the file are taken from the file's folder.
Any bad value raises :class:`ConfigError`, whose message is one line naming every bad key and
its line in the file; a value that passed but could not be used at start-up (a port in use) is
a :class:`StartError` built by :func:`bind_error`.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePath
from typing import Any, Literal, Protocol, Self, TypeVar, get_args, get_origin

import yaml
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource

from iop_wire.connection import ConnectionConfig
from iop_wire.dialer import Backoff, Target
from iop_wire.endpoint import ListenerConfig
from iop_wire.framing import DEFAULT_MAX_FRAME_SIZE
from iop_wire.logs import configure
from iop_wire.tls import Role, TlsConfig, server_context

__all__ = [
    "ConfigError",
    "ConnectionSettings",
    "ControlPlaneAddress",
    "EventLoop",
    "ListenSettings",
    "Problem",
    "Section",
    "SettingError",
    "StartError",
    "TlsSettings",
    "bind_error",
    "load_settings",
    "loop_factory",
    "one_line",
    "problems",
    "resolve_paths",
    "run_service",
    "write_ready_file",
]

_Settings = TypeVar("_Settings", bound=BaseSettings)
EventLoop = Literal["uvloop", "asyncio"]
"""The event loop a service process runs on (its ``event_loop`` setting): uvloop (libuv) or the standard library's."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One bad setting."""

    key: str
    """Dotted path of the setting (``routes.0.options.argv``); empty for the file as a whole."""
    message: str
    """What is wrong with it."""
    line: int | None = None
    """Line of the key in the YAML file, when known."""

    def __str__(self) -> str:
        where = " ".join(part for part in (self.key, f"(line {self.line})" if self.line else "") if part)
        return f"{where}: {self.message}" if where else self.message


class ConfigError(Exception):
    """Configuration problems, as one line naming every bad key (with its line in the file when known)."""

    def __init__(self, problems: str | Sequence[Problem]) -> None:
        self.problems = (Problem("", problems),) if isinstance(problems, str) else tuple(problems)
        super().__init__("; ".join(str(problem) for problem in self.problems))

    def located(self, source: Path, env_prefix: str = "IOP_") -> Self:
        """The same problems with the line of each key in the YAML file ``source``.

        A key the environment sets (``IOP_LISTEN__PORT`` for ``listen.port``) gets no line: its
        value did not come from the file.
        """
        tree = _compose(source)
        if tree is None:
            return self
        return type(self)(
            [
                problem
                if problem.line or not problem.key
                else replace(problem, line=_line(tree, problem.key, env_prefix))
                for problem in self.problems
            ]
        )


class StartError(ConfigError):
    """A setting that passed validation but could not be used at start-up: a port in use, a locked file."""


class SettingError(ValueError):
    """Raised by a validator for problems with keys below the model it checks.

    ``SettingError(("cert", "no such file x"))`` inside ``tls`` reads ``tls.cert: no such file x``;
    :func:`problems` takes the keys from here instead of the validator's own location.
    """

    def __init__(self, *found: tuple[str, str]) -> None:
        super().__init__("; ".join(f"{key}: {message}" if key else message for key, message in found))
        self.found = found


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
        if not self.enabled:
            return self
        if found := _tls_problems(self.cert, self.key, self.ca):
            raise SettingError(*found)
        try:  # what the listener and dialers will do with them
            server_context(self.config())
        except OSError as exc:  # ssl.SSLError included
            reason = getattr(exc, "reason", None) or exc.strerror or exc
            raise SettingError(("", f"OpenSSL cannot use these files: {reason}")) from None
        return self

    def config(self) -> TlsConfig:
        """The wire's frozen form."""
        return TlsConfig(enabled=self.enabled, cert=self.cert, key=self.key, ca=self.ca)


class ConnectionSettings(Section):
    """Per-connection limits (see ``iop_wire.connection.ConnectionConfig``)."""

    max_peer_interval: float = Field(10.0, gt=0)
    """Largest heartbeat interval a peer may announce, seconds: a peer is judged by the interval it
    announces (3 missed ones), capped at this, so a silent one is closed within 3 x this."""
    frame_timeout: float = Field(30.0, gt=0)
    """Seconds a frame may take to arrive whole once its first byte came."""
    max_runs: int = Field(1024, ge=1)
    """Runs one connection may have in progress here; more are refused RESOURCE_EXHAUSTED."""
    max_requests: int = Field(64, ge=1)
    """Other requests (capabilities, node.*) answered at once per connection."""
    run_buffer_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024)
    """Bytes of one run's output kept while its reader is behind; past it that run alone is cancelled
    (RESOURCE_EXHAUSTED, reason SLOW_CONSUMER)."""
    read_pause_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024)
    """Reading from a peer pauses while this many bytes wait to be sent to it."""
    flush_delay: float = Field(0.0, ge=0, le=0.05)
    """Seconds a run's later events may wait to be written together with others (first token and end never wait)."""

    def config(self, *, heartbeat_interval: float, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> ConnectionConfig:
        """The wire's frozen form, with the service's heartbeat interval and frame limit."""
        return ConnectionConfig(
            heartbeat_interval=heartbeat_interval,
            max_frame_size=max_frame_size,
            **self.model_dump(),
        )


class ControlPlaneAddress(Section):
    """The control-plane(s) a service dials (a node registering, an edge or a worker submitting runs).

    One (``address``) or several (``addresses``, active-active): a node registers with each, an
    edge or a worker keeps connections to each and spreads runs over those that are up.
    """

    address: str | None = None
    """``host:port`` of the control-plane; unset means none (or see ``addresses``)."""
    addresses: list[str] | None = None
    """Several control-planes (``[cp-a:7400, cp-b:7400]``), instead of ``address``."""
    server_name: str | None = None
    """Name to verify in the control-plane's certificate; defaults to the host."""
    reconnect_initial: float = Field(0.5, gt=0)
    """First reconnect delay, seconds; doubles per failure, with jitter."""
    reconnect_max: float = Field(30.0, gt=0)
    """Largest reconnect delay, seconds."""

    @field_validator("address")
    @classmethod
    def _host_and_port(cls, address: str | None) -> str | None:
        if address is not None:
            _check_address(address)
        return address

    @field_validator("addresses")
    @classmethod
    def _hosts_and_ports(cls, addresses: list[str] | None) -> list[str] | None:
        if addresses is None:
            return None
        if not addresses:
            raise ValueError("name at least one host:port, or leave addresses unset")
        for address in addresses:
            _check_address(address)
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"an address is named twice in {addresses}")
        return addresses

    @model_validator(mode="after")
    def _one_form(self) -> Self:
        if self.addresses is not None and "address" in self.model_fields_set and self.address is not None:
            raise SettingError(("addresses", "set address or addresses, not both"))
        return self

    @property
    def all_addresses(self) -> tuple[str, ...]:
        """Every control-plane's ``host:port``: ``addresses``, else ``address``; empty when neither."""
        if self.addresses is not None:
            return tuple(self.addresses)
        return (self.address,) if self.address is not None else ()

    def endpoint(self, address: str | None = None) -> tuple[str, int]:
        """``address`` (default: the first of :attr:`all_addresses`) as (host, port); the host
        defaults to 127.0.0.1 and loses IPv6 brackets."""
        address = address or self.all_addresses[0]
        host, _, port = address.rpartition(":")
        return host.removeprefix("[").removesuffix("]") or "127.0.0.1", int(port)

    def target(
        self,
        tls: TlsConfig,
        connection: ConnectionConfig,
        role: Role = Role.CONTROL_PLANE,
        *,
        address: str | None = None,
    ) -> Target:
        """How to dial ``address`` (default: the first): with ``tls``, the peer's certificate checked
        for ``server_name`` and ``role``."""
        host, port = self.endpoint(address)
        expect = {role} if tls.enabled else None
        return Target(
            host, port, tls=tls, server_hostname=self.server_name or host, expect_roles=expect, connection=connection
        )

    def targets(self, tls: TlsConfig, connection: ConnectionConfig, role: Role = Role.CONTROL_PLANE) -> list[Target]:
        """How to dial each of :attr:`all_addresses`, in order."""
        return [self.target(tls, connection, role, address=address) for address in self.all_addresses]

    def backoff(self) -> Backoff:
        """The redial delays: ``reconnect_initial`` doubling up to ``reconnect_max``."""
        return Backoff(self.reconnect_initial, self.reconnect_max)


def _check_address(address: str) -> None:
    _, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} has no port: write host:port, for example cp.internal:7400")


class ListenSettings(Section):
    """Where a service listens, and how many connections it takes."""

    host: str | list[str] = "127.0.0.1"
    """Address to bind, or several (``[127.0.0.1, 10.0.0.5]``): one socket each, all on ``port``."""
    port: int = Field(0, ge=0, le=65535)
    """Port to bind; 0 picks a free one (the same for every host)."""
    enabled: bool = True
    """Listen at all."""
    max_connections: int = Field(1024, ge=1)
    """Connections open at once; more are closed at accept."""
    max_connections_per_peer: int = Field(64, ge=1)
    """Connections open at once per certificate name."""
    max_handshakes: int = Field(64, ge=1)
    """TLS handshakes under way at once; more are closed at accept."""
    max_handshakes_per_address: int = Field(16, ge=1)
    """TLS handshakes under way at once from one source IP address; more from it are closed at
    accept, so one address cannot take every handshake slot."""
    handshake_timeout: float = Field(10.0, gt=0)
    """Seconds a dialer has for the TLS handshake and the preface."""
    first_byte_timeout: float = Field(3.0, gt=0)
    """Seconds an accepted socket may send nothing (a TLS client says hello at once); then it is closed."""

    @field_validator("host")
    @classmethod
    def _some_host(cls, host: str | list[str]) -> str | list[str]:
        if isinstance(host, list) and not host:
            raise ValueError("name at least one address to listen on")
        if isinstance(host, list) and len(set(host)) != len(host):
            raise ValueError(f"an address is named twice in {host}")
        return host

    @property
    def hosts(self) -> tuple[str, ...]:
        """``host`` as a tuple of one or more addresses."""
        return (self.host,) if isinstance(self.host, str) else tuple(self.host)

    def config(
        self, tls: TlsSettings, connection: ConnectionConfig, allowed_roles: frozenset[Role] | None
    ) -> ListenerConfig:
        """The wire's listener config; roles are checked only with TLS (there are none without)."""
        return ListenerConfig(
            hosts=self.hosts,
            port=self.port,
            tls=tls.config(),
            allowed_roles=allowed_roles if tls.enabled else None,
            handshake_timeout=self.handshake_timeout,
            max_connections=self.max_connections,
            max_connections_per_peer=self.max_connections_per_peer,
            max_handshakes=self.max_handshakes,
            max_handshakes_per_address=self.max_handshakes_per_address,
            first_byte_timeout=self.first_byte_timeout,
            connection=connection,
        )


def problems(error: ValidationError, prefix: str = "") -> list[Problem]:
    """Every error of ``error`` as a :class:`Problem`, keys under ``prefix`` (e.g. "routes.0.options")."""
    found = []
    for item in error.errors():
        where = [*([prefix] if prefix else []), *(str(part) for part in item["loc"])]
        cause = item.get("ctx", {}).get("error")
        if isinstance(cause, SettingError):
            found += [Problem(".".join([*where, key] if key else where), message) for key, message in cause.found]
        else:
            found.append(Problem(".".join(where), item["msg"].removeprefix("Value error, ")))
    return found


def one_line(error: ValidationError, prefix: str = "") -> str:
    """Every error as ``key: message``, all of them joined by ``; `` (keys under ``prefix``)."""
    return "; ".join(str(problem) for problem in problems(error, prefix))


def bind_error(key: str, host: str, port: int, exc: OSError) -> StartError:
    """What failed when binding ``host:port`` for the setting ``key`` (``listen``, ``metrics``), in one line."""
    address = f"{host}:{port}"
    if isinstance(exc, socket.gaierror):
        return StartError([Problem(f"{key}.host", f"cannot resolve {host!r} ({exc.strerror})")])
    if exc.errno == errno.EADDRINUSE:
        return StartError([Problem(f"{key}.port", f"{address} is in use")])
    if exc.errno == errno.EACCES:
        return StartError([Problem(f"{key}.port", f"{address}: permission denied (ports below 1024 need privileges)")])
    if exc.errno == errno.EADDRNOTAVAIL:
        return StartError([Problem(f"{key}.host", f"{host} is not an address of this machine")])
    return StartError([Problem(key, f"cannot listen on {address}: {exc.strerror or exc}")])


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file's top-level mapping; ConfigError naming the file otherwise."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path}: not valid YAML{where} ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of keys")
    return data


def resolve_paths(model: type[BaseModel], data: Mapping[str, Any], base: Path) -> dict[str, Any]:
    """``data`` (a mapping for ``model``) with each relative path of a Path field taken from ``base``.

    A config file names certificates, keys and databases relative to its own folder, wherever
    the service was started from. Values of the environment are not passed here: they stay
    relative to the working folder.
    """
    resolved = dict(data)
    for name, value in data.items():
        field = model.model_fields.get(name)
        if field is not None:
            resolved[name] = _resolve(_kinds(field.annotation), value, base)
    return resolved


def load_settings(cls: type[_Settings], path: Path | None) -> _Settings:
    """``cls`` read from ``path`` (YAML) with ``IOP_`` overrides; ConfigError on any bad value."""
    data = resolve_paths(cls, read_yaml(path), path.absolute().parent) if path is not None else {}

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
        error = ConfigError(problems(exc))
        raise (error if path is None else error.located(path)) from None
    return settings


def _tls_problems(cert: Path | None, key: Path | None, ca: Path | None) -> list[tuple[str, str]]:
    """What is wrong with the three TLS files, each named by its key; empty when they can be used."""
    missing = [
        (name, "required when tls.enabled is true")
        for name, path in zip(("cert", "key", "ca"), (cert, key, ca), strict=True)
        if path is None
    ]
    if missing or cert is None or key is None or ca is None:
        return missing
    found: list[tuple[str, str]] = []
    certs = _pem(found, "cert", cert, x509.load_pem_x509_certificates, "holds no PEM certificate")
    private = _pem(found, "key", key, _private_key, "is not a PEM private key")
    _pem(found, "ca", ca, x509.load_pem_x509_certificates, "holds no PEM certificate")
    if certs and private is not None and _public(certs[0].public_key()) != _public(private.public_key()):
        found.append(("key", f"{key} does not belong to the certificate in tls.cert ({cert})"))
    return found


def _pem(found: list[tuple[str, str]], name: str, path: Path, parse: Any, wrong: str) -> Any:
    """``parse`` of the file at ``path``; None (and a problem for ``name`` in ``found``) when it cannot be."""
    try:
        return parse(path.read_bytes())
    except FileNotFoundError:
        found.append((name, f"no such file {path}"))
    except OSError as exc:
        found.append((name, f"cannot read {path}: {exc.strerror}"))
    except TypeError:  # cryptography's word for a key that needs a password
        found.append((name, f"{path} is encrypted; IOP needs an unencrypted key (keep it mode 0600)"))
    except (ValueError, UnsupportedAlgorithm):
        found.append((name, f"{path} {wrong}"))
    return None


def _private_key(data: bytes) -> Any:
    return serialization.load_pem_private_key(data, password=None)


def _public(key: Any) -> bytes:
    der: bytes = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return der


def _kinds(annotation: Any) -> list[Any]:
    """The classes an annotation is made of: ``list[Route] | None`` gives list, Route, NoneType."""
    origin, args = get_origin(annotation), get_args(annotation)
    if not args:
        return [annotation] if isinstance(annotation, type) else []
    return [*([origin] if isinstance(origin, type) else []), *(kind for arg in args for kind in _kinds(arg))]


def _resolve(kinds: list[Any], value: Any, base: Path) -> Any:
    if isinstance(value, str) and value and any(issubclass(kind, PurePath) for kind in kinds):
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else base / path)
    if isinstance(value, list):
        return [_resolve(kinds, item, base) for item in value]
    if isinstance(value, dict):
        models = [kind for kind in kinds if issubclass(kind, BaseModel)]
        return resolve_paths(models[0], value, base) if models else value
    return value


def _compose(source: Path) -> yaml.Node | None:
    """The YAML node tree of ``source`` (positions included); None when it cannot be read."""
    try:
        return yaml.compose(source.read_text(), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return None


def _line(tree: yaml.Node, key: str, env_prefix: str) -> int | None:
    """The line of ``key`` (dotted) in ``tree``, or of its nearest ancestor there; None if the environment set it."""
    parts = key.split(".")
    environment = {name.upper() for name in os.environ}
    for end in range(1, len(parts) + 1):
        if parts[end - 1].isdigit():
            break  # list items cannot be set one by one from the environment
        if (env_prefix + "__".join(parts[:end])).upper() in environment:
            return None
    line, node = None, tree
    for part in parts:
        child = _child(node, part)
        if child is None:
            break
        line, node = child[0].start_mark.line + 1, child[1]
    return line


def _child(node: yaml.Node, part: str) -> tuple[yaml.Node, yaml.Node] | None:
    """(the node that names ``part``, its value) below ``node``: a mapping's key or a sequence's item."""
    if isinstance(node, yaml.MappingNode):
        return next(((name, value) for name, value in node.value if name.value == part), None)
    if isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
        item: yaml.Node = node.value[int(part)]
        return item, item
    return None


def write_ready_file(path: Path, **fields: object) -> None:
    """Write a service's ready file (JSON, with its pid) in one step: a reader never sees half of it."""
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(json.dumps({"pid": os.getpid(), **fields}) + "\n")
        partial.replace(path)
    except OSError as exc:
        raise StartError([Problem("--ready-file", f"cannot write {path}: {exc.strerror}")]) from None


def loop_factory(name: EventLoop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """For ``asyncio.Runner``: uvloop's loop (libuv, C) where asked for, else None (the standard loop).

    uvloop took ~10-20% off the CPU a relayed token costs and ~0.1 ms off the control-plane hop
    (README, design).
    """
    if name == "uvloop":
        import uvloop  # noqa: PLC0415 - imported only by a process that runs on it

        return uvloop.new_event_loop
    return None


class _Service(Protocol):
    """What a service's settings (or app) tell run_service."""

    @property
    def log_level(self) -> str: ...

    @property
    def event_loop(self) -> EventLoop: ...


_S = TypeVar("_S", bound=_Service)


def run_service(
    command: str,
    config: Path,
    load: Callable[[Path], _S],
    serve: Callable[[_S], Coroutine[Any, Any, int]],
    *,
    log_level: str | None = None,
) -> int:
    """A service process from its config to its exit code: load the settings (ConfigError: one line
    on stderr, exit 2), configure logging (``log_level`` overrides the settings'), then ``serve``
    on the settings' event loop (StartError: one line naming the setting, exit 2).

    ``load`` may build more than the settings (a policy, an app) as long as it raises ConfigError.
    """
    try:
        settings = load(config)
    except ConfigError as exc:
        print(f"iop {command}: bad config: {exc.located(config)}", file=sys.stderr)
        return 2
    configure(log_level or settings.log_level)
    try:
        with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
            return runner.run(serve(settings))
    except StartError as exc:
        print(f"iop {command}: {exc.located(config)}", file=sys.stderr)
        return 2
