"""A run opened on one of several peers (control-planes, active-active), opened again on another
while it has no output, continued on another after output.

:func:`open_run_anywhere` opens the run on a connection that is up (``Links.pick``, in turn) and
returns a :class:`FailoverStream`. Until the run's first output, an attempt that ends because its
connection closed (the control-plane died or went away), or with a retryable UNAVAILABLE or
SHUTTING_DOWN (a control-plane stopping, or one just restarted and still without nodes), is
opened again with the same request on a peer not tried yet. The reader sees one stream: an
abandoned attempt had no output, and a second ``start`` is dropped.

After output, a lost connection continues the run: the stream keeps what it passed to its
reader (``iop_wire.continuation.Delivered``) and opens the run on a peer not tried yet with
``continuation`` set to it, so that peer's node generates only what follows. The reader still
sees one stream: the continued attempt's ``start`` is dropped, its events are numbered on from
the last one read, and its ``complete`` carries the whole run's usage (the protocol's contract
for a continuation). A run is continued at most ``migrations`` times, only before its deadline,
and only when its output can be handed on (not tool calls or embeddings); otherwise, or with no
peer left, it ends with NODE_LOST (retryable: send the whole run again), the code the
control-plane itself uses when a node is lost after output, its message saying why it was not
continued.

    stream = await open_run_anywhere(links, request)
    async with stream:
        async for event in stream: ...
"""

from __future__ import annotations

import time
from collections.abc import Collection

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection
from iop_wire.continuation import STOPPED_CODES, Delivered
from iop_wire.dialer import Links
from iop_wire.errors import ConnectionClosed, IopError
from iop_wire.logs import library_logger
from iop_wire.messages import error_message
from iop_wire.metrics import FAILOVERS
from iop_wire.runs import TERMINAL_EVENTS, RunStream

__all__ = ["DEFAULT_MIGRATIONS", "FailoverStream", "open_run_anywhere"]

_log = library_logger("iop.wire")

DEFAULT_MIGRATIONS = 2
"""Times a run is continued on another peer after output; the control-plane's policy ``migrations`` default."""

_Event = tuple[pb.RunEvent, bytes]


