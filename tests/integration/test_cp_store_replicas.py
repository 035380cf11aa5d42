"""Control-planes sharing one PostgreSQL (issue 20, items 1, 3 and 6): a policy applied, a node
drained and undrained, and a node removed through one are in force on the other (generous waits:
replicas poll every 0.5 s); and PostgreSQL stopped for seconds while runs are served: no run
waits on it, and the ledger holds every run once it is back.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import pytest
from conftest import Pki, assert_eventually
from cp_helpers import all_ready, client, cp_settings, node_processes
from cp_store_helpers import fresh_database, postgres, start_server, stop_server  # noqa: F401 - session fixture
from node_helpers import chat, collect, kinds
from worker.pg_server import PgServer, pg_server, required_binaries

from iop_control_plane import store as store_module
from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_control_plane.ledger import LedgerEntry
from iop_control_plane.pg_store import PgStore
from iop_control_plane.registry import NodeState
from iop_control_plane.state import Opened
from iop_control_plane.store import AuditStore
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection, ConnectionConfig, Handler
from iop_wire.endpoint import dial
from iop_wire.errors import HandshakeError, IopError
from iop_wire.runs import EventSink
from iop_wire.tls import Role, TlsConfig

_POLICY = "callers: {caller-x: {max_concurrency: 1}}\n"
_WAIT = 10.0  # seconds: generous on a busy machine; the poll makes it about 0.5


async def _busy(request: pb.RunRequest, sink: EventSink) -> None:
    await sink.error(IopError(pb.ERROR_CODE_RESOURCE_EXHAUSTED, "full"))


async def _register(app: ControlPlaneApp, tls: TlsConfig, node_id: str) -> Connection:
    """Register ``node_id`` with ``app`` presenting ``tls`` (one certificate for all, as a node does)."""
    assert app.listener is not None
    connection = await dial(
        "127.0.0.1",
        app.listener.port,
        tls=tls,
        server_hostname="localhost",
        handler=Handler(run=_busy),
        config=ConnectionConfig(heartbeat_interval=0.5),
    )
    model = pb.ModelInfo(name="mock-small", max_concurrency=4, available=True)
    capabilities = pb.CapabilityResponse(node_id=node_id, adapters=[pb.AdapterInfo(name="fake", models=[model])])
    status = pb.NodeStatus(models=[pb.ModelLoad(model="mock-small", capacity=4, available=True)])
    register = pb.NodeRegister(node_id=node_id, capabilities=capabilities, status=status)
    await connection.request(pb.Envelope(node_register=register))
    return connection


def _state(app: ControlPlaneApp, node_id: str) -> NodeState | None:
    node = app.registry.nodes.get(node_id)
    return None if node is None else node.state


async def test_policy_drains_and_removals_reach_every_control_plane(
    pki: Pki,
    tmp_path: Path,
    postgres: PgServer,  # noqa: F811 - the session's server
) -> None:
    url = await fresh_database(postgres)
    async with (
        build_control_plane(cp_settings(pki, tmp_path, store={"url": url})) as one,
        build_control_plane(cp_settings(pki, tmp_path, store={"url": url})) as other,
    ):
        tls = pki.config("node-a", Role.NODE)
        await _register(one, tls, "node-a")
        on_other = await _register(other, tls, "node-a")
        await all_ready(one, "node-a")
        await all_ready(other, "node-a")
        async with await client(one, pki, "ops", Role.ADMIN) as ops:
            applied = (await ops.request(pb.Envelope(policy_apply=pb.PolicyApply(yaml=_POLICY)))).policy_applied
            await assert_eventually(lambda: other.operations.policy.version == applied.version, timeout=_WAIT)
            assert other.scheduler.policy.callers["caller-x"].max_concurrency == 1

            await ops.request(pb.Envelope(nodes_drain=pb.NodesDrain(node_id="node-a", reason="maintenance")))
            await assert_eventually(lambda: _state(other, "node-a") is NodeState.DRAINING, timeout=_WAIT)
            await ops.request(pb.Envelope(nodes_undrain=pb.NodesUndrain(node_id="node-a")))
            await assert_eventually(lambda: _state(other, "node-a") is NodeState.READY, timeout=_WAIT)

            await ops.request(pb.Envelope(nodes_remove=pb.NodesRemove(node_id="node-a", reason="retired")))
            await assert_eventually(lambda: _state(other, "node-a") is None and on_other.closed, timeout=_WAIT)
        assert on_other.close_error is not None and "certificate is revoked" in on_other.close_error.message
        with pytest.raises(HandshakeError):  # the other refuses the certificate from now on
            await _register(other, tls, "node-a")


async def test_a_control_plane_starts_with_the_newest_stored_policy_and_drains(
    pki: Pki,
    tmp_path: Path,
    postgres: PgServer,  # noqa: F811 - the session's server
) -> None:
    url = await fresh_database(postgres)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("defaults: {policy: round-robin}\n")
    settings = cp_settings(pki, tmp_path, store={"url": url}, policy_path=policy_file)
    async with build_control_plane(settings) as first:
        assert first.operations.policy.serial == 1  # the file, recorded: the store held none
        async with await client(first, pki, "ops", Role.ADMIN) as ops:
            await ops.request(pb.Envelope(policy_apply=pb.PolicyApply(yaml=_POLICY)))
        await first.sessions.store.state.set_drain("node-z", "later", "ops", drained=True)
    async with build_control_plane(settings) as again:  # the file is older than what was applied since
        assert again.operations.policy.text == _POLICY and again.operations.policy.serial == 2
        assert again.sessions.drained == {"node-z"}
        assert [p.version for p in await again.sessions.store.state.policies()] == [2, 1]


def _sample(cp: ControlPlaneApp, name: str) -> float | None:
    return cp.metrics.registry.get_sample_value(name)


async def test_runs_are_served_while_postgresql_is_away_and_recorded_when_it_is_back(pki: Pki, tmp_path: Path) -> None:
    binaries = required_binaries()
    with pg_server(binaries) as server:
        url = await fresh_database(server)
        settings = cp_settings(pki, tmp_path, store={"url": url, "timeout": 1.0})
        async with build_control_plane(settings) as cp:
            assert cp.listener is not None
            with node_processes(pki, tmp_path, cp.listener.port, "node-a"):
                await all_ready(cp, "node-a")
                async with await client(cp, pki) as edge:
                    before = [chat(run_id=f"before-{n}") for n in range(3)]
                    for request in before:
                        assert kinds(await collect(await edge.open_run(request)))[-1] == "complete"
                    await assert_eventually(lambda: not cp.sessions.store.waiting, timeout=_WAIT)
                    assert _sample(cp, "iop_control_plane_store_up") == 1
                    stop_server(server, binaries)
                    away = [chat(run_id=f"away-{n}") for n in range(20)]
                    for request in away:  # none waits for the database's timeout (1 s) in turn
                        events = await asyncio.wait_for(collect(await edge.open_run(request)), timeout=5)
                        assert kinds(events)[-1] == "complete"
                    await assert_eventually(lambda: cp.sessions.store.failing, timeout=_WAIT)
                    await asyncio.sleep(2)  # the writer retries meanwhile
                    assert _sample(cp, "iop_control_plane_store_up") == 0
                    assert _sample(cp, "iop_control_plane_store_backlog") >= len(away)  # each run's row waits
                    assert _sample(cp, "iop_control_plane_audit_dropped_total") == 0
                    start_server(server, binaries)
                    await assert_eventually(lambda: not cp.sessions.store.failing, timeout=30)
                    await assert_eventually(lambda: _sample(cp, "iop_control_plane_store_backlog") == 0, timeout=_WAIT)
        connection = await asyncpg.connect(url)
        try:
            rows = await connection.fetch("SELECT run_id, count(*) FROM runs GROUP BY run_id")
            open_left = await connection.fetchval("SELECT count(*) FROM open_runs")
        finally:
            await connection.close()
    counted = {row[0]: row[1] for row in rows}
    assert counted == {request.run_id: 1 for request in before + away}  # each once
    assert open_left == 0


async def test_a_replica_is_not_taken_for_dead_because_the_database_was_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After PostgreSQL was away longer than STALE_AFTER, no replica had noted itself alive: the one
    back first must not record the other's runs interrupted before that one had the time to."""
    monkeypatch.setattr(store_module, "STALE_AFTER", 3.0)
    monkeypatch.setattr(store_module, "RECOVER_EVERY", 0.1)
    binaries = required_binaries()
    with pg_server(binaries) as server:
        url = await fresh_database(server)
        slow = PgStore(url, timeout=1.0)  # cp-a: notices the database is back 1 s after cp-b does
        await slow.open("cp-a")
        await slow.heartbeat()
        running = LedgerEntry("run-on-cp-a", "edge-1", "c", "alice", "mock-small")
        await slow.commit([Opened(running)], {})
        quick = AuditStore(PgStore(url, timeout=1.0), owner="cp-b")
        await quick.open()
        try:
            stop_server(server, binaries)
            await asyncio.sleep(4.0)  # longer than STALE_AFTER: cp-a's last heartbeat is older than that
            start_server(server, binaries)
            deadline = time.monotonic() + _WAIT
            while not await _alive_again(url, "cp-b"):  # cp-b is back first
                assert time.monotonic() < deadline, "cp-b never noted itself alive again"
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)

            async def beating() -> None:  # cp-a is alive: back 1 s after cp-b, then as often as cp-b
                while True:
                    await slow.heartbeat()
                    await asyncio.sleep(0.1)

            heart = asyncio.create_task(beating())
            await asyncio.sleep(4.0)  # cp-b's recoveries meanwhile (from 3 s after it was back) find cp-a alive
            assert not (await quick.state.runs(pb.RunsList())).runs
            running.ending(pb.RunEvent(complete=pb.RunComplete()))
            await slow.commit([running], {})
            heart.cancel()
            listed = (await quick.state.runs(pb.RunsList())).runs
            assert [(run.run_id, run.status) for run in listed] == [("run-on-cp-a", "completed")]
        finally:
            await quick.aclose()
            await slow.aclose()


async def _alive_again(url: str, owner: str) -> bool:
    """Whether ``owner`` has noted itself alive in the database in the last second."""
    try:
        connection = await asyncpg.connect(url, timeout=1.0)
    except (OSError, asyncpg.PostgresError):
        return False
    try:
        sql = "SELECT seen_at > extract(epoch from statement_timestamp()) - 1 FROM replicas WHERE owner = $1"
        return bool(await connection.fetchval(sql, owner))
    finally:
        await connection.close()
