"""Scheduling policies with real processes: a control-plane and three `iop node`s (mock adapter, mTLS).

The unit tests (tests/unit/test_scheduler.py) prove these on a fake registry; here the same
properties hold end to end: nodes register, report their load and serve over the wire.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

from conftest import Pki, assert_eventually
from cp_helpers import all_ready, client, cp_settings, sequences
from cp_policy_helpers import Timed, bounded, cp_port, deadline_in, nodes_serving, timed_run, write_policy
from node_helpers import chat, collect, kinds, text

from iop_control_plane.bootstrap import build_control_plane
from iop_control_plane.registry import NodeState
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.tls import Role

NODES = ("node-a", "node-b", "node-c")


def _mock(model: str, capacity: int = 64, **options: Any) -> dict[str, Any]:
    return {"model": model, "adapter": "mock", "max_concurrency": capacity, "options": options}


def _clean(events: list[pb.RunEvent]) -> None:
    """One start first, gapless numbers from 0, complete last."""
    assert kinds(events)[0] == "start" and kinds(events).count("start") == 1, kinds(events)
    assert sequences(events) == list(range(len(events)))
    assert kinds(events)[-1] == "complete", events[-1]


async def test_least_loaded_fills_unequal_nodes_by_capacity(pki: Pki, tmp_path: Path) -> None:
    capacities = {"node-a": 1, "node-b": 2, "node-c": 5}
    slow = {"tokens": 1000, "tokens_per_second": 20}  # 50 s: every run stays in progress until cancelled
    async with build_control_plane(cp_settings(pki, tmp_path)) as cp:
        routes = {node: [_mock("mock-load", capacity, **slow)] for node, capacity in capacities.items()}
        with nodes_serving(pki, tmp_path, cp_port(cp), routes):
            await all_ready(cp, *NODES)
            edge = await client(cp, pki)
            streams = [await edge.open_run(chat(model="mock-load")) for _ in range(sum(capacities.values()))]
            starts = [await asyncio.wait_for(anext(stream), 5) for stream in streams]
            shares = Counter(start.start.node_id for start in starts)
            assert shares == capacities  # exactly its capacity each: 1, 2 and 5 of 8
            for node, capacity in capacities.items():
                assert cp.registry.nodes[node].models["mock-load"].load <= capacity

            # A ninth run finds every slot taken: it waits in the queue, not on a node over capacity.
            ninth = await edge.open_run(chat(model="mock-load", run_id="ninth"))
            await assert_eventually(lambda: cp.runs.queue.depth("mock-load") == 1)
            waiting = asyncio.ensure_future(anext(ninth))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            freed = next(i for i, start in enumerate(starts) if start.start.node_id == "node-c")
            await streams[freed].cancel("make room")
            assert (await asyncio.wait_for(waiting, 5)).start.node_id == "node-c"  # the only free slot
            for stream in [*streams, ninth]:
                await stream.cancel("enough")
            await assert_eventually(
                lambda: all(cp.registry.nodes[n].models["mock-load"].load == 0 for n in capacities), timeout=5
            )


async def test_weighted_route_splits_a_thousand_runs(pki: Pki, tmp_path: Path) -> None:
    """90/10 over 1,000 runs, 32 at a time. The split is smooth weighted round-robin (deterministic,
    9 a + 1 b per 10), and with capacity to spare (64 a node) no pick finds its model busy, so it is
    900/100 exactly; ±1 point leaves room for a rare busy pick, which gives up its turn. (Were the
    pick random, n=1000 p=0.1 would have an sd of 0.95 points and ±1 would be flaky; ±3 would not.)"""
    policy = write_policy(tmp_path, "routes: {chat: {mock-a: 90, mock-b: 10}}\n")
    # Heartbeats every 2 s (a 6 s window), not the helpers' 0.5 s: this loop also drives 1,000 runs, and
    # on a loaded host a 1.5 s stall dropped a node ("has no connection"), which no other node replaces.
    settings = cp_settings(pki, tmp_path, policy_path=policy, heartbeat_interval=2.0)
    async with build_control_plane(settings) as cp:
        fast = {"tokens": 4}
        routes = {
            "node-a": [_mock("mock-a", **fast)],
            "node-b": [_mock("mock-a", **fast)],
            "node-c": [_mock("mock-b", **fast)],
        }
        with nodes_serving(pki, tmp_path, cp_port(cp), routes):
            await all_ready(cp, *NODES)
            edges = [await client(cp, pki, f"edge-{i}") for i in range(4)]
            began = time.monotonic()

            async def one(index: int) -> list[pb.RunEvent]:
                return await collect(await edges[index % 4].open_run(chat(model="chat", run_id=f"w{index}")))

            runs: list[list[pb.RunEvent]] = await bounded(32, [one(index) for index in range(1000)])
            elapsed = time.monotonic() - began
            for events in runs:
                _clean(events)
            served = Counter((events[0].start.model, events[0].start.node_id) for events in runs)
            assert set(served) <= {("mock-a", "node-a"), ("mock-a", "node-b"), ("mock-b", "node-c")}, served
            share_b = served["mock-b", "node-c"] / len(runs)
            print(f"weighted split: {dict(served)} in {elapsed:.2f} s; mock-b share {share_b:.3f}")
            assert abs(share_b - 0.10) <= 0.01, served
            assert min(served["mock-a", "node-a"], served["mock-a", "node-b"]) >= 300  # mock-a spread over both


async def test_session_affinity_survives_a_node_leaving_and_returning(pki: Pki, tmp_path: Path) -> None:
    policy = write_policy(tmp_path, "models: {mock-aff: {policy: session-affinity}}\n")
    async with build_control_plane(cp_settings(pki, tmp_path, policy_path=policy)) as cp:
        routes = {node: [_mock("mock-aff", tokens=2)] for node in NODES}
        with nodes_serving(pki, tmp_path, cp_port(cp), routes) as nodes:
            await all_ready(cp, *NODES)
            edge = await client(cp, pki)
            sessions = [f"session-{i}" for i in range(30)]

            async def placement() -> dict[str, str]:
                async def one(session: str) -> tuple[str, str]:
                    events = await collect(await edge.open_run(chat(model="mock-aff", metadata={"session": session})))
                    _clean(events)
                    return session, events[0].start.node_id

                return dict(await asyncio.gather(*(one(session) for session in sessions)))

            home = await placement()
            assert await placement() == home  # the same node both times
            counts = Counter(home.values())
            assert len(counts) == 3, counts  # 30 sessions on a 3-node ring land on all of them
            victim = counts.most_common(1)[0][0]

            nodes[victim].kill()
            await assert_eventually(lambda: cp.registry.nodes[victim].state is NodeState.UNAVAILABLE, timeout=5)
            moved = await placement()
            for session, node in home.items():
                if node == victim:
                    assert moved[session] != victim
                else:
                    assert moved[session] == node, (session, node, moved[session])  # only the dead node's move

            nodes[victim].wait(timeout=10)
            nodes.start(victim)  # the same config again
            await all_ready(cp, victim)
            assert await placement() == home  # its sessions come back to it


async def test_a_stalled_node_ends_at_the_deadline_and_holds_nobody_up(pki: Pki, tmp_path: Path) -> None:
    async with build_control_plane(cp_settings(pki, tmp_path)) as cp:
        routes = {
            "node-a": [_mock("mock-stall", stall_after=0)],  # starts runs, never sends a token
            "node-b": [_mock("mock-small", tokens=8, tokens_per_second=40)],  # 0.2 s a run
            "node-c": [_mock("mock-small", tokens=8, tokens_per_second=40)],
        }
        with nodes_serving(pki, tmp_path, cp_port(cp), routes):
            await all_ready(cp, *NODES)
            edge = await client(cp, pki)
            budget = 2.0
            stalled = asyncio.ensure_future(timed_run(edge, chat(model="mock-stall", deadline=deadline_in(budget))))
            others: list[Timed] = await bounded(4, [timed_run(edge, chat(model="mock-small")) for _ in range(16)])
            assert not stalled.done()
            for run in others:
                _clean(run.events)
                assert run.node in ("node-b", "node-c")
            stuck = await asyncio.wait_for(stalled, budget + 5)
            assert stuck.kinds == ["start", "error"], stuck.events
            assert stuck.node == "node-a"
            error = stuck.events[-1].error
            assert error.code == pb.ERROR_CODE_DEADLINE_EXCEEDED, error
            waited = stuck.ended - stuck.opened
            assert budget - 0.1 <= waited <= budget + 1.0, waited  # at its deadline, not long after
            assert max(run.ended for run in others) < stuck.ended  # the others flowed meanwhile
            print(
                f"stalled run ended after {waited:.2f} s ({error.message!r}); 16 others took "
                f"{max(run.ended for run in others) - stuck.opened:.2f} s"
            )

            # Without a deadline it stalls until its requester cancels; then its slot is free again.
            open_ended = await edge.open_run(chat(model="mock-stall"))
            assert (await anext(open_ended)).start.node_id == "node-a"
            await open_ended.cancel("gave up")
            assert kinds(await asyncio.wait_for(collect(open_ended), 5)) == ["error"]
            view = cp.registry.nodes["node-a"].models["mock-stall"]
            await assert_eventually(lambda: view.load == 0 and view.placed == 0, timeout=5)


async def test_a_caller_limit_queues_its_own_runs_only(pki: Pki, tmp_path: Path) -> None:
    policy = write_policy(tmp_path, "callers: {caller-x: {max_concurrency: 1}}\n")
    async with build_control_plane(cp_settings(pki, tmp_path, policy_path=policy)) as cp:
        second = {"tokens": 10, "tokens_per_second": 10}  # 1 s a run
        routes = {node: [_mock("mock-c", **second)] for node in NODES}
        with nodes_serving(pki, tmp_path, cp_port(cp), routes):
            await all_ready(cp, *NODES)
            edge = await client(cp, pki)  # an edge acts for the caller the request names

            def by(caller: str) -> pb.RunRequest:
                return chat(model="mock-c", caller=pb.Caller(id=caller))

            x1 = asyncio.ensure_future(timed_run(edge, by("caller-x")))
            await assert_eventually(lambda: cp.runs.queue.running["caller-x"] == 1)
            x2 = asyncio.ensure_future(timed_run(edge, by("caller-x")))
            await assert_eventually(lambda: cp.runs.queue.depth("mock-c") == 1)  # x's second waits
            y1 = asyncio.ensure_future(timed_run(edge, by("caller-y")))
            first, queued, other = await asyncio.gather(x1, x2, y1)
            for run in (first, queued, other):
                _clean(run.events)
            assert queued.first("start") >= first.ended  # x's second run started after its first ended
            assert queued.first("start") - queued.opened >= 0.5
            assert other.first("start") - other.opened < 0.3  # y was not held up by x's limit
            assert other.first("start") < first.ended
            assert not cp.runs.queue.running and not cp.runs.queue.waiting()


async def test_a_pending_run_fails_over_off_a_stopped_node(pki: Pki, tmp_path: Path) -> None:
    async with build_control_plane(cp_settings(pki, tmp_path)) as cp:
        routes = {node: [_mock("mock-ttft", ttft=1, tokens=5)] for node in NODES}
        with nodes_serving(pki, tmp_path, cp_port(cp), routes) as nodes:
            await all_ready(cp, *NODES)
            admin = await client(cp, pki, "ops", Role.ADMIN)
            for node in ("node-b", "node-c"):
                await admin.request(pb.Envelope(nodes_drain=pb.NodesDrain(node_id=node, reason="steer")))
            edge = await client(cp, pki)
            stream = await edge.open_run(chat(model="mock-ttft", run_id="pending"))
            start = await asyncio.wait_for(anext(stream), 5)
            assert start.start.node_id == "node-a"  # it waits a second for its first token there
            for node in ("node-b", "node-c"):
                await admin.request(pb.Envelope(nodes_undrain=pb.NodesUndrain(node_id=node)))
            nodes["node-a"].send_signal(signal.SIGSTOP)
            try:
                stopped = time.monotonic()
                events = [start, *await asyncio.wait_for(collect(stream), 15)]
                took = time.monotonic() - stopped
                _clean(events)
                assert text(events)
                assert all(event.error.run_id in ("", "pending") for event in events)
                assert cp.registry.nodes["node-a"].state is NodeState.UNAVAILABLE  # node-a did not finish it
                failovers = cp.metrics.registry.get_sample_value(
                    "iop_control_plane_failovers_total", {"reason": "connection_lost"}
                )
                assert failovers == 1
                print(f"failed over and completed {took:.2f} s after SIGSTOP")
                assert took < 3 * 0.5 + 1.0 + 1.0 + 2.0  # silence detected, then a fresh 1 s first token
            finally:
                nodes["node-a"].send_signal(signal.SIGCONT)


async def test_a_run_on_a_frozen_node_ends_at_its_deadline(pki: Pki, tmp_path: Path) -> None:
    """The control-plane ends a run at its deadline (plus 0.5 s for the node's own answer) whatever the node does."""
    # Heartbeats of 5 s: the frozen node is declared dead after ~15 s, long after the run's 1 s deadline.
    async with build_control_plane(cp_settings(pki, tmp_path, heartbeat_interval=5)) as cp:
        routes = {"node-a": [_mock("mock-slow", tokens=1000, tokens_per_second=20)]}
        with nodes_serving(pki, tmp_path, cp_port(cp), routes) as nodes:
            await all_ready(cp, "node-a")
            edge = await client(cp, pki)
            budget = 1.0
            opened = time.monotonic()
            stream = await edge.open_run(chat(model="mock-slow", deadline=deadline_in(budget)))
            assert kinds([await anext(stream), await anext(stream)]) == ["start", "delta"]
            nodes["node-a"].send_signal(signal.SIGSTOP)  # alive to TCP, answers nothing
            try:
                events = await asyncio.wait_for(collect(stream), budget + 2.0)
                assert time.monotonic() - opened <= budget + 2.0
                assert kinds(events)[-1] == "error"
                assert events[-1].error.code == pb.ERROR_CODE_DEADLINE_EXCEEDED
            finally:
                nodes["node-a"].send_signal(signal.SIGCONT)


async def test_a_failover_waits_for_a_busy_node_within_the_deadline(pki: Pki, tmp_path: Path) -> None:
    """Its node killed before the first token and the other node full, a run waits for that node's slot."""
    one = _mock("one", capacity=1, ttft=0.5, tokens=10, tokens_per_second=20)  # ~1 s a run
    async with build_control_plane(cp_settings(pki, tmp_path)) as cp:
        with nodes_serving(pki, tmp_path, cp_port(cp), {"node-a": [one], "node-b": [one]}) as nodes:
            await all_ready(cp, "node-a", "node-b")
            edge = await client(cp, pki)
            moved = await edge.open_run(chat(model="one", run_id="moved"))
            first = await anext(moved)
            busy = await edge.open_run(chat(model="one", run_id="busy"))  # fills the other node
            other = (await anext(busy)).start.node_id
            assert {first.start.node_id, other} == {"node-a", "node-b"}
            nodes[first.start.node_id].kill()  # before its first token

            events = [first, *await asyncio.wait_for(collect(moved), 10)]
            _clean(events)
            busy_events = await collect(busy)
            assert kinds(busy_events)[-1] == "complete"
            metrics = cp.metrics.registry
            assert metrics.get_sample_value("iop_control_plane_failovers_total", {"reason": "connection_lost"}) == 1
            waited = metrics.get_sample_value("iop_control_plane_queue_wait_seconds_sum", {"outcome": "admitted"})
            assert waited is not None and waited > 0.2  # it waited for "busy" to end on the other node
            assert cp.runs.queue.running == {}  # the caller's count came back to nothing