async def open_run_anywhere(
    links: Links, request: pb.RunRequest, *, urgent: bool = False, migrations: int = DEFAULT_MIGRATIONS
) -> FailoverStream:
    """Open ``request`` on a peer that is up, trying the next one while connections turn out closed.

    ``migrations``: times the run may be continued on another peer once it has output (0: never).
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
        address = link.target.address
        return FailoverStream(links, request, stream, connection, address, tried=tried, migrations=migrations)


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
        migrations: int = DEFAULT_MIGRATIONS,
    ) -> None:
        super().__init__(stream.run_id, self._cancel_attempt, codec=stream.codec)
        self._links, self._request, self._migrations = links, request, migrations
        self._attempt, self._connection, self.address = stream, connection, address
        """The peer the current attempt runs on (``host:port`` as configured)."""
        self._tried = {*tried, address}
        self._held: _Event | None = None
        self._started = False
        self._delivered = Delivered(request) if migrations else None  # nothing kept for a run never continued
        self._cut = False  # the current attempt ended by its control-plane's loss or stop, not a refusal
        self._attempt_outputs = 0
        self._sequence = 0  # the number of the next event passed to the reader
        self._renumber = False  # an attempt after the first numbers from 0 again
        self._lost_from = ""  # the peer whose connection was lost after output, last
        self.outputs = 0
        """Deltas read so far."""
        self.reopened = 0
        """Times the run was opened again on another peer before output."""
        self.migrated = 0
        """Times the run was continued on another peer after output."""

    @property
    def connection(self) -> Connection:
        """The connection the current attempt runs on."""
        return self._connection

    @property
    def buffered(self) -> int:
        return self._attempt.buffered + (self._held is not None)

    async def next_frame(self) -> _Event:
        """The next event (numbered in this stream; ``body`` as its attempt received it, a relay numbers anew)."""
        while True:
            if self.finished:
                raise StopAsyncIteration
            item, self._held = self._held or await self._attempt.next_frame(), None
            if (passed := self._pass(item)) is not None:
                return passed
            if item[0].WhichOneof("event") == "error" and (ended := await self._next_attempt(item)) is not None:
                return self._deliver(ended)

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
        if kind == "delta":
            self.outputs += 1
            self._attempt_outputs += 1
            if self._delivered is not None:
                self._delivered.add(event.delta)
            return self._numbered(item)
        if kind == "start":
            if self._started:
                return None  # an earlier attempt's start was read already
            self._started = True
            return self._numbered(item)
        if kind == "error" and not self.cancelled:
            lost = not body and self._connection.closed
            # UNAVAILABLE or SHUTTING_DOWN: the control-plane is stopping (or refuses before output)
            stopping = event.error.retryable and event.error.code in STOPPED_CODES
            self._cut = lost or (stopping and self._attempt_outputs > 0)
            if lost or stopping:
                return None
            if self.migrated and not self._attempt_outputs:  # the continued attempt failed before its own output
                return self._deliver(self._not_continued(f"the control-plane at {self.address} {_answered(event)}"))
        return self._deliver(item)

    def _numbered(self, item: _Event) -> _Event:
        if self._renumber:
            item[0].sequence = self._sequence
        self._sequence += 1
        return item

    def _deliver(self, item: _Event) -> _Event:
        event, body = item
        if event.WhichOneof("event") in TERMINAL_EVENTS:
            self.finished = self.ended = True
        if not body:  # made on this side (a lost connection, a refusal): numbered on from the last event read
            event.sequence = self._sequence
        return self._numbered(item)

    async def _next_attempt(self, failed: _Event) -> _Event | None:
        """Open the run on another peer, continued from its output if it has some; None once it is
        open, else the event that ends the stream."""
        if not self.outputs:
            if await self._open_elsewhere(self._request):
                self.reopened += 1
                FAILOVERS.labels("reopened").inc()
                _log.info("run opened again", run_id=self.run_id, address=self.address, tried=sorted(self._tried))
                return None
            if not self.cancelled:
                FAILOVERS.labels("none_left").inc()
            return failed
        lost_at = time.monotonic()
        if self._cut:  # lost or stopped, not refused by a continued attempt's control-plane
            self._lost_from = self.address
        elif self.migrated and self._delivered is not None:  # the refused continuation was not read
            self._delivered.refused()
        continuation, why = self._continuation()
        if continuation is not None:
            request = pb.RunRequest()
            request.CopyFrom(self._request)
            request.continuation.CopyFrom(continuation)
            if await self._open_elsewhere(request):
                assert self._delivered is not None  # a continuation was made from it
                self._delivered.sent(continuation)
                self.migrated += 1
                FAILOVERS.labels("continued").inc()
                _log.info(
                    "run continued",
                    run_id=self.run_id,
                    lost=self._lost_from,
                    address=self.address,
                    outputs=self.outputs,
                    migration=self.migrated,
                    reopen_seconds=round(time.monotonic() - lost_at, 4),
                )
                return None
            why = "no other control-plane could take it"
            if not self._cut:  # the attempt was refused, not lost: say by what
                why += f" (the last one {_answered(failed[0])})"
        return failed if self.cancelled else self._not_continued(why)

    def _not_continued(self, why: str) -> _Event:
        """The NODE_LOST that ends a run lost after output and not continued (counted and logged)."""
        FAILOVERS.labels("lost_after_output").inc()
        lost_from = self._lost_from
        _log.warning("run not continued", run_id=self.run_id, address=lost_from, outputs=self.outputs, why=why)
        message = (
            f"the connection to the control-plane at {lost_from} was lost after {self.outputs} output(s)"
            f" and the run was not continued: {why}; send the run again"
        )
        error = IopError(pb.ERROR_CODE_NODE_LOST, message, retryable=True)
        error.run_id = self.run_id
        return pb.RunEvent(error=error_message(error)), b""

    def _continuation(self) -> tuple[pb.Continuation | None, str]:
        """The next attempt's continuation, or None and why the run is not continued."""
        delivered = self._delivered
        if delivered is None:
            return None, "its limit is 0 (migrations: 0)"
        if delivered.why_not:
            return None, delivered.why_not
        if self.migrated >= self._migrations:
            return None, f"it was continued {self.migrated} time(s), its limit (migrations: {self._migrations})"
        request = self._request
        if request.HasField("deadline") and request.deadline.ToNanoseconds() <= time.time_ns():
            return None, "its deadline passed"
        return delivered.continuation(), delivered.why_not

    async def _open_elsewhere(self, request: pb.RunRequest) -> bool:
        """Open ``request`` on a peer not tried yet; False when there is none (or the run was cancelled)."""
        while not self.cancelled:
            try:
                link = self._links.pick(exclude=self._tried)
            except IopError:
                return False
            self._tried.add(link.target.address)
            connection = link.connection
            if connection is None:
                continue
            try:
                stream = await connection.open_run(request)
            except ConnectionClosed:
                continue
            except IopError:
                return False
            self._follow(stream, connection, link.target.address)
            return True
        return False

    def _follow(self, stream: RunStream, connection: Connection, address: str) -> None:
        """Read the run's events from ``stream`` (a new attempt) from now on."""
        self._attempt, self._connection, self.address = stream, connection, address
        self._attempt_outputs = 0
        self._renumber = True
        if self.cancelled:  # while it was being opened: its end is all the reader waits for
            stream.cancel_nowait("cancelled by the requester")

    def _cancel_attempt(self, run_id: str, reason: str) -> None:
        self._attempt.cancel_nowait(reason)


def _answered(event: pb.RunEvent) -> str:
    """What a peer's error event said, for a message: ``answered INVALID_ARGUMENT: ...``."""
    return f"answered {pb.ErrorCode.Name(event.error.code).removeprefix('ERROR_CODE_')}: {event.error.message}"
