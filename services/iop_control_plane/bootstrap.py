"""The control-plane's composition root: settings in, a running control-plane out.

:class:`ControlPlaneApp` puts every part onto one ``AsyncExitStack`` (the state store and the poll
of what replicas change in it, the node sessions, the listener, metrics) and unwinds it in
reverse on ``stop``. The listener serves each connection by its certificate's role: ``node``
registers and reports; ``edge`` and ``worker`` submit runs, ask capabilities and read (nodes, runs,
usage, the overview: :data:`iop_control_plane.admin.READ_ONLY`); ``admin`` also operates. Other
roles are refused
at the preface (PERMISSION_DENIED); a role sending what it may not gets PERMISSION_DENIED too.
With ``join.ca_key`` the listener also takes peers without a certificate, which may only join
(:mod:`iop_control_plane.joining`); a revoked certificate is refused at the preface. Without TLS
there are no roles: every peer may do everything (tests and local demos only).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog
from prometheus_client import start_http_server

from iop_control_plane.admin import READ_ONLY, Operations, PolicyInForce
from iop_control_plane.identity import IdentityStore
from iop_control_plane.joining import Joining
from iop_control_plane.metrics import ControlPlaneMetrics
from iop_control_plane.nodes import NodeSessions
from iop_control_plane.pg_store import PgStore
from iop_control_plane.policy import load_policy
from iop_control_plane.prefix import PrefixIndex
from iop_control_plane.registry import Registry
from iop_control_plane.relay import RunRelay
from iop_control_plane.replicas import Replicas
from iop_control_plane.scheduler import Scheduler
from iop_control_plane.settings import ConfigError, Problem, Settings, StartError
from iop_control_plane.settling import LeftOpenRuns
from iop_control_plane.sqlite_store import SqliteStore
from iop_control_plane.state import StateStore
from iop_control_plane.store import AuditStore
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import EventSink, Handler, Inbound, IopError, Listener, MessageHandler, PeerIdentity, Role
from iop_wire.certs import Authority, certificate_facts
from iop_wire.metrics import expose
from iop_wire.settings import EventLoop, bind_error

__all__ = ["ControlPlaneApp", "build_control_plane", "read_policy"]

_log = structlog.get_logger("iop.control_plane")
_ROLES = frozenset({Role.NODE, Role.EDGE, Role.WORKER, Role.ADMIN})
_NODE_MESSAGES = ("node_register", "node_status", "capability_response", "cert_renew")
_ADMIN_MESSAGES = (
    "nodes_list",
    "nodes_drain",
    "nodes_undrain",
    "nodes_remove",
    "nodes_reload",
    "policy_show",
    "policy_apply",
    "runs_list",
    "usage_list",
    "overview_show",
    "join_token_create",
    "join_tokens_list",
    "join_token_revoke",
)


def read_policy(path: Path | None) -> PolicyInForce:
    """The policy file's text, checked (ConfigError naming ``policy_path`` or the bad key)."""
    if path is None:
        return PolicyInForce()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([Problem("policy_path", f"cannot read {path}: {exc.strerror}")]) from None
    try:
        load_policy(text)
    except ConfigError as exc:
        raise ConfigError([Problem("policy_path", f"{path}: {exc}")]) from None
    return PolicyInForce(text, str(path))


