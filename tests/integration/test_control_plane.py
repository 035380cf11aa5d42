"""The control-plane with real `iop node` processes: registration, relay, failover, roles, drain, policy."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import Pki, assert_eventually
from cp_helpers import BusyNode, all_ready, client, cp_settings, node_processes, sequences
from node_helpers import chat, collect, kinds, text

from iop_control_plane.admin import PolicyInForce
from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_control_plane.registry import NodeState
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.errors import HandshakeError, IopError
from iop_wire.tls import Role


@pytest.fixture
async def cp(pki: Pki, tmp_path: Path) -> AsyncIterator[ControlPlaneApp]:
    async with build_control_plane(cp_settings(pki, tmp_path)) as app:
        yield app


def _port(app: ControlPlaneApp) -> int:
    assert app.listener is not None
    return app.listener.port


def _clean(events: list[pb.RunEvent]) -> None:
    """One start first, gapless numbers from 0, one terminal event last."""
    assert kinds(events)[0] == "start" and kinds(events).count("start") == 1
    assert sequences(events) == list(range(len(events)))


async def test_nodes_register_list_and_capabilities(cp: ControlPlaneApp, pki: Pki, tmp_path: Path) -> None:
    with node_processes(pki, tmp_path, _port(cp), "node-a", "node-b"):
        await all_ready(cp, "node-a", "node-b")
        admin = await client(cp, pki, "ops", Role.ADMIN)
        listed = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
        assert [node.node_id for node in listed.nodes] == ["node-a", "node-b"]
        for node in listed.nodes:
            assert node.state == pb.NODE_STATE_READY
            assert {model.model for model in node.models} == {"mock-small", "mock-slow", "mock-ttft"}
            assert node.HasField("first_seen") and node.address.startswith("127.0.0.1:")
        edge = await client(cp, pki)
        capabilities = await edge.capabilities()
        assert capabilities.node_id == "control-plane"
        models = {model.name: model for adapter in capabilities.adapters for model in adapter.models}
        assert set(models) == {"mock-small", "mock-slow", "mock-ttft"}
        assert models["mock-small"].max_concurrency == 8  # 4 on each node


async def test_runs_are_relayed_clean_and_spread(cp: ControlPlaneApp, pki: Pki, tmp_path: Path) -> None:
    with node_processes(pki, tmp_path, _port(cp), "node-a", "node-b"):
        await all_ready(cp, "node-a", "node-b")
        edge = await client(cp, pki)
        events = await collect(await edge.open_run(chat(run_id="mine")))
        _clean(events)
        assert kinds(events)[-1] == "complete" and text(events)
        assert all(event.error.run_id in ("", "mine") for event in events)

        streams = [await edge.open_run(chat(model="mock-slow")) for _ in range(2)]
        starts = [await anext(stream) for stream in streams]
        assert {start.start.node_id for start in starts} == {"node-a", "node-b"}  # least loaded: one each
        for stream in streams:
            await stream.cancel("enough")
            assert kinds(await collect(stream))[-1] == "error"
        await assert_eventually(lambda: all(v.load == 0 for n in cp.registry.nodes.values() for v in n.models.values()))


async def test_node_killed_before_first_token_fails_over(cp: ControlPlaneApp, pki: Pki, tmp_path: Path) -> None:
    with node_processes(pki, tmp_path, _port(cp), "node-a", "node-b") as processes:
        await all_ready(cp, "node-a", "node-b")
        edge = await client(cp, pki)
        stream = await edge.open_run(chat(model="mock-ttft", run_id="survivor"))
        start = await anext(stream)  # the node started it and waits a second for its first token
        processes[start.start.node_id].kill()
        events = [start, *await collect(stream)]
        _clean(events)
        assert kinds(events)[-1] == "complete", events[-1]
        assert text(events)
        await assert_eventually(lambda: cp.registry.nodes[start.start.node_id].state is NodeState.UNAVAILABLE)
        metrics = cp.metrics.registry
        assert metrics.get_sample_value("iop_control_plane_failovers_total", {"reason": "connection_lost"}) == 1
        assert metrics.get_sample_value("iop_control_plane_nodes", {"state": "unavailable"}) == 1
        placed = {"policy": "least-loaded", "outcome": "placed"}
        assert metrics.get_sample_value("iop_control_plane_decisions_total", placed) == 2


async def test_node_killed_mid_stream_with_no_other_ends_with_node_lost(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    with node_processes(pki, tmp_path, _port(cp), "node-a") as processes:  # another would continue it
        await all_ready(cp, "node-a")
        edge = await client(cp, pki)
        stream = await edge.open_run(chat(model="mock-slow", run_id="cut"))
        start = await anext(stream)
        first = await anext(stream)
        assert first.WhichOneof("event") == "delta"
        processes[start.start.node_id].kill()
        events = [start, first, *await collect(stream)]
        _clean(events)
        assert kinds(events)[-1] == "error"
        error = events[-1].error
        assert error.code == pb.ERROR_CODE_NODE_LOST and error.retryable and error.run_id == "cut"
        assert "not continued" in error.message
        assert cp.metrics.registry.get_sample_value("iop_control_plane_node_lost_runs_total") == 1
        no_node = {"outcome": "no_node"}
        assert cp.metrics.registry.get_sample_value("iop_control_plane_migrations_total", no_node) == 1


async def test_roles_and_identity_are_enforced(cp: ControlPlaneApp, pki: Pki, tmp_path: Path) -> None:
    with node_processes(pki, tmp_path, _port(cp), "node-a"):
        await all_ready(cp, "node-a")
        node = await client(cp, pki, "node-x", Role.NODE)  # a node certificate submitting a run
        events = await collect(await node.open_run(chat()))
        assert [event.error.code for event in events] == [pb.ERROR_CODE_PERMISSION_DENIED]
        with pytest.raises(IopError) as admin_op:
            await node.request(pb.Envelope(nodes_list=pb.NodesList()))
        assert admin_op.value.code == pb.ERROR_CODE_PERMISSION_DENIED

        edge = await client(cp, pki)  # an edge certificate registering as a node
        with pytest.raises(IopError) as register:
            await edge.request(pb.Envelope(node_register=pb.NodeRegister(node_id="edge-node")))
        assert register.value.code == pb.ERROR_CODE_PERMISSION_DENIED
        assert "edge-node" not in cp.registry.nodes

        impostor = await client(cp, pki, "node-a", Role.NODE)  # the id of a live node
        with pytest.raises(IopError) as taken:
            await impostor.request(pb.Envelope(node_register=pb.NodeRegister(node_id="node-a")))
        assert taken.value.code == pb.ERROR_CODE_PROTOCOL_VIOLATION and "node-a" in taken.value.message
        assert kinds(await collect(await edge.open_run(chat())))[-1] == "complete"  # the live one still serves

        with pytest.raises(HandshakeError) as other_role:
            await client(cp, pki, "cp-2", Role.CONTROL_PLANE)
        assert other_role.value.code == pb.ERROR_CODE_PERMISSION_DENIED


async def test_drain_stops_new_runs_until_undrained(cp: ControlPlaneApp, pki: Pki, tmp_path: Path) -> None:
    with node_processes(pki, tmp_path, _port(cp), "node-a", "node-b"):
        await all_ready(cp, "node-a", "node-b")
        admin = await client(cp, pki, "ops", Role.ADMIN)
        done = await admin.request(pb.Envelope(nodes_drain=pb.NodesDrain(node_id="node-a", reason="maintenance")))
        assert done.WhichOneof("body") == "operation_done"
        edge = await client(cp, pki)
        for _ in range(6):
            events = await collect(await edge.open_run(chat()))
            assert events[0].start.node_id == "node-b" and kinds(events)[-1] == "complete"
        listed = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
        assert {n.node_id: n.state for n in listed.nodes}["node-a"] == pb.NODE_STATE_DRAINING
        for unknown_node in (
            pb.Envelope(nodes_drain=pb.NodesDrain(node_id="nope")),
            pb.Envelope(nodes_undrain=pb.NodesUndrain(node_id="nope")),
        ):
            with pytest.raises(IopError) as unknown:
                await admin.request(unknown_node)
            assert unknown.value.code == pb.ERROR_CODE_NOT_FOUND and "'nope'" in unknown.value.message
        for too_long in (  # kept, logged and listed while the node is drained: bounded
            pb.Envelope(nodes_drain=pb.NodesDrain(node_id="node-b", reason="x" * 1001)),
            pb.Envelope(nodes_undrain=pb.NodesUndrain(node_id="node-a", reason="x" * 1001)),
            pb.Envelope(nodes_remove=pb.NodesRemove(node_id="node-b", reason="x" * 1001)),
        ):
            with pytest.raises(IopError) as refused:
                await admin.request(too_long)
            assert refused.value.code == pb.ERROR_CODE_INVALID_ARGUMENT and refused.value.param == "reason"
            assert "1001 characters, over 1000" in refused.value.message
        listed = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed
        assert {n.node_id: n.state for n in listed.nodes} == {
            "node-a": pb.NODE_STATE_DRAINING, "node-b": pb.NODE_STATE_READY
        }  # fmt: skip

        await admin.request(pb.Envelope(nodes_undrain=pb.NodesUndrain(node_id="node-a")))
        streams = [await edge.open_run(chat(model="mock-slow")) for _ in range(2)]
        assert {(await anext(stream)).start.node_id for stream in streams} == {"node-a", "node-b"}
        for stream in streams:
            await stream.cancel("enough")
        assert cp.sessions.store.first_seen.keys() >= {"node-a", "node-b"}


async def test_policy_apply_and_show(cp: ControlPlaneApp, pki: Pki) -> None:
    admin = await client(cp, pki, "ops", Role.ADMIN)
    good = "defaults: {policy: round-robin}\naliases: {gpt: mock-small}\n"
    applied = (await admin.request(pb.Envelope(policy_apply=pb.PolicyApply(yaml=good)))).policy_applied
    with pytest.raises(IopError) as bad:
        await admin.request(pb.Envelope(policy_apply=pb.PolicyApply(yaml="defaults: {policy: random}\n")))
    assert bad.value.code == pb.ERROR_CODE_INVALID_ARGUMENT and "defaults.policy" in bad.value.message
    shown = (await admin.request(pb.Envelope(policy_show=pb.PolicyShow()))).policy_shown
    assert shown.yaml == good and shown.version == applied.version
    assert cp.scheduler.policy.aliases == {"gpt": "mock-small"}


async def test_no_node_for_the_model_is_refused_at_once(cp: ControlPlaneApp, pki: Pki) -> None:
    edge = await client(cp, pki)
    events = await asyncio.wait_for(collect(await edge.open_run(chat(model="nobody-serves"))), 5)
    assert [event.error.code for event in events] == [pb.ERROR_CODE_MODEL_NOT_FOUND]
    assert events[0].sequence == 0


async def test_after_a_restart_a_model_served_before_is_unavailable_until_its_node_returns(
    pki: Pki, tmp_path: Path
) -> None:
    """A model the audit file says nodes served is UNAVAILABLE (retryable) for registration_grace
    after a restart, not MODEL_NOT_FOUND: its nodes are still dialing back. Others are not found."""
    async with build_control_plane(cp_settings(pki, tmp_path)) as first:
        with node_processes(pki, tmp_path, _port(first), "node-a"):
            await all_ready(first, "node-a")
    async with build_control_plane(cp_settings(pki, tmp_path)) as restarted:
        edge = await client(restarted, pki)
        waiting = await asyncio.wait_for(collect(await edge.open_run(chat(model="mock-small"))), 5)
        error = waiting[-1].error
        assert (error.code, error.retryable) == (pb.ERROR_CODE_UNAVAILABLE, True)
        assert error.retry_after.ToTimedelta().total_seconds() == 1 and "registering again" in error.message
        never = await asyncio.wait_for(collect(await edge.open_run(chat(model="nobody-serves"))), 5)
        assert never[-1].error.code == pb.ERROR_CODE_MODEL_NOT_FOUND
        with node_processes(pki, tmp_path, _port(restarted), "node-a"):
            await all_ready(restarted, "node-a")
            assert kinds(await collect(await edge.open_run(chat(model="mock-small"))))[-1] == "complete"
    async with build_control_plane(cp_settings(pki, tmp_path, registration_grace=0)) as impatient:
        edge = await client(impatient, pki)
        refused = await asyncio.wait_for(collect(await edge.open_run(chat(model="mock-small"))), 5)
        assert refused[-1].error.code == pb.ERROR_CODE_MODEL_NOT_FOUND


async def test_a_restarted_node_takes_its_place_and_is_audited(cp: ControlPlaneApp, pki: Pki, tmp_path: Path) -> None:
    with node_processes(pki, tmp_path, _port(cp), "node-a") as processes:
        await all_ready(cp, "node-a")
        processes["node-a"].kill()
        await assert_eventually(lambda: cp.registry.nodes["node-a"].state is NodeState.UNAVAILABLE)
    with node_processes(pki, tmp_path, _port(cp), "node-a"):  # the same id again: its old connection is gone
        await all_ready(cp, "node-a")
        edge = await client(cp, pki)
        assert kinds(await collect(await edge.open_run(chat())))[-1] == "complete"
    await assert_eventually(lambda: cp.registry.nodes["node-a"].state is NodeState.UNAVAILABLE)
    await assert_eventually(lambda: len(cp.sessions.store.events("node-a")) == 4)
    states = [state for state, _ in cp.sessions.store.events("node-a")]
    assert states == ["ready", "unavailable", "ready", "unavailable"]


async def test_retryable_refusal_fails_over_and_stray_events_are_dropped(pki: Pki, tmp_path: Path) -> None:
    policy = PolicyInForce("defaults: {policy: round-robin}\n")
    async with build_control_plane(cp_settings(pki, tmp_path), policy=policy) as app:
        busy = BusyNode("busy")
        with node_processes(pki, tmp_path, _port(app), "node-a"):
            await all_ready(app, "node-a")
            busy_connection = await busy.register(app, pki)
            violations = {"kind": "run_event_for_unknown_run"}
            before = app.metrics.registry.get_sample_value("iop_wire_protocol_violations_total", violations) or 0
            stray = pb.Envelope(run_id="not-given", run_event=pb.RunEvent(delta=pb.RunDelta(text="injected")))
            await busy_connection.send(stray)  # a run it was not given: dropped, counted, reaches nobody
            await assert_eventually(
                lambda: (
                    app.metrics.registry.get_sample_value("iop_wire_protocol_violations_total", violations)
                    == before + 1
                )
            )
            edge = await client(app, pki)
            for index in range(4):
                events = await collect(await edge.open_run(chat(run_id=f"r{index}")))
                _clean(events)
                assert kinds(events)[-1] == "complete" and "injected" not in text(events)
            # opened on the node under <requester connection id>.<run id>.<attempt>
            assert busy.runs and all(re.fullmatch(r"[0-9a-f]{16}\.r\d\.1", run_id) for run_id in busy.runs)
            await busy_connection.close()


async def test_a_requester_that_goes_away_cancels_its_runs_on_the_nodes(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    with node_processes(pki, tmp_path, _port(cp), "node-a"):
        await all_ready(cp, "node-a")
        edge = await client(cp, pki)
        stream = await edge.open_run(chat(model="mock-slow"))
        await anext(stream)
        await anext(stream)
        view = cp.registry.nodes["node-a"].models["mock-slow"]
        assert view.load == 1
        await edge.close()
        await assert_eventually(lambda: view.in_flight == 0 and view.load == 0)  # the node reported it ended


async def test_a_silent_node_is_unavailable_within_3_intervals(cp: ControlPlaneApp, pki: Pki, tmp_path: Path) -> None:
    with node_processes(pki, tmp_path, _port(cp), "node-a", "node-b") as processes:
        await all_ready(cp, "node-a", "node-b")
        processes["node-a"].send_signal(signal.SIGSTOP)  # no close, no heartbeats
        try:
            stopped = time.monotonic()
            await assert_eventually(lambda: cp.registry.nodes["node-a"].state is NodeState.UNAVAILABLE, timeout=5)
            assert time.monotonic() - stopped < 3 * 0.5 + 1.0  # 3 intervals, plus the watchdog's tick
            edge = await client(cp, pki)
            events = await collect(await edge.open_run(chat()))
            assert events[0].start.node_id == "node-b" and kinds(events)[-1] == "complete"
        finally:
            processes["node-a"].send_signal(signal.SIGCONT)
        await all_ready(cp, "node-a")  # it wakes, finds its connection gone, and registers again
