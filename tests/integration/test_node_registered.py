"""Registered mode against a minimal control-plane written here: register, status, runs, reconnect."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import Pki, assert_eventually
from node_helpers import chat, collect, kinds, node_settings, running_node

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection, ConnectionConfig, Handler, Inbound
from iop_wire.endpoint import Listener, ListenerConfig
from iop_wire.tls import Role


class ControlPlanePeer:
    """Answers node.register, keeps every node.status, and can send runs to the node."""

    def __init__(self) -> None:
        self.registered: list[pb.NodeRegister] = []
        self.statuses: list[pb.NodeStatus] = []
        self.connections: list[Connection] = []

    async def on_register(self, inbound: Inbound) -> None:
        register = inbound.envelope.node_register
        self.registered.append(register)
        self.connections.append(inbound.connection)
        await inbound.reply(pb.Envelope(node_registered=pb.NodeRegistered(node_id=register.node_id)))

    async def on_status(self, inbound: Inbound) -> None:
        self.statuses.append(inbound.envelope.node_status)

    def wire(self) -> Handler:
        """The handler table of the control-plane's listener: it serves no runs."""
        return Handler(messages={"node_register": self.on_register, "node_status": self.on_status})


async def _control_plane(pki: Pki, peer: ControlPlanePeer, port: int = 0) -> Listener:
    config = ListenerConfig(
        port=port,
        tls=pki.config("cp", Role.CONTROL_PLANE),
        allowed_roles=frozenset({Role.NODE}),
        connection=ConnectionConfig(heartbeat_interval=0.5),
    )
    return await Listener(config, peer.wire()).start()


async def test_register_report_serve_and_reconnect(pki: Pki, tmp_path: Path) -> None:
    peer = ControlPlanePeer()
    control_plane = await _control_plane(pki, peer)
    port = control_plane.port
    routes = [
        {
            "model": "mock-slow",
            "adapter": "mock",
            "max_concurrency": 2,
            "options": {"tokens": 1000, "tokens_per_second": 50},
        },
        {"model": "mock-small", "adapter": "mock"},
    ]
    settings = node_settings(
        pki,
        tmp_path,
        routes,
        listen={"enabled": False},
        control_plane={
            "address": f"127.0.0.1:{port}",
            "server_name": "localhost",
            "reconnect_initial": 0.05,
            "reconnect_max": 0.2,
        },
    )
    async with running_node(settings) as app:
        await assert_eventually(lambda: len(peer.registered) == 1)
        register = peer.registered[0]
        assert register.node_id == "node-t"
        assert {m.name for a in register.capabilities.adapters for m in a.models} == {"mock-slow", "mock-small"}
        assert register.status.capacity == 6  # 2 for mock-slow + the default 4 for mock-small

        # a run sent by the control-plane is served like a direct one, and the load is reported
        connection = peer.connections[0]
        assert connection.peer.role is Role.NODE
        stream = await connection.open_run(chat(model="mock-slow", run_id="via-cp"))
        await anext(stream)
        await assert_eventually(lambda: any(s.in_flight == 1 for s in peer.statuses))
        await stream.cancel("done")
        await collect(stream)
        await assert_eventually(lambda: peer.statuses[-1].in_flight == 0)
        small = await collect(await connection.open_run(chat(model="mock-small", run_id="small")))
        assert kinds(small)[-1] == "complete"

        # nothing changes: no node.status for several heartbeat intervals, the heartbeats go on
        await assert_eventually(lambda: peer.statuses[-1].in_flight == 0)
        count, heard = len(peer.statuses), connection.last_heard
        await asyncio.sleep(4 * 0.5)  # an absence takes waiting: 4 of the node's heartbeat intervals
        assert len(peer.statuses) == count
        assert connection.last_heard > heard

        # the control-plane restarts on the same port: the node registers again
        await control_plane.close("restart")
        control_plane = await _control_plane(pki, peer, port)
        await assert_eventually(lambda: len(peer.registered) == 2, timeout=10)
        registration = app.registration
        assert registration is not None
        await assert_eventually(lambda: registration.registrations == 2)  # its node.registered came back
    await control_plane.close()


async def test_an_idle_node_reports_its_status_every_status_refresh(pki: Pki, tmp_path: Path) -> None:
    peer = ControlPlanePeer()
    control_plane = await _control_plane(pki, peer)
    control = {"address": f"127.0.0.1:{control_plane.port}", "server_name": "localhost", "status_refresh": 0.2}
    routes = [{"model": "mock-small", "adapter": "mock"}]
    # Heartbeats (and looks for a changed load) only every 5 s: the reports seen sooner are the refresh.
    settings = node_settings(pki, tmp_path, routes, control_plane=control, heartbeat_interval=5.0)
    async with running_node(settings):
        await assert_eventually(lambda: len(peer.statuses) >= 1)
        count = len(peer.statuses)
        await assert_eventually(lambda: len(peer.statuses) >= count + 2, timeout=4)
        assert all(status.in_flight == 0 for status in peer.statuses)
    await control_plane.close()


