"""``iop node`` settings: a YAML file, overridden by ``IOP_`` environment variables.

Nested keys use ``__`` in the environment: ``IOP_LISTEN__PORT=7500`` overrides ``listen.port``.
A bad value raises :class:`ConfigError` whose message is one line naming every bad key.
Relative paths in the file (``tls.*``, ``store_path``, ``engines_dir``) are taken from the file's folder.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from iop_node.renewal import finish_interrupted_renewal
from iop_wire.framing import DEFAULT_MAX_FRAME_SIZE
from iop_wire.settings import (
    ConfigError,
    ConnectionSettings,
    ControlPlaneAddress,
    EventLoop,
    ListenSettings,
    Problem,
    SettingError,
    StartError,
    TlsSettings,
    one_line,
)
from iop_wire.settings import Section as _Section
from iop_wire.settings import load_settings as _load

__all__ = ["ConfigError", "Problem", "RouteSettings", "Settings", "StartError", "load_settings", "one_line"]

_log = structlog.get_logger("iop.node")


class NodeConnectionSettings(ConnectionSettings):
    """The node's connections: later tokens of a run may wait 2 ms to share a write (README, design)."""

    flush_delay: float = Field(0.002, ge=0, le=0.05)
    """Seconds a run's later events may wait to be written with others (first token and end never wait)."""


class NodeListenSettings(ListenSettings):
    """Where the node serves clients directly (standalone mode); false ``enabled`` for registered-only."""

    port: int = Field(7401, ge=0, le=65535)
    """Port to bind; 0 picks a free one."""


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
    adapter: str = ""
    """Adapter that serves it: mock, cli, vllm, ollama. A route with an ``engine`` may leave it out
    (llama.cpp, vllm and command servers are spoken to by the vllm adapter, ollama by the ollama one)."""
    engine: Literal["llama.cpp", "vllm", "ollama", "command"] | None = None
    """A model server the node runs, watches and restarts itself instead of one at a ``base_url``:
    llama.cpp (llama-cpp-python's server), vllm (``vllm serve``), ollama (``ollama serve``) or
    command (any command line serving an OpenAI-compatible API on the port the node gives it)."""
    serve: dict[str, Any] = Field(default_factory=dict)
    """The engine's settings (model file, threads, arguments, start timeout, probe, restarts, logs),
    checked by the engine's settings model at start-up; only with ``engine``."""
    target: str | None = None
    """The backend's name for the model; defaults to ``model``."""
    max_concurrency: int = Field(4, ge=1)
    """Runs of this model executed at once."""
    queue_size: int = Field(64, ge=0)
    """Runs that may wait for a slot; more are rejected with RESOURCE_EXHAUSTED."""
    defaults: SamplingDefaults = SamplingDefaults()
    """Sampling defaults."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Adapter options, checked by the adapter's options model at start-up (with an ``engine``, the
    node sets ``base_url`` to the server it runs)."""

    @model_validator(mode="after")
    def _adapter_or_engine(self) -> RouteSettings:
        if self.engine is None:
            if not self.adapter:
                raise SettingError(("adapter", "every route needs an adapter (mock, cli, vllm, ollama) or an engine"))
            if self.serve:
                raise SettingError(("serve", "is for routes with an engine; this route has none"))
            return self
        spoken_by = ENGINE_ADAPTERS[self.engine]
        if self.adapter and self.adapter != spoken_by:
            message = f"a {self.engine} engine is spoken to by the {spoken_by} adapter, not {self.adapter!r}"
            raise SettingError(("adapter", message))
        if "base_url" in self.options:
            raise SettingError(("options.base_url", "the node sets it to the engine it runs; leave it out"))
        object.__setattr__(self, "adapter", spoken_by)  # frozen: set once, while validating
        return self

    @property
    def adapter_key(self) -> str:
        """The key of the adapter instance serving this route: the adapter's name, shared by its routes;
        ``ENGINE:MODEL`` for a route with an engine, which has an instance (and a server) of its own."""
        return self.adapter if self.engine is None else f"{self.engine}:{self.model}"


ENGINE_ADAPTERS = {"llama.cpp": "vllm", "vllm": "vllm", "command": "vllm", "ollama": "ollama"}
"""The adapter that speaks to each engine's server."""


