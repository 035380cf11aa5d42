"""When a peer counts as dead: sans-IO clocks fed by the connection and read by its watchdog.

Three clocks:

- silence: time since the last *whole* frame arrived (a trickle of bytes is not life), against
  ``missed_heartbeats`` of the peer's own intervals (the one it announced, capped at
  ``max_peer_interval``; ours until it has announced one). A peer is judged by its own promise:
  a node beating every second is out 3 s after it froze, whatever the other side's interval,
  and one that announces an enormous interval is judged by the cap;
- unread: time since the peer last took any of the bytes we queued for it, while some wait,
  against ``missed_heartbeats`` of the longer of both intervals;
- a frame that started arriving and has not finished.

None of them runs while this end itself holds reading back (too many bytes unsent to the
peer), and time this end's event loop stood still is excused: the peer cannot be blamed for
what we do not read. No I/O, no logging here.
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
        self.last_frame = now
        """When the last whole frame arrived (never excused: the time a peer was last heard from)."""
        self._frame_since: float | None = None
        self._stall_since: float | None = None
        self._drained = 0

    @property
    def window(self) -> float:
        """Seconds of silence after which the peer is dead: its own intervals, as it announced them."""
        interval = self.peer_interval or self._config.heartbeat_interval
        return interval * self._config.missed_heartbeats

    @property
    def unread_window(self) -> float:
        """Seconds our bytes may wait unread: the longer of both intervals, since a peer that still
        talks is alive and may only be busy (a frozen one is silent too, and caught by :attr:`window`)."""
        return max(self._config.heartbeat_interval, self.peer_interval) * self._config.missed_heartbeats

    def announce(self, interval: float) -> bool:
        """The peer announced its heartbeat interval; False when it was over the cap (and capped).

        0 (none announced) leaves the window at ours."""
        fits = interval <= self._config.max_peer_interval
        self.peer_interval = interval if fits else self._config.max_peer_interval
        return fits

    def received(self, now: float, *, frames: int, partial: bool) -> None:
        """Bytes arrived: ``frames`` whole frames completed, ``partial`` when one is still arriving."""
        if frames:
            self._heard = self.last_frame = now
            self._frame_since = now if partial else None
        elif self._frame_since is None:
            self._frame_since = now

    def resumed(self, now: float) -> None:
        """This end reads again after holding back: the peer's clocks start from now."""
        self.held = False
        self._heard = now
        if self._frame_since is not None:  # a frame cut by the pause could not finish meanwhile
            self._frame_since = now

    def excuse(self, seconds: float) -> None:
        """This end's event loop stood still for ``seconds``: nothing was read meanwhile, so that time
        is not counted against the peer (a busy or paused judge must not declare everyone dead)."""
        self._heard += seconds
        if self._frame_since is not None:
            self._frame_since += seconds
        if self._stall_since is not None:
            self._stall_since += seconds

    def check(self, now: float, *, written: int, unsent: int) -> Verdict | None:
        """The verdict now, given the bytes handed to the socket so far and those it still holds."""
        if self.held:
            return None
        config = self._config
        if self._frame_since is not None and now - self._frame_since > config.frame_timeout:
            return Verdict("frame_timeout", f"a frame took over {config.frame_timeout:g} s to arrive")
        if (silent := now - self._heard) > self.window:
            return Verdict("silent", f"peer missed {config.missed_heartbeats} heartbeats ({silent:.2f} s silent)")
        drained = written - unsent
        if unsent == 0 or drained > self._drained or self._stall_since is None:
            self._drained, self._stall_since = drained, now  # the peer took our bytes, or has none to take
        elif now - self._stall_since > self.unread_window:
            return Verdict("unread", f"peer read nothing of {unsent} bytes for {now - self._stall_since:.2f} s")
        return None
