"""The node's composition root: settings in, a running node out. Nothing is built at import time.

:class:`NodeApp` owns the lifecycle. ``start`` puts every part onto one ``AsyncExitStack`` in
order (what a killed node left running in engines_dir is killed; adapters, run history, the task
group of background loops, listener, a registration per control-plane and the certificate's
renewal, metrics); ``stop`` drains the node, then unwinds
the stack in reverse: metrics, renewal and registrations stop, the listener closes (ending its runs), the
task group waits for its loops, the history commits and closes, the adapters close; whatever
fails, the rest still closes. A part that cannot start raises :class:`StartError` naming its
setting, after the parts before it closed.

``reload`` reads the config file's routes again (SIGHUP, ``nodes.reload``), one reload at a time:
it builds and starts adapters for the added and changed routes only, switches the node's route
table in one step (:meth:`Node.replace_routes`), and tells each control-plane the node's new
capabilities and status at once. A new route that shares an adapter with routes left unchanged (a
second ``vllm`` route, say) gets an instance of its own; the old instance keeps serving its routes.
A config that does not load changes nothing (ConfigError, one line naming the key).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import start_http_server
from pydantic import ValidationError

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters import REGISTRY
from iop_node.core import Node
from iop_node.engines import kill_leftovers, served_adapter
from iop_node.metrics import NodeMetrics
from iop_node.ports import Adapter, RunStore
from iop_node.reload import ReloadSummary, RouteChanges, diff_routes, renumbered, restart_keys
from iop_node.renewal import CertificateRenewal
from iop_node.router import Limits, Router
from iop_node.settings import ConfigError, Problem, Settings, StartError, load_settings
from iop_node.store import SqliteRunStore
from iop_node.transport import Registration, node_handler
from iop_wire.connection import ConnectionConfig
from iop_wire.dialer import Links
from iop_wire.endpoint import Listener
from iop_wire.errors import IopError
from iop_wire.metrics import expose
from iop_wire.settings import bind_error, problems, resolve_paths
from iop_wire.tls import Role

__all__ = ["NodeApp", "build_adapters", "build_node"]

_log = structlog.get_logger("iop.node")
_CLIENT_ROLES = frozenset({Role.EDGE, Role.CONTROL_PLANE, Role.WORKER, Role.ADMIN})


def build_adapters(
    settings: Settings, *, base: Path | None = None, metrics: NodeMetrics | None = None
) -> dict[str, Adapter]:
    """One adapter per adapter name in the route table, each given its routes' checked options, and
    one per route with an engine (its server's supervisor), keyed by ``route.adapter_key``.

    Relative paths in the options (and an engine's ``serve``) are taken from ``base`` (the config
    file's folder) when given. ConfigError lists every bad route at once.
    """
    per_adapter: dict[str, dict[str, Any]] = {}
    served: dict[str, Adapter] = {}
    found: list[Problem] = []
    for index, route in enumerate(settings.routes):
        if route.adapter not in REGISTRY:
            known = ", ".join(sorted(REGISTRY))
            found.append(Problem(f"routes.{index}.adapter", f"unknown adapter {route.adapter!r} (known: {known})"))
            continue
        options_model, _ = REGISTRY[route.adapter]
        if route.engine is not None:
            try:
                served[route.adapter_key] = served_adapter(
                    route, index, speaker=REGISTRY[route.adapter], engines_dir=settings.engines_dir, base=base,
                    metrics=metrics or NodeMetrics(),
                )  # fmt: skip
            except ConfigError as exc:
                found += exc.problems
            continue
        data = dict(route.options) if base is None else resolve_paths(options_model, route.options, base)
        if "target" in options_model.model_fields:  # adapters that check their backend's model list
            data["target"] = route.target or route.model
        try:
            per_adapter.setdefault(route.adapter, {})[route.model] = options_model.model_validate(data)
        except ValidationError as exc:
            found += problems(exc, f"routes.{index}.options")
    if found:
        raise ConfigError(found)
    return {**{name: REGISTRY[name][1](models) for name, models in per_adapter.items()}, **served}


@dataclass
class NodeApp:
    """A built node and the parts around it, started and stopped together (also ``async with``)."""

    settings: Settings
    node: Node
    store: RunStore
    metrics: NodeMetrics
    connection_config: ConnectionConfig
    listener: Listener | None = None
    registration: Registration | None = None
    """The registration with the first control-plane (one of :attr:`registrations`)."""
    registrations: list[Registration] = field(default_factory=list)
    """One per control-plane (``control_plane.address`` or ``addresses``)."""
    renewal: CertificateRenewal | None = None
    metrics_port: int | None = None
    config_path: Path | None = None
    """The config file ``reload`` reads again; None for a node started without one (``--dev``)."""
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    _reloading: asyncio.Lock = field(default_factory=asyncio.Lock)
    _start_ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once ``start`` returned or failed: a reload (SIGHUP during the start) waits for it."""
    _serving: bool = False
    _stopping: bool = False

    async def __aenter__(self) -> NodeApp:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def start(self) -> NodeApp:
        """Open the history, then listen, register and serve metrics; StartError names what could not start."""
        try:
            await self._kill_leftovers()
            # Built already: closed even if nothing else starts; at stop, whichever instances serve then.
            self._stack.push_async_callback(self._close_adapters)
            self._stack.push_async_callback(self.node.stop_retiring)  # unwound first: closes the retired ones
            for adapter in self.node.adapters.values():
                await adapter.start()  # an engine's server starts; its model is unavailable until ready
            await self._open_store()
            tasks = await self._stack.enter_async_context(asyncio.TaskGroup())
            if self.settings.listen.enabled:
                await self._listen()
            if self.settings.control_plane.all_addresses:
                self._register(tasks)
            if self.settings.metrics.port is not None:
                self._serve_metrics(self.settings.metrics.host, self.settings.metrics.port)
        except BaseException:
            await self._stack.aclose()
            raise
        finally:
            self._start_ended.set()
        self._serving = True
        port = self.listener.port if self.listener else None
        _log.info("node started", node_id=self.node.node_id, port=port, metrics_port=self.metrics_port)
        return self

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop: refuse new runs, let in-flight ones finish for ``grace`` s, then close every part."""
        grace = self.settings.shutdown_grace if grace is None else grace
        self._stopping = True
        try:
            self.node.drain()  # refuse new runs, and say so to the control-plane
            if self.listener is not None:
                self.listener.stop_accepting()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.node.wait_idle(), grace)
        finally:  # whatever failed above, every part is closed and the history committed
            await self._stack.aclose()
        _log.info("node stopped", node_id=self.node.node_id)

    async def _kill_leftovers(self) -> None:
        """Kill the servers a killed node left running (also before a reload adds the first engine)."""
        directory = self.settings.engines_dir
        try:
            await asyncio.to_thread(kill_leftovers, directory)
        except OSError as exc:
            cause = f"{exc.strerror} ({exc.filename})" if exc.strerror else str(exc)
            raise StartError([Problem("engines_dir", f"cannot clean up {directory}: {cause}")]) from None

    async def _close_adapters(self) -> None:
        for adapter in list(self.node.adapters.values()):
            try:
                await adapter.aclose()
            except Exception:  # noqa: BLE001 - one adapter failing to close must not keep the others open
                _log.exception("adapter close failed", node_id=self.node.node_id, adapter=adapter.name)

    async def reload(self) -> ReloadSummary:
        """Read the config file's routes again and serve them, one reload at a time; ConfigError (naming the
        key) when it does not load, the routes in force staying as they are. Waits for ``start`` to end
        (a SIGHUP while the node starts)."""
        await self._start_ended.wait()
        async with self._reloading:
            if self._stopping or not self._serving:
                raise IopError(
                    pb.ERROR_CODE_SHUTTING_DOWN,
                    f"node {self.node.node_id} is not serving (stopping, or its start failed); not reloaded",
                )
            try:
                summary = await self._reload()
            except ConfigError as exc:
                self.metrics.reloads.labels("bad_config").inc()
                _log.error("reload refused; the routes stay as they were", node_id=self.node.node_id, reason=str(exc))
                raise
            self.metrics.reloads.labels("applied").inc()
            changes = summary.changes
            _log.info(
                "routes reloaded",
                node_id=self.node.node_id,
                added=[route.model for route in changes.added],
                removed=list(changes.removed),
                replaced=[route.model for route in changes.replaced],
                unchanged=len(changes.unchanged),
                finishing=summary.finishing,
            )
            if changes.changed:
                for registration in self.registrations:
                    registration.routes_changed()
            return summary

    async def _reload(self) -> ReloadSummary:
        path = self.config_path
        if path is None:
            raise ConfigError("this node was started without a config file (--dev): there is nothing to reload")
        renewing = self.renewal.installing if self.renewal is not None else asyncio.Lock()
        try:
            async with renewing:  # the settings' check finishes a renewal it finds half done
                read = await asyncio.to_thread(load_settings, path)
        except ConfigError as exc:
            raise exc.located(path) from None
        restart = restart_keys(self.settings, read)
        if restart:
            _log.warning("settings that need a restart changed; not applied", node_id=self.node.node_id, keys=restart)
        failed = {load.model for load in self.node.status().models if load.served.state == pb.SERVED_STATE_FAILED}
        changes = diff_routes(self.node.routes, read.routes, again=failed)  # a failed server is started again
        built = await self._start_adapters(read, changes, path)
        if self._stopping:  # the node began to stop while they started: not left running past its stop
            for adapter in built.values():
                with contextlib.suppress(Exception):
                    await adapter.aclose()
            raise IopError(pb.ERROR_CODE_SHUTTING_DOWN, f"node {self.node.node_id} is stopping; not reloaded")
        finishing = self.node.replace_routes(changes, built, read.reload_grace) if changes.changed else 0
        self.settings = self.settings.model_copy(update={"routes": read.routes, "reload_grace": read.reload_grace})
        return ReloadSummary(self.node.node_id, changes, finishing, tuple(restart))

    async def _start_adapters(self, read: Settings, changes: RouteChanges, path: Path) -> dict[str, Adapter]:
        """Adapters for the added and replaced routes, started; ConfigError naming the route's place in the file."""
        routes = changes.built
        try:
            # engines_dir needs a restart (restart_keys): the new servers go where the running ones are
            subset = read.model_copy(update={"routes": list(routes), "engines_dir": self.settings.engines_dir})
            built = build_adapters(subset, base=path.parent, metrics=self.metrics)
        except ConfigError as exc:
            indices = [read.routes.index(route) for route in routes]
            raise renumbered(exc, indices).located(path) from None
        try:
            for adapter in built.values():
                await adapter.start()
        except BaseException:
            for adapter in built.values():
                with contextlib.suppress(Exception):  # the error that stopped the start is the one to tell
                    await adapter.aclose()
            raise
        return built

    async def _open_store(self) -> None:
        path = self.settings.store_path
        if problem := await asyncio.to_thread(_unusable_file, path):
            raise StartError([Problem("store_path", f"cannot open the run history {path}: {problem}")])
        try:
            interrupted = await self.store.open()
        except (OSError, sqlite3.Error, RuntimeError) as exc:  # the SQLite store's ways to refuse a file
            cause = f"{exc.strerror} ({exc.filename})" if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise StartError([Problem("store_path", f"cannot open the run history {path}: {cause}")]) from None
        self._stack.push_async_callback(self.store.aclose)
        if interrupted:
            _log.warning("runs interrupted by an earlier stop", node_id=self.node.node_id, count=interrupted)

    async def _listen(self) -> None:
        config = self.settings.listen.config(self.settings.tls, self.connection_config, _CLIENT_ROLES)
        try:
            self.listener = await Listener(config, node_handler(self.node)).start()
        except ssl.SSLError as exc:  # the files were checked at load; changed since?
            raise StartError([Problem("tls", f"OpenSSL cannot use these files: {exc.reason or exc}")]) from None
        except OSError as exc:
            raise bind_error("listen", config.host, config.port, exc) from None
        self._stack.push_async_callback(self.listener.close, "node shutting down")

    def _register(self, tasks: asyncio.TaskGroup) -> None:
        settings, registered = self.settings, asyncio.Event()  # the ready file's "registered": with any
        for address in settings.control_plane.all_addresses:
            registration = Registration(
                self.node,
                settings.control_plane,
                settings.tls.config(),
                self.connection_config,
                address=address,
                registered=registered,
                reload=self.reload,
            )
            task = tasks.create_task(registration.run_forever(), name=f"iop-register-{address}")
            self._stack.push_async_callback(_stop_registration, registration, task)
            self.registrations.append(registration)
        self.registration = self.registrations[0]
        tls = settings.tls
        if tls.enabled and tls.cert is not None and tls.key is not None:
            links = Links([registration.link for registration in self.registrations])
            self._renew(tasks, CertificateRenewal(tls.cert, tls.key, links.connected))

    def _renew(self, tasks: asyncio.TaskGroup, renewal: CertificateRenewal) -> None:
        """Keep the certificate renewed over the registration's connection (a joined node's lives days)."""
        renewing = tasks.create_task(renewal.run_forever(), name="iop-renew-certificate")
        self._stack.callback(renewing.cancel)
        self.renewal = renewal

    def _serve_metrics(self, host: str, port: int) -> None:
        try:
            server, _ = start_http_server(port, host, self.metrics.registry)
        except OSError as exc:
            raise bind_error("metrics", host, port, exc) from None
        self._stack.callback(server.server_close)
        self._stack.callback(server.shutdown)  # unwound first: stop serving, then close the socket
        self.metrics_port = server.server_port


def _unusable_file(path: Path) -> str | None:
    """Why ``path`` cannot be a file this process creates or writes, as far as the file system says beforehand.

    SQLite would say it too, less clearly ("unable to open database file").
    """
    if path.is_dir():
        return "it is a folder; name a file in it"
    if path.exists():
        return None if os.access(path, os.R_OK | os.W_OK) else "permission denied"
    folder = next(parent for parent in path.parents if parent.exists())  # the root always exists
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    return None if os.access(folder, os.W_OK | os.X_OK) else f"cannot create files in {folder} (permission denied)"


async def _stop_registration(registration: Registration, task: asyncio.Task[None]) -> None:
    """Close the control-plane connection gracefully, then end its loop (the task group waits for it)."""
    await registration.stop()
    task.cancel()


def build_node(
    settings: Settings,
    *,
    store: RunStore | None = None,
    adapters: Mapping[str, Adapter] | None = None,
    metrics: NodeMetrics | None = None,
    config_dir: Path | None = None,
    config_path: Path | None = None,
) -> NodeApp:
    """Wire a node from ``settings``; tests pass real or other parts through the same function.

    ``config_path``: the config file ``settings`` came from, read again by ``NodeApp.reload``;
    ``config_dir``: the folder relative paths in route options are taken from (default: ``config_path``'s).
    """
    if config_path is not None:
        config_path = config_path.absolute()  # reloads find it, whatever the working folder then
        config_dir = config_dir or config_path.parent
    if metrics is None:
        metrics = NodeMetrics()
        expose(metrics.registry)  # the wire's limits and connections, served with the node's metrics
    store = store or SqliteRunStore(settings.store_path, settings.node_id, metrics=metrics)
    router = Router(settings.routes, Limits(settings.max_prompt_chars, settings.max_tokens_limit))
    node = Node(
        node_id=settings.node_id,
        router=router,
        adapters=adapters or build_adapters(settings, base=config_dir, metrics=metrics),
        store=store,
        metrics=metrics,
        version=version("iop"),
    )
    config = settings.connection.config(
        heartbeat_interval=settings.heartbeat_interval, max_frame_size=settings.max_frame_size
    )
    return NodeApp(
        settings=settings, node=node, store=store, metrics=metrics, connection_config=config, config_path=config_path
    )
