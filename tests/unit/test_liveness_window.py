"""Whose interval judges a peer: its own announced one, capped (issue 18, item 2). No sockets."""

from __future__ import annotations

from iop_wire.config import ConnectionConfig
from iop_wire.liveness import Liveness
from iop_wire.settings import ConnectionSettings


def test_a_fast_peer_is_judged_by_its_own_interval_not_by_our_longer_one() -> None:
    control_plane = ConnectionConfig(heartbeat_interval=30.0)  # beats rarely itself
    clocks = Liveness(control_plane, now=0.0)
    assert clocks.announce(1.0)  # a node beating every second
    assert clocks.window == 3.0
    assert clocks.check(2.9, written=0, unsent=0) is None
    verdict = clocks.check(3.1, written=0, unsent=0)
    assert verdict is not None and verdict.reason == "silent"


def test_with_defaults_a_peer_announcing_an_enormous_interval_is_dead_within_30_s() -> None:
    services = ConnectionSettings().config(heartbeat_interval=5.0)  # what every service builds by default
    assert services.max_peer_interval * services.missed_heartbeats <= 30.0
    clocks = Liveness(ConnectionConfig(), now=0.0)
    assert not clocks.announce(1e6)
    assert clocks.window == 30.0
    assert clocks.check(29.0, written=0, unsent=0) is None
    verdict = clocks.check(30.1, written=0, unsent=0)
    assert verdict is not None and verdict.reason == "silent"


def test_before_the_peer_announces_anything_our_interval_is_the_window() -> None:
    clocks = Liveness(ConnectionConfig(heartbeat_interval=2.0), now=0.0)
    assert clocks.window == 6.0
    assert clocks.announce(0.0)  # a heartbeat without an interval says nothing
    assert clocks.window == 6.0


def test_the_default_intervals_fit_well_inside_the_default_cap() -> None:
    # A default interval above the cap would be judged on the cap: killed while merely idle.
    from iop_control_plane.settings import Settings as ControlPlane
    from iop_edge.settings import Settings as Edge
    from iop_node.settings import Settings as Node
    from iop_worker.settings import Settings as Worker

    cap = ConnectionConfig().max_peer_interval
    intervals = {
        cls.__module__: cls.model_fields["heartbeat_interval"].default for cls in (ControlPlane, Edge, Node, Worker)
    }
    assert all(interval <= cap / 2 for interval in intervals.values()), intervals
    assert intervals["iop_node.settings"] * ConnectionConfig().missed_heartbeats < 5  # a frozen node out in < 5 s
