"""The wire's one watchdog timer per event loop: looks coalesced on a grid, a stalled loop excused."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

from conftest import assert_eventually

from iop_wire.watchdog import GRAIN, watch


class _Peer:
    """A watched connection: asks to be looked at every ``nap`` seconds, notes each look."""

    def __init__(self, nap: float) -> None:
        self.nap = nap
        self.looks: list[tuple[float, bool]] = []
        self.excused = 0.0
        self.done = False

    def look(self, now: float, *, judge: bool) -> float | None:
        self.looks.append((now, judge))
        return None if self.done else now + self.nap

    def excuse(self, seconds: float) -> None:
        self.excused += seconds


async def test_many_connections_are_looked_at_together_on_a_few_turns() -> None:
    loop = asyncio.get_running_loop()
    peers = [_Peer(0.5) for _ in range(300)]
    for index, peer in enumerate(peers):  # staggered, as connections arriving over time are
        watch(peer, loop.time() + index * 0.5 / len(peers))
    await asyncio.sleep(2.0)
    for peer in peers:
        peer.done = True
    assert all(len(peer.looks) >= 3 for peer in peers)  # each looked at every half second after its first
    # A timer each would fire once per look (600 and more); on the grid the 300 share one turn per grain.
    later_turns = {now for peer in peers for now, _ in peer.looks[1:]}
    assert len(later_turns) <= 2.0 / GRAIN + 2, len(later_turns)


async def test_a_look_delayed_by_this_loop_is_excused_and_not_judged() -> None:
    loop = asyncio.get_running_loop()
    peer = _Peer(0.05)
    watch(peer, loop.time())
    await assert_eventually(lambda: len(peer.looks) >= 2)
    time.sleep(0.4)  # noqa: ASYNC251 - this end's loop stands still on purpose: its peers cannot be read meanwhile
    count = len(peer.looks)
    await assert_eventually(lambda: len(peer.looks) > count)
    assert peer.looks[count][1] is False  # the look right after the stall does not judge
    assert peer.excused >= 0.3
    await assert_eventually(lambda: peer.looks[-1][1] is True)  # then it judges again
    peer.done = True


async def test_a_connection_is_held_until_its_look_says_done_then_let_go() -> None:
    peer = _Peer(0.05)
    watch(peer, asyncio.get_running_loop().time())
    held = weakref.ref(peer)
    del peer
    gc.collect()
    watched = held()
    assert watched is not None  # its socket alone would not keep an open connection's tasks
    looks = watched.looks
    await assert_eventually(lambda: len(looks) >= 2)
    watched.done = True
    del watched
    await asyncio.sleep(0.2)  # a few naps: its next look says done
    gc.collect()
    assert held() is None
