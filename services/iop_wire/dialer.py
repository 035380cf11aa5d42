"""Keep a connection to one peer open: dial, run a session on it, redial with backoff and jitter.

What a node does for its control-plane, and an edge or a worker will do for theirs::

    async def session(connection: Connection) -> None:
        await connection.request(pb.Envelope(node_register=...))   # on-connect work
        await connection.wait_closed()                                 # then serve until it closes

    async with KeepConnected(Target("cp.internal", 7400, tls=tls), session, handler=handler) as link:
        connection = await link.connected()
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from types import TracebackType

from iop_wire.connection import Connection, ConnectionConfig, Handler
from iop_wire.endpoint import dial
from iop_wire.errors import IopError
from iop_wire.logs import library_logger
from iop_wire.tls import Role, TlsConfig

__all__ = ["Backoff", "KeepConnected", "Session", "Target"]

_log = library_logger("iop.wire")  # silent below WARNING until the application configures logging

Session = Callable[[Connection], Awaitable[None]]
"""Runs on each new connection; when it returns, the dialer waits for the connection to close."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where to dial and how."""

    host: str
    port: int
    tls: TlsConfig = field(default_factory=TlsConfig)
    codec: str = "proto"
    server_hostname: str | None = None
    """Name to verify in the peer's certificate; defaults to ``host``."""
    expect_roles: Collection[Role] | None = None
    """Roles the peer's certificate must have; None accepts any."""
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    timeout: float = 10.0
    """Seconds for TCP, TLS and the preface."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays between attempts: ``initial`` doubling per failure up to ``maximum``, times 0.5-1 (jitter)."""

    initial: float = 0.5
    maximum: float = 30.0

    def delay(self, failures: int) -> float:
        base: float = min(self.maximum, self.initial * 2.0 ** min(failures, 30))
        return base * random.uniform(0.5, 1.0)  # noqa: S311 - jitter spreads redials, it is no secret


class KeepConnected:
    """One connection to ``target``, re-established whenever it closes, until :meth:`stop`."""

    def __init__(
        self,
        target: Target,
        session: Session | None = None,
        *,
        handler: Handler | None = None,
        backoff: Backoff = Backoff(),
    ) -> None:
        self.target, self.backoff = target, backoff
        self.connection: Connection | None = None
        """The open connection, while there is one."""
        self.connects = 0
        """Connections made so far whose session started."""
        self._session, self._handler = session, handler
        self._stopping = False
        self._up = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> KeepConnected:
        self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.stop()

    def start(self) -> asyncio.Task[None]:
        """Run :meth:`run_forever` in a task."""
        if self._task is None:
            self._task = asyncio.create_task(self.run_forever(), name=f"iop-keep-connected-{self.target.address}")
        return self._task

    async def connected(self, timeout: float | None = None) -> Connection:
        """The open connection, waiting up to ``timeout`` seconds for one."""
        async with asyncio.timeout(timeout):
            while True:
                await self._up.wait()
                if self.connection is not None and not self.connection.closed:
                    return self.connection
                self._up.clear()

    async def run_forever(self) -> None:
        """Dial, run the session, wait for the close; back off after failures; until stopped."""
        failures = 0
        while not self._stopping:
            try:
                await self._once()
                failures = 0
            except (OSError, TimeoutError, IopError) as exc:
                failures += 1
                _log.warning("peer unreachable", address=self.target.address, reason=str(exc) or type(exc).__name__)
            except Exception:  # noqa: BLE001 - a bug in one session must not end the link for good
                failures += 1
                _log.exception("session failed", address=self.target.address)
            await asyncio.sleep(self.backoff.delay(failures))  # stop() cancels this wait

    async def stop(self) -> None:
        """Stop redialing and close the connection gracefully."""
        self._stopping = True
        connection = self.connection
        if connection is not None and not connection.closed:
            await connection.close("shutting down")
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _once(self) -> None:
        target = self.target
        connection = await dial(
            target.host,
            target.port,
            tls=target.tls,
            codec=target.codec,
            handler=self._handler,
            config=target.connection,
            server_hostname=target.server_hostname or target.host,
            expect_roles=target.expect_roles,
            timeout=target.timeout,
        )
        self.connection = connection
        try:
            if self._session is not None:
                await self._session(connection)
            self.connects += 1
            self._up.set()
            await connection.wait_closed()
        finally:
            self.connection = None
            self._up.clear()
            if not connection.closed:
                await connection.close("session ended")