async def test_drain_from_control_plane_rejects_new_runs(pki: Pki, tmp_path: Path) -> None:
    peer = ControlPlanePeer()
    control_plane = await _control_plane(pki, peer)
    settings = node_settings(
        pki,
        tmp_path,
        [{"model": "mock-small", "adapter": "mock"}],
        listen={"enabled": False},
        control_plane={"address": f"127.0.0.1:{control_plane.port}", "server_name": "localhost"},
    )
    async with running_node(settings):
        await assert_eventually(lambda: len(peer.registered) == 1)
        connection = peer.connections[0]
        await connection.send(pb.Envelope(node_drain=pb.NodeDrain(node_id="node-t", reason="maintenance")))
        await assert_eventually(lambda: bool(peer.statuses) and peer.statuses[-1].draining)
        events = await collect(await connection.open_run(chat(model="mock-small")))
        assert events[-1].error.code == pb.ERROR_CODE_SHUTTING_DOWN and events[-1].error.retryable
    await control_plane.close()


async def test_drain_grace_ends_runs_retryably_and_clients_cannot_drain(pki: Pki, tmp_path: Path) -> None:
    from iop_wire.endpoint import dial
    from iop_wire.errors import IopError

    peer = ControlPlanePeer()
    control_plane = await _control_plane(pki, peer)
    routes = [{"model": "mock-slow", "adapter": "mock", "options": {"tokens": 1000, "tokens_per_second": 20}}]
    settings = node_settings(
        pki,
        tmp_path,
        routes,
        control_plane={"address": f"127.0.0.1:{control_plane.port}", "server_name": "localhost"},
    )
    async with running_node(settings) as app:
        await assert_eventually(lambda: len(peer.registered) == 1)
        assert app.listener is not None
        edge = await dial("127.0.0.1", app.listener.port, tls=pki.config("e", Role.EDGE), server_hostname="localhost")
        with pytest.raises(IopError) as refused:  # a client may not drain the node
            await edge.request(pb.Envelope(node_drain=pb.NodeDrain(node_id="node-t")))
        assert refused.value.code == pb.ERROR_CODE_PERMISSION_DENIED
        assert not app.node.draining
        stream = await edge.open_run(chat(model="mock-slow", run_id="long"))
        await anext(stream)
        drain = pb.NodeDrain(node_id="node-t", reason="maintenance")
        drain.grace.FromMilliseconds(300)
        await peer.connections[0].send(pb.Envelope(node_drain=drain))
        last = (await collect(stream))[-1]
        assert last.error.code == pb.ERROR_CODE_SHUTTING_DOWN and last.error.retryable
        assert "grace ran out" in last.error.message
        assert (await app.store.get("long")).status.value == "cancelled"  # type: ignore[attr-defined]
        await edge.close()
    await control_plane.close()


_SMALL = [{"model": "mock-small", "adapter": "mock"}]


async def test_the_control_plane_reads_the_nodes_record_of_a_run_and_clients_cannot(pki: Pki, tmp_path: Path) -> None:
    from iop_wire.endpoint import dial
    from iop_wire.errors import IopError

    peer = ControlPlanePeer()
    control_plane = await _control_plane(pki, peer)
    dialing = {"address": f"127.0.0.1:{control_plane.port}", "server_name": "localhost"}
    async with running_node(node_settings(pki, tmp_path, _SMALL, control_plane=dialing)) as app:
        await assert_eventually(lambda: len(peer.registered) == 1)
        connection = peer.connections[0]
        done = (await collect(await connection.open_run(chat(model="mock-small", run_id="conn-1.r.1"))))[-1]
        await app.store.flush()  # type: ignore[attr-defined]

        async def lookup(run_id: str) -> list[pb.LedgerRun]:
            answer = await connection.request(pb.Envelope(runs_list=pb.RunsList(run_id=run_id, limit=1)))
            return list(answer.runs_listed.runs)

        [found] = await lookup("conn-1.r.1")
        assert (found.run_id, found.node_id, found.status) == ("conn-1.r.1", "node-t", "completed")
        assert found.usage == done.complete.usage and found.finish_reason == done.complete.finish_reason
        assert found.requester == "cp" and found.duration.ToTimedelta().total_seconds() > 0
        assert await lookup("conn-1.never.1") == []
        assert app.listener is not None
        edge = await dial("127.0.0.1", app.listener.port, tls=pki.config("e", Role.EDGE), server_hostname="localhost")
        with pytest.raises(IopError) as refused:  # only the node's control-plane asks
            await edge.request(pb.Envelope(runs_list=pb.RunsList(run_id="conn-1.r.1")))
        assert refused.value.code == pb.ERROR_CODE_PERMISSION_DENIED
        await edge.close()
    await control_plane.close()