@dataclass
class ControlPlaneApp:
    """A built control-plane, started and stopped together (also ``async with``)."""

    settings: Settings
    registry: Registry
    scheduler: Scheduler
    sessions: NodeSessions
    runs: RunRelay
    operations: Operations
    joining: Joining
    metrics: ControlPlaneMetrics
    replicas: Replicas
    left_open: LeftOpenRuns
    listener: Listener | None = None
    metrics_port: int | None = None
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    @property
    def log_level(self) -> str:
        """The settings' log level (what ``iop_wire.settings.run_service`` configures)."""
        return self.settings.log_level

    @property
    def event_loop(self) -> EventLoop:
        """The settings' event loop."""
        return self.settings.event_loop

    async def __aenter__(self) -> ControlPlaneApp:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> ControlPlaneApp:
        """Open the audit, listen, serve metrics; StartError names what could not start."""
        try:
            await self._open_store()
            self._stack.push_async_callback(self.sessions.aclose)
            self._stack.push_async_callback(self.left_open.aclose)
            await self._listen()
            if self.settings.metrics.port is not None:
                self._serve_metrics(self.settings.metrics.host, self.settings.metrics.port)
        except BaseException:
            await self._stack.aclose()
            raise
        port = self.listener.port if self.listener else None
        _log.info("control-plane started", port=port, metrics_port=self.metrics_port)
        return self

    async def stop(self) -> None:
        """Close the listener (every connection gracefully), then the audit."""
        await self._stack.aclose()
        _log.info("control-plane stopped")

    def handler_for(self, peer: PeerIdentity) -> Handler:
        """What a peer may do, by its certificate's role (everything without TLS); a peer without a
        certificate may only join."""
        tls, joining = self.settings.tls.enabled, self.joining
        if peer.certless:  # never the edge's and worker's table below: nobody vouched for it
            return joining.certless_handler()
        capabilities = {"capability_request": self._capabilities}
        node: dict[str, MessageHandler] = {
            "node_register": self.sessions.on_register,
            "node_status": self.sessions.on_status,
            "capability_response": self.sessions.on_capabilities,
            **joining.node_handlers(),
        }
        admin = self.operations.handlers() | joining.admin_handlers()
        off = joining.off_handlers()
        if not tls:
            return Handler(run=self.runs.run, messages={**capabilities, **node, **admin, **off})
        if peer.role is Role.NODE:
            return Handler(run=_refuse_run, messages={**node, **_denied(_ADMIN_MESSAGES, peer), **off})
        if peer.role is Role.ADMIN:
            allowed = admin
        else:  # an edge or a worker: it may read, and the edge decides which API key sees what
            allowed = _denied(_ADMIN_MESSAGES, peer) | {kind: admin[kind] for kind in READ_ONLY}
        messages = {**capabilities, **allowed, **_denied(_NODE_MESSAGES, peer), **off}
        return Handler(run=self.runs.run, messages=messages)

    async def _capabilities(self, inbound: Inbound) -> None:
        await inbound.reply(pb.Envelope(capability_response=self.sessions.ready_capabilities()))

    async def _open_store(self) -> None:
        store, key = self.sessions.store, "store.url" if self.settings.store.url else "store_path"
        try:
            await store.open()
        except Exception as exc:  # noqa: BLE001 - any driver's error, as one line naming the key
            raise StartError([Problem(key, f"cannot open {store.state.name}: {exc or type(exc).__name__}")]) from None
        self._stack.push_async_callback(store.aclose)
        try:
            await self._take_state()
        except Exception as exc:  # noqa: BLE001 - any driver's error, as one line naming the key
            raise StartError([Problem(key, f"cannot read {store.state.name}: {exc or type(exc).__name__}")]) from None
        task = asyncio.create_task(self.replicas.run(), name="iop-replicas")
        self._stack.push_async_callback(_cancel, task)

    async def _take_state(self) -> None:
        """Revoked serials, drains and the policy from the store; the policy given at start is recorded
        when the store holds none."""
        state, operations = self.sessions.store.state, self.operations
        await self.joining.store.open()
        self.sessions.drained = set(await state.drains())
        newest = await state.newest_policy()
        if newest is not None:
            operations.follow(newest)
        elif operations.policy.text:
            await operations.record(operations.policy.text, operations.policy.source, "start")
        await self.replicas.start()

    async def _listen(self) -> None:
        settings = self.settings
        connection = settings.connection.config(
            heartbeat_interval=settings.heartbeat_interval, max_frame_size=settings.max_frame_size
        )
        config = settings.listen.config(settings.tls, connection, _ROLES)
        if self.joining.authority is not None:
            join = settings.join
            config = replace(
                config,
                certless=True,
                certless_timeout=join.anonymous_timeout,
                max_certless=join.max_anonymous,
                max_certless_per_address=join.max_anonymous_per_address,
            )
        screen = self.joining.screen if settings.tls.enabled else None
        try:
            listener = await Listener(config, self.handler_for, screen=screen).start()
        except ssl.SSLError as exc:
            raise StartError([Problem("tls", f"OpenSSL cannot use these files: {exc.reason or exc}")]) from None
        except OSError as exc:
            raise bind_error("listen", ", ".join(config.hosts), config.port, exc) from None
        self.listener = listener
        self.joining.connections = lambda: listener.connections
        self._stack.push_async_callback(listener.close, "control-plane shutting down")

    def _serve_metrics(self, host: str, port: int) -> None:
        try:
            server, _ = start_http_server(port, host, self.metrics.registry)
        except OSError as exc:
            raise bind_error("metrics", host, port, exc) from None
        self._stack.callback(server.server_close)
        self._stack.callback(server.shutdown)
        self.metrics_port = server.server_port


