"""What a connection serves, and how it is bounded: the handler table and the per-connection limits.

A :class:`Handler` names the function that executes each run.request and one function per
other message type this end takes (``{Envelope body field: function}``); each such function
gets an :class:`Inbound` whose ``reply()`` answers the envelope. :class:`ConnectionConfig`
holds every limit a peer can run into on one connection.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.framing import DEFAULT_MAX_FRAME_SIZE
from iop_wire.runs import EventSink
from iop_wire.tls import PeerIdentity, acting_caller

if TYPE_CHECKING:
    from iop_wire.connection import Connection

__all__ = ["ConnectionConfig", "Handler", "Inbound", "MessageHandler", "RunHandler"]


@dataclass(frozen=True, slots=True)
class ConnectionConfig:
    """Limits and timers of one connection; each limit is counted in ``iop_wire_limit_hits_total``."""

    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    """Largest frame body accepted or sent, in bytes."""
    heartbeat_interval: float = 30.0
    """Seconds between heartbeats sent."""
    missed_heartbeats: int = 3
    """Intervals of silence (or of our bytes left unread) after which the peer is dead."""
    max_peer_interval: float = 120.0
    """Largest heartbeat interval a peer may announce; a longer one is taken as this."""
    frame_timeout: float = 30.0
    """Seconds a frame may take to arrive whole once its first byte came."""
    max_runs: int = 1024
    """Runs the peer may have this end serve at once; more are refused RESOURCE_EXHAUSTED."""
    max_requests: int = 64
    """Message handlers (capability, node.*, ...) running at once for the peer."""
    run_buffer: int = 256
    """Events buffered per run on the receiving side before reading pauses."""
    write_buffer: int = 256 * 1024
    """Bytes gathered before they are written at once (otherwise at the end of the loop's turn)."""
    read_pause_bytes: int = 4 * 1024 * 1024
    """Reading pauses while more than this many bytes wait to be sent to the peer."""
    flush_delay: float = 0.0
    """Seconds gathered frames may wait to be written with later ones (0: the end of the loop's turn)."""
    read_size: int = 256 * 1024
    """Bytes asked of the socket per read."""
    close_timeout: float = 5.0
    """Seconds a close waits for the peer before aborting the socket."""

    @property
    def watch_tick(self) -> float:
        """How often the watchdog looks: often enough to act within a tenth of any window."""
        return min(1.0, self.heartbeat_interval / 4, self.frame_timeout / 4)


RunHandler = Callable[[pb.RunRequest, EventSink], Awaitable[None]]
"""Executes one run.request, writing to the sink; cancelled when the run is."""
MessageHandler = Callable[["Inbound"], Awaitable[None]]
"""Handles one envelope of its type; an IopError it raises is sent back as the reply."""


@dataclass(frozen=True, slots=True)
class Handler:
    """What this end serves on a connection: runs, and a function per other message type."""

    run: RunHandler | None = None
    """Serves run.request; None refuses runs with UNKNOWN_MESSAGE_TYPE."""
    messages: Mapping[str, MessageHandler] = field(default_factory=lambda: MappingProxyType({}))
    """``Envelope.body`` field name (``capability_request``, ``node_register``, ...) -> handler."""


@dataclass(frozen=True, slots=True)
class Inbound:
    """An envelope handed to a message handler, with the means to answer it."""

    connection: Connection
    envelope: pb.Envelope

    @property
    def peer(self) -> PeerIdentity:
        """Who sent it, from its certificate."""
        return self.connection.peer

    @property
    def caller(self) -> str:
        """Who the request is for: the envelope's ``caller`` from a peer that acts for others, else the peer."""
        return acting_caller(self.peer, self.envelope.caller)

    async def reply(self, envelope: pb.Envelope) -> None:
        """Send ``envelope`` as the answer (its ``in_reply_to`` is set to this envelope's id)."""
        envelope.in_reply_to = self.envelope.id
        await self.connection.send(envelope, urgent=True)
