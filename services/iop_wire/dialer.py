"""Keep a connection to one peer open: dial, run a session on it, redial with backoff and jitter.

What a node does for its control-plane, and an edge or a worker will do for theirs::

    async def session(connection: Connection) -> None:
        await connection.request(pb.Envelope(node_register=...))   # on-connect work
        await connection.wait_closed()                                 # then serve until it closes

    async with KeepConnected(Target("cp.internal", 7400, tls=tls), session, handler=handler) as link:
        connection = await link.connected()

Several peers of one kind (control-planes run active-active) are one :class:`Links`: a
:class:`KeepConnected` per connection, each redialing on its own, and a connection that is up
picked in turn::

    links = Links([KeepConnected(target) for target in targets])
    links.start()
    connection = links.pick()                  # or IopError UNAVAILABLE when none is up
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection, ConnectionConfig, Handler
from iop_wire.endpoint import dial
from iop_wire.errors import IopError
from iop_wire.logs import library_logger
from iop_wire.tls import Role, TlsConfig

__all__ = ["Backoff", "KeepConnected", "Links", "Session", "Target"]

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


class Links:
    """Connections to several peers (or several to one), each kept by its own :class:`KeepConnected`.

    :meth:`pick` takes a connection that is up, in turn, skipping the peers in ``exclude``: runs
    are spread over every peer that is up, and one that is down costs nothing but being skipped.
    """

    def __init__(self, links: Sequence[KeepConnected]) -> None:
        self.links = list(links)
        self._turn = itertools.count()

    @property
    def addresses(self) -> list[str]:
        """Every peer's ``host:port``, once each, in order."""
        return list(dict.fromkeys(link.target.address for link in self.links))

    def start(self) -> None:
        """Start dialing every connection."""
        for link in self.links:
            link.start()

    async def stop(self) -> None:
        """Stop every connection (runs still open on them end with an error)."""
        await asyncio.gather(*(link.stop() for link in self.links))

    def up(self) -> list[KeepConnected]:
        """The links whose connection is open now."""
        return [link for link in self.links if link.connection is not None and not link.connection.closed]

    def pick(self, exclude: Collection[str] = ()) -> KeepConnected:
        """A link that is up, in turn, whose peer is not in ``exclude``; UNAVAILABLE (retryable) if none."""
        links = self.links
        start = next(self._turn)
        for offset in range(len(links)):
            link = links[(start + offset) % len(links)]
            if link.target.address not in exclude and link.connection is not None and not link.connection.closed:
                return link
        peers = ", ".join(address for address in self.addresses if address not in exclude) or "no other peer"
        raise IopError(pb.ERROR_CODE_UNAVAILABLE, f"no connection is up ({peers})", retryable=True)

    async def connected(self, timeout: float | None = None) -> Connection:
        """A connection that is up, waiting up to ``timeout`` seconds for any to be."""
        if not self.links:
            raise IopError(pb.ERROR_CODE_UNAVAILABLE, "no peer is configured")
        async with asyncio.timeout(timeout):
            while True:
                with contextlib.suppress(IopError):
                    connection = self.pick().connection
                    if connection is not None:
                        return connection
                waits = [asyncio.ensure_future(link.connected()) for link in self.links]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for wait in waits:
                        wait.cancel()