async def _refuse_run(request: pb.RunRequest, sink: EventSink) -> None:
    _log.warning("run refused", reason="a node may not submit runs", peer=sink.peer.name, run_id=request.run_id)
    await sink.error(IopError(pb.ERROR_CODE_PERMISSION_DENIED, f"role {sink.peer.role} may not submit runs"))


def _denied(kinds: tuple[str, ...], peer: PeerIdentity) -> dict[str, MessageHandler]:
    async def deny(inbound: Inbound) -> None:
        kind = inbound.envelope.WhichOneof("body")
        _log.warning("request refused", kind=kind, peer=peer.name, role=peer.role)
        raise IopError(pb.ERROR_CODE_PERMISSION_DENIED, f"role {peer.role} may not send {kind}")

    return dict.fromkeys(kinds, deny)


def build_control_plane(settings: Settings, *, policy: PolicyInForce | None = None) -> ControlPlaneApp:
    """Wire a control-plane from ``settings`` (the policy file is read here unless given; at start the
    store's newest policy, when it holds one, is put in force instead)."""
    policy = policy or read_policy(settings.policy_path)
    registry = Registry()
    prefixes = PrefixIndex(per_node=settings.prefix.entries_per_node, limit=settings.prefix.max_entries)
    scheduler = Scheduler(registry, load_policy(policy.text), prefixes=prefixes)
    metrics = ControlPlaneMetrics(registry)
    state = _state_store(settings)
    store = AuditStore(state, max_runs=settings.ledger_max_runs, dropped=metrics.ledger_dropped)
    metrics.watch_store(store)
    metrics.watch_prefixes(prefixes)
    sessions = NodeSessions(registry, store, heartbeat_interval=settings.heartbeat_interval)
    left_open = LeftOpenRuns(state, sessions, metrics.left_open_settled)
    store.on_left_open = left_open.add  # runs recovered interrupted: settled from their node's record
    expose(metrics.registry)  # the wire's limits and connections, served with the control-plane's
    runs = RunRelay(
        scheduler,
        sessions,
        metrics,
        attempts=settings.attempts,
        queue_size=settings.queue_size,
        queue_timeout=settings.queue_timeout,
        background_yield=settings.background_yield,
        registration_grace=settings.registration_grace,
        fairness=settings.fairness,
    )
    registry.on_more_room(runs.wake)  # a node registered, reported or was made ready: admit waiters
    identity = IdentityStore(state)
    joining = Joining(
        settings.join,
        settings.identity,
        store=identity,
        sessions=sessions,
        metrics=metrics,
        authority=_authority(settings),
    )
    if settings.tls.enabled:
        sessions.vet = joining.vet_registration
    operations = Operations(
        scheduler,
        sessions,
        policy,
        identity,
        traffic=runs.traffic,
        queued=runs.queue.depths,
        name=_own_name(settings),
    )
    replicas = Replicas(
        state, operations=operations, sessions=sessions, identity=identity, interval=settings.store.poll_interval
    )
    return ControlPlaneApp(
        settings=settings,
        registry=registry,
        scheduler=scheduler,
        sessions=sessions,
        runs=runs,
        operations=operations,
        joining=joining,
        metrics=metrics,
        replicas=replicas,
        left_open=left_open,
    )


def _state_store(settings: Settings) -> StateStore:
    """PostgreSQL at ``store.url``, else the SQLite file ``store_path``."""
    if settings.store.url is None:
        return SqliteStore(settings.store_path)
    return PgStore(settings.store.url, max_connections=settings.store.max_connections, timeout=settings.store.timeout)


def _own_name(settings: Settings) -> str:
    """This control-plane's certificate name (``control-plane`` without TLS, or a certificate unreadable here)."""
    if not settings.tls.enabled or settings.tls.cert is None:
        return "control-plane"
    try:
        return certificate_facts(settings.tls.cert.read_bytes()).name or "control-plane"
    except (OSError, ValueError):  # the listener reports what is wrong with the file
        return "control-plane"


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _authority(settings: Settings) -> Authority | None:
    """The CA that signs joining nodes' certificates, when ``join.ca_key`` is set (checked by the settings)."""
    if settings.join.ca_key is None or settings.tls.ca is None:
        return None
    try:
        return Authority.load(settings.tls.ca, settings.join.ca_key)
    except (OSError, ValueError, TypeError) as exc:  # changed since the settings were read
        raise ConfigError([Problem("join.ca_key", f"cannot use {settings.join.ca_key}: {exc}")]) from None
