"""The node's transports: the handler table it serves with, and registration with its control-planes.

Runs arriving either way go to the same ``Node``, so direct and relayed runs are served alike.
Only a connection this node dialed to a control-plane takes ``node.drain`` and ``nodes.reload``
(the routes read again; after a reload that changed them, each registration sends the node's
capabilities unasked, and its status at once). With several
control-planes (``control_plane.addresses``) the node keeps one :class:`Registration` per
control-plane, each on its own connection with its own redial backoff, and reports its load to
each; the node's own admission decides what runs, whichever control-plane sent them.

``node.status`` goes out when the load changed (at once past ``status_step``, else at the next
heartbeat interval) and every ``status_refresh`` seconds regardless; the wire's heartbeats prove
the node alive in between, so an idle fleet costs its control-plane one frame per node a second.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog
from google.protobuf.descriptor import EnumDescriptor

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.core import Node
from iop_node.domain import RunRecord
from iop_node.settings import ConfigError, ControlPlaneSettings
from iop_wire import ConnectionConfig, Handler, Inbound, IopError, KeepConnected, TlsConfig
from iop_wire.connection import Connection
from iop_wire.errors import ConnectionClosed

__all__ = ["Registration", "Reload", "ledger_run", "node_handler"]

_log = structlog.get_logger("iop.node")
Reload = Callable[[], Awaitable[object]]
"""Reads the routes again; its result, as text, says what changed (``NodeApp.reload``)."""


def node_handler(node: Node, *, control_plane: bool = False, reload: Reload | None = None) -> Handler:
    """What the node serves: runs, capabilities, and node.drain and nodes.reload on its control-plane connection."""

    async def capabilities(inbound: Inbound) -> None:
        await inbound.reply(pb.Envelope(capability_response=await node.capabilities()))

    async def drain(inbound: Inbound) -> None:
        message = inbound.envelope.node_drain
        if not control_plane:
            raise IopError(pb.ERROR_CODE_PERMISSION_DENIED, "node.drain is taken only from this node's control-plane")
        if message.node_id and message.node_id != node.node_id:
            raise IopError(
                pb.ERROR_CODE_INVALID_ARGUMENT, f"node.drain for {message.node_id!r} reached {node.node_id!r}"
            )
        _log.info("drain requested", node_id=node.node_id, reason=message.reason)
        node.drain(message.grace.ToTimedelta().total_seconds() if message.HasField("grace") else None)

    async def run_record(inbound: Inbound) -> None:
        # A control-plane restarted after a kill asks how a run it had placed here ended.
        run_id = inbound.envelope.runs_list.run_id
        if not control_plane:
            raise IopError(pb.ERROR_CODE_PERMISSION_DENIED, "runs.list is taken only from this node's control-plane")
        if not run_id:
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, "runs.list to a node needs the run_id of one run")
        record = await node.recorded(run_id)
        listed = pb.RunsListed(runs=[] if record is None else [ledger_run(record)])
        await inbound.reply(pb.Envelope(runs_listed=listed))

    async def reload_routes(inbound: Inbound) -> None:
        message = inbound.envelope.nodes_reload
        if not control_plane or reload is None:
            raise IopError(pb.ERROR_CODE_PERMISSION_DENIED, "nodes.reload is taken only from this node's control-plane")
        if message.node_id and message.node_id != node.node_id:
            raise IopError(
                pb.ERROR_CODE_INVALID_ARGUMENT, f"nodes.reload for {message.node_id!r} reached {node.node_id!r}"
            )
        _log.info("reload requested", node_id=node.node_id, by=inbound.peer.name)
        try:
            said = str(await reload())
        except ConfigError as exc:
            message_text = f"node {node.node_id} kept its routes: {exc}"
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, message_text) from None
        await inbound.reply(pb.Envelope(operation_done=pb.OperationDone(message=said)))

    messages = {
        "capability_request": capabilities,
        "node_drain": drain,
        "runs_list": run_record,
        "nodes_reload": reload_routes,
    }
    return Handler(run=node.run, messages=messages)


def ledger_run(record: RunRecord) -> pb.LedgerRun:
    """The node's record of a run as ``runs.listed`` carries it: its outcome, usage and timings."""
    usage = pb.Usage(
        prompt_tokens=record.prompt_tokens, completion_tokens=record.completion_tokens, estimated=record.usage_estimated
    )
    run = pb.LedgerRun(
        run_id=record.run_id,
        requester=record.peer,
        connection=record.connection,
        caller=record.caller,
        model=record.model,
        node_id=record.node_id,
        status=record.status.value,
        error_code=pb.ErrorCode.ValueType(_named(pb.ErrorCode.DESCRIPTOR, "ERROR_CODE_", record.error_code)),
        error_message=record.error_message,
        usage=usage,
        finish_reason=pb.FinishReason.ValueType(
            _named(pb.FinishReason.DESCRIPTOR, "FINISH_REASON_", record.finish_reason)
        ),
    )
    if record.received_at is not None:
        run.received_at.FromDatetime(record.received_at)
        if record.first_token_at is not None:
            run.ttft.FromTimedelta(record.first_token_at - record.received_at)
        if record.finished_at is not None:
            run.duration.FromTimedelta(record.finished_at - record.received_at)
    return run