class ControlPlaneSettings(ControlPlaneAddress):
    """Registered mode: the control-plane this node dials (``address``), or every one of several
    (``addresses``): the node registers with each and reports its load to each."""

    status_step: int = Field(1, ge=1)
    """Send node.status at once when in-flight + queued changed by this much (a smaller change, or a
    model's availability, is sent at the next heartbeat interval)."""
    status_refresh: float = Field(10.0, gt=0)
    """Seconds between two node.status reports while nothing changed. The heartbeats prove the node
    alive meanwhile: 1,000 idle nodes send the control-plane 1,000 heartbeats and 100 reports a second,
    not 2,000 frames."""


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
    listen: NodeListenSettings = NodeListenSettings()
    tls: TlsSettings = TlsSettings()
    connection: NodeConnectionSettings = NodeConnectionSettings()
    """Limits every connection gets (runs, requests, frame time, unread bytes, heartbeat clamp)."""
    control_plane: ControlPlaneSettings = ControlPlaneSettings()
    metrics: MetricsSettings = MetricsSettings()
    store_path: Path = Path(".iop/node-runs.db")
    """SQLite file of the run history."""
    engines_dir: Path = Path(".iop/engines")
    """Folder of the servers this node runs (routes with an ``engine``): MODEL.log (rotated: .1 ..
    .N), MODEL.PID.pid (what the next start kills if this node died without stopping them) and a
    folder per model. Unset: ``engines`` beside ``store_path``, so that it follows the node's own
    files and not the folder the node was started from. One node's own: servers a dead node left
    there are killed at start."""
    heartbeat_interval: float = Field(1.0, gt=0)
    """Seconds between heartbeats on every connection (and between two looks at whether the load
    changed, for node.status): the control-plane judges the node by it, so a frozen node is out
    after 3 (3 s), with no new runs and its streams ended NODE_LOST."""
    max_frame_size: int = Field(DEFAULT_MAX_FRAME_SIZE, ge=1024)
    """Largest frame accepted, bytes."""
    max_prompt_chars: int = Field(1_000_000, ge=1)
    """Largest prompt (all message text together, with a continuation's delivered text), characters."""
    max_tokens_limit: int = Field(131_072, ge=1)
    """Largest max_tokens a request may ask for."""
    shutdown_grace: float = Field(30.0, ge=0)
    """On SIGTERM, seconds in-flight runs get to finish before they are cancelled."""
    reload_grace: float = Field(30.0, ge=0)
    """On a reload (SIGHUP, ``iop nodes reload``), seconds the runs of a removed or replaced route get to
    finish on its old adapter before they are cancelled (retryably: SHUTTING_DOWN)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level logged."""
    event_loop: EventLoop = "uvloop"
    """The event loop ``iop node`` runs on: uvloop (libuv) or the standard library's."""
    routes: list[RouteSettings] = Field(default_factory=list)
    """The route table."""

    @model_validator(mode="before")
    @classmethod
    def _engines_beside_the_history(cls, data: Any) -> Any:
        """``engines_dir`` unset: the ``engines`` folder beside ``store_path`` (itself resolved from the
        config file's folder), not a folder relative to wherever the node was started."""
        if isinstance(data, dict) and "engines_dir" not in data:
            store = data.get("store_path", cls.model_fields["store_path"].default)
            if isinstance(store, str | Path):
                data = {**data, "engines_dir": Path(store).parent / "engines"}
        return data

    @model_validator(mode="before")
    @classmethod
    def _finish_renewal(cls, data: Any) -> Any:
        """A certificate renewal the node was stopped in the middle of is completed before the
        ``tls`` files are checked as a pair (``iop_node.renewal.finish_interrupted_renewal``)."""
        tls = data.get("tls") if isinstance(data, dict) else None
        cert, key = (tls.get("cert"), tls.get("key")) if isinstance(tls, dict) else (None, None)
        if isinstance(cert, str | Path) and isinstance(key, str | Path):
            with contextlib.suppress(OSError):  # unreadable: the tls check says so, naming the key
                done = finish_interrupted_renewal(Path(cert), Path(key))
                if done:
                    _log.warning(done, cert=str(cert))
        return data

    @model_validator(mode="after")
    def _unique_models(self) -> Settings:
        seen: set[str] = set()
        for index, route in enumerate(self.routes):
            if route.model in seen:
                raise SettingError((f"routes.{index}.model", f"{route.model!r} is routed twice"))
            seen.add(route.model)
        return self


def load_settings(path: Path | None) -> Settings:
    """Read ``path`` (YAML) with ``IOP_`` overrides; ConfigError on any bad value."""
    return _load(Settings, path)
