"""The node's composition root: settings in, a running node out. Nothing is built at import time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

import structlog
from prometheus_client import start_http_server
from pydantic import ValidationError

from iop_node.adapters import REGISTRY
from iop_node.core import Node
from iop_node.metrics import NodeMetrics
from iop_node.ports import Adapter, RunStore
from iop_node.router import Limits, Router
from iop_node.settings import ConfigError, Settings, one_line
from iop_node.store import SqliteRunStore
from iop_node.transport import Registration, node_handler
from iop_wire.connection import ConnectionConfig
from iop_wire.endpoint import Listener
from iop_wire.metrics import expose
from iop_wire.tls import Role

__all__ = ["NodeApp", "build_adapters", "build_node"]

_log = structlog.get_logger("iop.node")
_CLIENT_ROLES = frozenset({Role.EDGE, Role.CONTROL_PLANE, Role.WORKER, Role.ADMIN})


def build_adapters(settings: Settings) -> dict[str, Adapter]:
    """One adapter per adapter name in the route table, each given its routes' checked options."""
    per_adapter: dict[str, dict[str, Any]] = {}
    for index, route in enumerate(settings.routes):
        if route.adapter not in REGISTRY:
            known = ", ".join(sorted(REGISTRY))
            raise ConfigError(f"routes.{index}.adapter: unknown adapter {route.adapter!r} (known: {known})")
        options_model, _ = REGISTRY[route.adapter]
        data = dict(route.options)
        if "target" in options_model.model_fields:  # adapters that check their backend's model list
            data["target"] = route.target or route.model
        try:
            options = options_model.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(one_line(exc, f"routes.{index}.options")) from None
        per_adapter.setdefault(route.adapter, {})[route.model] = options
    return {name: REGISTRY[name][1](models) for name, models in per_adapter.items()}


@dataclass
class NodeApp:
    """A built node and the parts around it, started and stopped together."""

    settings: Settings
    node: Node
    store: RunStore
    metrics: NodeMetrics
    connection_config: ConnectionConfig
    listener: Listener | None = None
    registration: Registration | None = None
    metrics_port: int | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _metrics_server: Any = None

    async def start(self) -> NodeApp:
        """Open the store, start listening, registering and serving metrics."""
        if isinstance(self.store, SqliteRunStore):
            interrupted = await self.store.open()
            if interrupted:
                _log.warning("runs interrupted by an earlier stop", node_id=self.node.node_id, count=interrupted)
        settings = self.settings
        if settings.listen.enabled:
            config = settings.listen.config(settings.tls, self.connection_config, _CLIENT_ROLES)
            self.listener = await Listener(config, node_handler(self.node)).start()
        if settings.control_plane.address:
            self.registration = Registration(
                self.node, settings.control_plane, settings.tls.config(), self.connection_config
            )
            self._tasks.append(asyncio.create_task(self.registration.run_forever(), name="iop-register"))
        if settings.metrics.port is not None:
            self._metrics_server, _ = start_http_server(
                settings.metrics.port, settings.metrics.host, self.metrics.registry
            )
            self.metrics_port = self._metrics_server.server_port
        _log.info("node started", node_id=self.node.node_id, port=self.listener.port if self.listener else None)
        return self

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop: refuse new runs, let in-flight ones finish for ``grace`` s, cancel the rest."""
        grace = self.settings.shutdown_grace if grace is None else grace
        try:
            self.node.drain()  # refuse new runs, and say so to the control-plane
            if self.listener is not None:
                self.listener.stop_accepting()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.node.wait_idle(), grace)
            if self.registration is not None:
                await self.registration.stop()
            for task in self._tasks:
                task.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=self.connection_config.close_timeout)
            if self.listener is not None:
                await self.listener.close("node shutting down")
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
                self._metrics_server.server_close()
            for adapter in self.node.adapters.values():
                closer = getattr(adapter, "aclose", None)
                if closer is not None:
                    await closer()
        finally:  # whatever failed above, the history is committed and closed
            if isinstance(self.store, SqliteRunStore):
                await self.store.close()
        _log.info("node stopped", node_id=self.node.node_id)


def build_node(
    settings: Settings,
    *,
    store: RunStore | None = None,
    adapters: Mapping[str, Adapter] | None = None,
    metrics: NodeMetrics | None = None,
) -> NodeApp:
    """Wire a node from ``settings``; tests pass real or other parts through the same function."""
    if metrics is None:
        metrics = NodeMetrics()
        expose(metrics.registry)  # the wire's limits and connections, served with the node's metrics
    store = store or SqliteRunStore(settings.store_path, settings.node_id)
    router = Router(settings.routes, Limits(settings.max_prompt_chars, settings.max_tokens_limit))
    node = Node(
        node_id=settings.node_id,
        router=router,
        adapters=adapters or build_adapters(settings),
        store=store,
        metrics=metrics,
        version=version("iop"),
    )
    config = settings.connection.config(
        heartbeat_interval=settings.heartbeat_interval, max_frame_size=settings.max_frame_size
    )
    return NodeApp(settings=settings, node=node, store=store, metrics=metrics, connection_config=config)