def _named(enum: EnumDescriptor, prefix: str, name: str) -> int:
    """The value a record names by its short name (``UNAVAILABLE``, ``stop``); 0 (unspecified) for none."""
    value = enum.values_by_name.get(prefix + name.upper())
    return value.number if value is not None else 0


class Registration:
    """Keeps the node registered with one control-plane: dial, register, report, reconnect."""

    def __init__(
        self,
        node: Node,
        settings: ControlPlaneSettings,
        tls: TlsConfig,
        config: ConnectionConfig,
        *,
        address: str | None = None,
        registered: asyncio.Event | None = None,
        reload: Reload | None = None,
    ) -> None:
        """``address``: which of ``settings.all_addresses`` (default: the first); ``registered``: an
        event the registrations with the other control-planes share (set by whichever comes first);
        ``reload``: what ``nodes.reload`` from the control-plane calls (refused without)."""
        self.link = KeepConnected(
            settings.target(tls, config, address=address),
            self._register,
            handler=node_handler(node, control_plane=True, reload=reload),
            backoff=settings.backoff(),
        )
        self._node, self._settings, self._config = node, settings, config
        self._changed = asyncio.Event()
        self._reported = -1
        self._announced = -1
        """The node's route generation whose capabilities the control-plane has."""
        self.registrations = 0
        self.registered = registered or asyncio.Event()
        """Set once the node first registered (with any control-plane, when shared)."""
        node.on_load_change(self._on_load_change)

    @property
    def connection(self) -> Connection | None:
        """The control-plane connection, while there is one."""
        return self.link.connection

    async def run_forever(self) -> None:
        """Stay registered, reporting load on every connection, until cancelled or stopped."""
        self.link.start()
        while True:
            connection = await self.link.connected()
            await self._report_until_closed(connection)

    async def stop(self) -> None:
        """Stop reconnecting and close the control-plane connection gracefully."""
        await self.link.stop()

    def routes_changed(self) -> None:
        """The routes were reloaded: send the node's capabilities (unasked) and its status at once, once
        registered (a registration under way may carry the old ones: they are sent after it)."""
        self._changed.set()

    async def _register(self, connection: Connection) -> None:
        generation = self._node.generation  # the route table these capabilities describe
        register = pb.NodeRegister(
            node_id=self._node.node_id, capabilities=await self._node.capabilities(), status=self._node.status()
        )
        reply = await connection.request(pb.Envelope(node_register=register))
        if reply.WhichOneof("body") != "node_registered":
            raise IopError(
                pb.ERROR_CODE_PROTOCOL_VIOLATION, "the control-plane answered node.register with something else"
            )
        self.registrations += 1
        self._announced = generation
        self.registered.set()
        _log.info("registered", node_id=self._node.node_id, address=self.link.target.address)

    async def _report_until_closed(self, connection: Connection) -> None:
        closed = asyncio.ensure_future(connection.wait_closed())
        loop = asyncio.get_running_loop()
        sent, sent_at = None, 0.0
        try:
            while not closed.done():
                if self._announced != self._node.generation:
                    await self._announce(connection)
                self._reported = self._node.busy
                status = self._node.status()
                if status != sent or loop.time() - sent_at >= self._settings.status_refresh:
                    if not connection.closed:
                        await connection.send(pb.Envelope(node_status=status))
                    sent, sent_at = status, loop.time()
                changed = asyncio.ensure_future(self._changed.wait())
                refresh = sent_at + self._settings.status_refresh - loop.time()
                look = min(self._config.heartbeat_interval, refresh)
                await asyncio.wait({closed, changed}, timeout=look, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                self._changed.clear()
        finally:
            closed.cancel()

    async def _announce(self, connection: Connection) -> None:
        """The node's capabilities, unasked: its routes changed since the control-plane last heard them."""
        generation = self._node.generation
        capabilities = await self._node.capabilities()
        if not connection.closed:
            with contextlib.suppress(ConnectionClosed):  # closed meanwhile: the next registration carries them
                await connection.send(pb.Envelope(capability_response=capabilities))
        self._announced = generation

    def _on_load_change(self) -> None:
        if abs(self._node.busy - self._reported) >= self._settings.status_step or self._node.draining:
            self._changed.set()
