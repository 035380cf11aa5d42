"""A run opened on one of several peers (control-planes, active-active), opened again on another
while it has no output.

:func:`open_run_anywhere` opens the run on a connection that is up (``Links.pick``, in turn) and
returns a :class:`FailoverStream`. Until the run's first output, an attempt that ends because its
connection closed (the control-plane died or went away), or with a retryable UNAVAILABLE or
SHUTTING_DOWN (a control-plane stopping, or one just restarted and still without nodes), is
opened again with the same request on a peer not tried yet. The reader sees one stream: an
abandoned attempt had no output, and a second ``start`` is dropped. Once output has been read a
run cannot move: a lost connection ends it with NODE_LOST (retryable: send the whole run again),
the code the control-plane itself uses when a node is lost after output.

    stream = await open_run_anywhere(links, request)
    async with stream:
        async for event in stream: ...
"""

from __future__ import annotations

from collections.abc import Collection

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection
from iop_wire.dialer import Links
from iop_wire.errors import ConnectionClosed, IopError
from iop_wire.logs import library_logger
from iop_wire.messages import error_message
from iop_wire.metrics import FAILOVERS
from iop_wire.runs import TERMINAL_EVENTS, RunStream

__all__ = ["REOPEN_CODES", "FailoverStream", "open_run_anywhere"]

_log = library_logger("iop.wire")

REOPEN_CODES = frozenset({pb.ERROR_CODE_UNAVAILABLE, pb.ERROR_CODE_SHUTTING_DOWN})
"""Retryable errors before any output that send a run to another peer."""

_Event = tuple[pb.RunEvent, bytes]


async def open_run_anywhere(links: Links, request: pb.RunRequest, *, urgent: bool = False) -> FailoverStream:
    """Open ``request`` on a peer that is up, trying the next one while connections turn out closed.

    Raises IopError UNAVAILABLE (retryable) when no connection is up, or the last ConnectionClosed.
    """
    tried: set[str] = set()
    while True:
        try:
            link = links.pick(exclude=tried)
        except IopError:
            if tried:
                raise ConnectionClosed(f"every control-plane connection closed: {', '.join(sorted(tried))}") from None
            raise
        tried.add(link.target.address)
        connection = link.connection
        if connection is None:
            continue
        try:
            stream = await connection.open_run(request, urgent=urgent)
        except ConnectionClosed:
            continue
        return FailoverStream(links, request, stream, connection, link.target.address, tried=tried)


class FailoverStream(RunStream):
    """One run's events across its attempts on several peers (see the module's docstring)."""

    def __init__(
        self,
        links: Links,
        request: pb.RunRequest,
        stream: RunStream,
        connection: Connection,
        address: str,
        *,
        tried: Collection[str] = (),
    ) -> None:
        super().__init__(stream.run_id, self._cancel_attempt, codec=stream.codec)
        self._links, self._request = links, request
        self._attempt, self._connection, self.address = stream, connection, address
        """The peer the current attempt runs on (``host:port`` as configured)."""
        self._tried = {*tried, address}
        self._held: _Event | None = None
        self._started = False
        self.outputs = 0
        """Deltas read so far."""
        self.reopened = 0
        """Times the run was opened again on another peer."""

    @property
    def connection(self) -> Connection:
        """The connection the current attempt runs on."""
        return self._connection

    @property
    def buffered(self) -> int:
        return self._attempt.buffered + (self._held is not None)

    async def next_frame(self) -> _Event:
        while True:
            if self.finished:
                raise StopAsyncIteration
            item, self._held = self._held or await self._attempt.next_frame(), None
            if (passed := self._pass(item)) is not None:
                return passed
            if item[0].WhichOneof("event") == "error" and not await self._reopen():
                return self._deliver(item)

    def next_nowait(self) -> pb.RunEvent | None:
        if self._held is not None:
            return None
        while (item := self._attempt.next_frame_nowait()) is not None:
            if (passed := self._pass(item)) is not None:
                return passed[0]
            if item[0].WhichOneof("event") == "error":  # to be opened again: next_frame does, it can wait
                self._held = item
                return None
        return None

    def next_frame_nowait(self) -> _Event | None:
        event = self.next_nowait()
        return None if event is None else (event, b"")

    def _pass(self, item: _Event) -> _Event | None:
        """The event as the reader gets it; None when it is dropped or asks for another attempt."""
        event, body = item
        kind = event.WhichOneof("event")
        if kind == "start":
            if self._started:
                return None  # the abandoned attempt's start was read already
            self._started = True
            return item
        if kind == "delta":
            self.outputs += 1
            return item
        if kind == "error" and not self.cancelled:
            lost = not body and self._connection.closed
            if not self.outputs and (lost or (event.error.retryable and event.error.code in REOPEN_CODES)):
                return None
            if lost:
                FAILOVERS.labels("lost_after_output").inc()
                return self._deliver(self._lost_after_output())
        return self._deliver(item)

    def _deliver(self, item: _Event) -> _Event:
        if item[0].WhichOneof("event") in TERMINAL_EVENTS:
            self.finished = self.ended = True
        return item

    def _lost_after_output(self) -> _Event:
        message = (
            f"the connection to the control-plane at {self.address} was lost after {self.outputs} output(s);"
            " send the run again"
        )
        error = IopError(pb.ERROR_CODE_NODE_LOST, message, retryable=True)
        error.run_id = self.run_id
        return pb.RunEvent(error=error_message(error)), b""

    async def _reopen(self) -> bool:
        """Open the run again on a peer not tried yet; False when there is none (or it was cancelled)."""
        while not self.cancelled:
            try:
                link = self._links.pick(exclude=self._tried)
            except IopError:
                FAILOVERS.labels("none_left").inc()
                return False
            self._tried.add(link.target.address)
            connection = link.connection
            if connection is None:
                continue
            try:
                stream = await connection.open_run(self._request)
            except ConnectionClosed:
                continue
            except IopError:
                return False
            _log.info("run opened again", run_id=self.run_id, address=link.target.address, tried=sorted(self._tried))
            self._attempt, self._connection, self.address = stream, connection, link.target.address
            self.reopened += 1
            FAILOVERS.labels("reopened").inc()
            return True
        return False

    def _cancel_attempt(self, run_id: str, reason: str) -> None:
        self._attempt.cancel_nowait(reason)
