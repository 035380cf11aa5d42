"""The limits and timers of one connection: everything a peer can run into on it.

Read by the connection and by its sans-IO liveness clocks; built by each service's settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from iop_wire.framing import DEFAULT_MAX_FRAME_SIZE

__all__ = ["ConnectionConfig"]


@dataclass(frozen=True, slots=True)
class ConnectionConfig:
    """Limits and timers of one connection; each limit is counted in ``iop_wire_limit_hits_total``."""

    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    """Largest frame body accepted or sent, in bytes."""
    heartbeat_interval: float = 5.0
    """Seconds between heartbeats sent (told to the peer, which judges us by it)."""
    missed_heartbeats: int = 3
    """The peer's intervals of silence (or of our bytes left unread) after which it is dead."""
    max_peer_interval: float = 10.0
    """Largest heartbeat interval a peer may announce; a longer one is taken as this, so a silent
    peer is dead within ``missed_heartbeats`` times this (30 s) whatever it announced."""
    frame_timeout: float = 30.0
    """Seconds a frame may take to arrive whole once its first byte came."""
    max_runs: int = 1024
    """Runs the peer may have this end serve at once; more are refused RESOURCE_EXHAUSTED."""
    max_requests: int = 64
    """Message handlers (capability, node.*, ...) running at once for the peer."""
    run_buffer_bytes: int = 4 * 1024 * 1024
    """Bytes of one run's events kept for its reader; past it (and past one event) that run alone is
    cancelled and its reader gets RESOURCE_EXHAUSTED, reason SLOW_CONSUMER."""
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
        """How often the watchdog looks at most: see also the window, which is the peer's."""
        return min(1.0, self.heartbeat_interval / 4, self.frame_timeout / 4)
