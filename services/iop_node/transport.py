"""The node's transports: a listener for direct clients, and registration with a control-plane.

Runs arriving either way go to the same ``Node`` (the wire Handler), so they are served alike.
"""

from __future__ import annotations

import asyncio
import random

import structlog

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.core import Node
from iop_node.settings import ControlPlaneSettings
from iop_wire.connection import Connection, ConnectionConfig
from iop_wire.endpoint import dial
from iop_wire.errors import IopError
from iop_wire.messages import from_typed
from iop_wire.tls import Role, TlsConfig

__all__ = ["Registration"]

_log = structlog.get_logger("iop.node")


class Registration:
    """Keeps the node registered with its control-plane: dial, register, report, reconnect."""

    def __init__(self, node: Node, settings: ControlPlaneSettings, tls: TlsConfig, config: ConnectionConfig) -> None:
        assert settings.address is not None
        host, _, port = settings.address.rpartition(":")
        self._host, self._port = host or "127.0.0.1", int(port)
        self._node, self._settings, self._tls, self._config = node, settings, tls, config
        self._changed = asyncio.Event()
        self._reported = -1
        self.connection: Connection | None = None
        self.registrations = 0
        self._stopping = False
        node.on_load_change(self._on_load_change)

    async def run_forever(self) -> None:
        """Stay registered until cancelled; backs off (with jitter) between failed attempts."""
        failures = 0
        while True:
            try:
                await self._session()
                failures = 0
            except (OSError, TimeoutError, IopError) as exc:
                failures += 1
                _log.warning("control-plane unreachable", address=f"{self._host}:{self._port}", reason=str(exc))
            except Exception:  # noqa: BLE001 - a bug in one session must not end registration for good
                failures += 1
                _log.exception("registration session failed", address=f"{self._host}:{self._port}")
            if self._stopping:  # stop() closed the session: do not reconnect
                return
            delay = min(self._settings.reconnect_max, self._settings.reconnect_initial * 2 ** min(failures, 16))
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))  # noqa: S311 - jitter, not a secret

    async def stop(self) -> None:
        """Stop reconnecting and close the control-plane connection gracefully.

        Closing the connection ends the session by itself, without relying on cancellation
        reaching the session wherever it is waiting.
        """
        self._stopping = True
        connection = self.connection
        if connection is not None and not connection.closed:
            await connection.close("node stopping")

    async def _session(self) -> None:
        connection = await dial(
            self._host,
            self._port,
            tls=self._tls,
            handler=self._node,
            config=self._config,
            server_hostname=self._settings.server_name or self._host,
            expect_roles={Role.CONTROL_PLANE} if self._tls.enabled else None,
        )
        self.connection = connection
        self._node.control_planes.add(connection)
        try:
            register = pb.NodeRegister(
                node_id=self._node.node_id,
                capabilities=from_typed(await self._node.capabilities(), pb.CapabilityResponse),
                status=from_typed(self._node.status(), pb.NodeStatus),
            )
            reply = await connection.request(pb.Envelope(node_register=register))
            if reply.WhichOneof("body") != "node_registered":
                await connection.close("unexpected answer to node.register")
                return
            self.registrations += 1
            _log.info("registered", node_id=self._node.node_id, address=f"{self._host}:{self._port}")
            await self._report_until_closed(connection)
        finally:
            self._node.control_planes.discard(connection)
            self.connection = None
            if not connection.closed:
                await connection.close("node stopping")

    async def _report_until_closed(self, connection: Connection) -> None:
        closed = asyncio.ensure_future(connection.wait_closed())
        try:
            while not closed.done():
                await self._send_status(connection)
                changed = asyncio.ensure_future(self._changed.wait())
                await asyncio.wait(
                    {closed, changed}, timeout=self._config.heartbeat_interval, return_when=asyncio.FIRST_COMPLETED
                )
                changed.cancel()
                self._changed.clear()
        finally:
            closed.cancel()

    async def _send_status(self, connection: Connection) -> None:
        status = self._node.status()
        self._reported = status.in_flight + status.queued
        if not connection.closed:
            await connection.send(pb.Envelope(node_status=from_typed(status, pb.NodeStatus)))

    def _on_load_change(self) -> None:
        if abs(self._node.busy - self._reported) >= self._settings.status_step or self._node.draining:
            self._changed.set()
