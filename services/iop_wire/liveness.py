"""When a peer counts as dead: sans-IO clocks fed by the connection and read by its watchdog.

Three clocks, each against a window of ``missed_heartbeats`` intervals (the longer of ours and
the peer's announced one, capped at ``max_peer_interval``) or ``frame_timeout``:

- silence: time since the last *whole* frame arrived (a trickle of bytes is not life);
- unread: time since the peer last took any of the bytes we queued for it, while some wait;
- a frame that started arriving and has not finished.

None of them runs while this end itself holds reading back (too many bytes unsent to the
peer): the peer cannot be blamed for what we do not read. No I/O, no logging here.
"""

from __future__ import annotations

from dataclasses import dataclass

from iop_wire.config import ConnectionConfig

__all__ = ["Liveness", "Verdict"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Why the peer is dead."""

    reason: str
    """``silent``, ``unread`` or ``frame_timeout`` (the metric's label)."""
    message: str
    """What to log and tell the peer."""


class Liveness:
    """The clocks of one connection, in the event loop's time (seconds)."""

    def __init__(self, config: ConnectionConfig, now: float) -> None:
        self._config = config
        self.peer_interval = 0.0
        """The peer's announced heartbeat interval, capped."""
        self.held = False
        """True while this end holds reading back."""
        self._heard = now
        self._frame_since: float | None = None
        self._stall_since: float | None = None
        self._drained = 0

    @property
    def window(self) -> float:
        """Seconds of silence, or of our bytes left unread, after which the peer is dead."""
        interval = max(self._config.heartbeat_interval, self.peer_interval)
        return interval * self._config.missed_heartbeats

    def announce(self, interval: float) -> bool:
        """The peer announced its heartbeat interval; False when it was over the cap (and capped)."""
        fits = interval <= self._config.max_peer_interval
        self.peer_interval = interval if fits else self._config.max_peer_interval
        return fits

    def received(self, now: float, *, frames: int, partial: bool) -> None:
        """Bytes arrived: ``frames`` whole frames completed, ``partial`` when one is still arriving."""
        if frames:
            self._heard = now
            self._frame_since = now if partial else None
        elif self._frame_since is None:
            self._frame_since = now

    def resumed(self, now: float) -> None:
        """This end reads again after holding back: the peer's clocks start from now."""
        self.held = False
        self._heard = now
        if self._frame_since is not None:  # a frame cut by the pause could not finish meanwhile
            self._frame_since = now

    def check(self, now: float, *, written: int, unsent: int) -> Verdict | None:
        """The verdict now, given the bytes handed to the socket so far and those it still holds."""
        if self.held:
            return None
        config = self._config
        if self._frame_since is not None and now - self._frame_since > config.frame_timeout:
            return Verdict("frame_timeout", f"a frame took over {config.frame_timeout:g} s to arrive")
        window = self.window
        if now - self._heard > window:
            silent = now - self._heard
            return Verdict("silent", f"peer missed {config.missed_heartbeats} heartbeats ({silent:.2f} s silent)")
        drained = written - unsent
        if unsent == 0 or drained > self._drained or self._stall_since is None:
            self._drained, self._stall_since = drained, now  # the peer took our bytes, or has none to take
        elif now - self._stall_since > window:
            return Verdict("unread", f"peer read nothing of {unsent} bytes for {now - self._stall_since:.2f} s")
        return None
