"""The liveness clocks with no sockets: silence, unread bytes, cut frames, capped intervals, held reading."""

from __future__ import annotations

from iop_wire.config import ConnectionConfig
from iop_wire.liveness import Liveness

CONFIG = ConnectionConfig(heartbeat_interval=1.0, missed_heartbeats=3, max_peer_interval=5.0, frame_timeout=2.0)


def test_whole_frames_keep_a_peer_alive_and_silence_kills_it_after_the_window() -> None:
    clocks = Liveness(CONFIG, now=0.0)
    clocks.received(2.5, frames=1, partial=False)
    assert clocks.check(5.0, written=0, unsent=0) is None  # 2.5 s since the last frame
    verdict = clocks.check(5.6, written=0, unsent=0)
    assert verdict is not None and verdict.reason == "silent" and "missed 3 heartbeats" in verdict.message


def test_a_trickle_of_bytes_is_not_life_and_a_cut_frame_times_out() -> None:
    clocks = Liveness(CONFIG, now=0.0)
    for tick in (0.5, 1.0, 1.5, 2.0):
        clocks.received(tick, frames=0, partial=True)  # bytes of one frame, never the whole of it
    assert clocks.check(2.4, written=0, unsent=0) is None
    verdict = clocks.check(2.6, written=0, unsent=0)
    assert verdict is not None and verdict.reason == "frame_timeout"


def test_a_frame_completed_with_the_next_one_started_restarts_the_frame_clock() -> None:
    clocks = Liveness(CONFIG, now=0.0)
    clocks.received(0.1, frames=0, partial=True)
    clocks.received(1.9, frames=1, partial=True)  # that frame ended, another began
    assert clocks.check(3.5, written=0, unsent=0) is None
    assert clocks.check(4.0, written=0, unsent=0) is not None


def test_a_peer_that_takes_none_of_our_bytes_is_dead_after_the_window_even_while_it_talks() -> None:
    clocks = Liveness(CONFIG, now=0.0)
    assert clocks.check(0.5, written=1000, unsent=800) is None  # it took 200: progress
    for tick in (1.0, 2.0, 3.0):
        clocks.received(tick, frames=1, partial=False)  # heartbeats keep coming
        assert clocks.check(tick, written=5000, unsent=4800) is None
    verdict = clocks.check(3.6, written=5000, unsent=4800)
    assert verdict is not None and verdict.reason == "unread" and "4800 bytes" in verdict.message


def test_a_slow_but_reading_peer_is_alive() -> None:
    clocks = Liveness(CONFIG, now=0.0)
    for step in range(1, 20):
        clocks.received(step * 0.5, frames=1, partial=False)
        assert clocks.check(step * 0.5, written=10_000 + step * 10, unsent=10_000) is None


def test_an_announced_interval_is_capped_and_widens_the_window() -> None:
    clocks = Liveness(CONFIG, now=0.0)
    assert clocks.announce(2.0) and clocks.window == 6.0
    assert not clocks.announce(1e9)
    assert clocks.peer_interval == 5.0 and clocks.window == 15.0
    assert clocks.check(14.0, written=0, unsent=0) is None
    assert clocks.check(15.5, written=0, unsent=0) is not None


def test_nothing_is_the_peers_fault_while_this_end_holds_reading() -> None:
    clocks = Liveness(CONFIG, now=0.0)
    clocks.received(0.1, frames=0, partial=True)
    clocks.held = True
    assert clocks.check(60.0, written=10, unsent=10) is None
    clocks.resumed(60.0)  # the clocks start again from now
    assert not clocks.held
    assert clocks.check(61.0, written=10, unsent=10) is None
    verdict = clocks.check(62.5, written=10, unsent=10)
    assert verdict is not None and verdict.reason == "frame_timeout"
