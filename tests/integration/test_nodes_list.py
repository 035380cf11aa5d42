"""``nodes.list`` against a real control-plane: each node's fields as it registered."""

from __future__ import annotations

import asyncio
import datetime
import time
from pathlib import Path

from conftest import Pki
from cp_helpers import client, cp_settings
from google.protobuf.timestamp_pb2 import Timestamp

from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import certificate_facts
from iop_wire.connection import Connection
from iop_wire.endpoint import dial
from iop_wire.tls import Role


async def _register(app: ControlPlaneApp, pki: Pki, node_id: str, labels: dict[str, str]) -> tuple[Connection, bytes]:
    """A node connection registered with ``labels``, and its certificate (PEM)."""
    assert app.listener is not None
    tls = pki.config(node_id, Role.NODE)
    assert tls.cert is not None
    connection = await dial("127.0.0.1", app.listener.port, tls=tls, server_hostname="localhost")
    model = pb.ModelInfo(name="mock-small", max_concurrency=4, available=True)
    capabilities = pb.CapabilityResponse(node_id=node_id, adapters=[pb.AdapterInfo(name="fake", models=[model])])
    capabilities.labels.update(labels)
    status = pb.NodeStatus(models=[pb.ModelLoad(model="mock-small", capacity=4, available=True)])
    register = pb.NodeRegister(node_id=node_id, capabilities=capabilities, status=status)
    await connection.request(pb.Envelope(node_register=register))
    return connection, tls.cert.read_bytes()


def _seconds(timestamp: Timestamp) -> float:
    return timestamp.ToNanoseconds() / 1e9


async def test_nodes_list_answers_labels_load_times_and_certificate(pki: Pki, tmp_path: Path) -> None:
    async with build_control_plane(cp_settings(pki, tmp_path)) as app:
        before = time.time()
        labelled, labelled_pem = await _register(app, pki, "node-a", {"zone": "eu-1", "gpu": "l4"})
        plain, plain_pem = await _register(app, pki, "node-b", {})
        admin = await client(app, pki, "ops", Role.ADMIN)
        try:
            listed = (await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed.nodes
        finally:
            for connection in (admin, labelled, plain):
                await connection.close()
        after = time.time()
    assert [node.node_id for node in listed] == ["node-a", "node-b"]
    assert [dict(node.labels) for node in listed] == [{"zone": "eu-1", "gpu": "l4"}, {}]
    for node, pem in zip(listed, (labelled_pem, plain_pem), strict=True):
        facts = certificate_facts(pem)
        assert (node.certificate_serial, node.certificate_not_after.ToDatetime(datetime.UTC)) == (
            facts.serial,
            facts.not_after,
        )
        assert before <= _seconds(node.first_seen) <= _seconds(node.last_heartbeat) <= after
        assert [(m.model, m.capacity, m.available) for m in node.models] == [("mock-small", 4, True)]
        assert (node.state, node.capacity, node.address.startswith("127.0.0.1:")) == (pb.NODE_STATE_READY, 4, True)


async def test_nodes_list_shows_the_state_of_a_server_the_node_runs(pki: Pki, tmp_path: Path) -> None:
    """The state a node reports for a model whose server it runs (``ModelLoad.served``), first at
    registration and then in a node.status, is what nodes.list answers (``iop nodes ls`` shows it)."""
    starting = pb.ServedModel(engine="llama.cpp", state=pb.SERVED_STATE_STARTING, port=40123)
    ready = pb.ServedModel(engine="llama.cpp", state=pb.SERVED_STATE_READY, pid=1234, port=40123, restarts=1)
    async with build_control_plane(cp_settings(pki, tmp_path)) as app:
        assert app.listener is not None
        node = await dial(
            "127.0.0.1", app.listener.port, tls=pki.config("node-a", Role.NODE), server_hostname="localhost"
        )
        model = pb.ModelInfo(name="smol", max_concurrency=1, available=False, served=starting)
        capabilities = pb.CapabilityResponse(node_id="node-a", adapters=[pb.AdapterInfo(name="vllm", models=[model])])
        status = pb.NodeStatus(models=[pb.ModelLoad(model="smol", capacity=1, available=False, served=starting)])
        await node.request(
            pb.Envelope(node_register=pb.NodeRegister(node_id="node-a", capabilities=capabilities, status=status))
        )
        admin = await client(app, pki, "ops", Role.ADMIN)

        async def listed() -> list[pb.ModelLoad]:
            return list((await admin.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed.nodes[0].models)

        try:
            first = await listed()
            loads = [
                pb.ModelLoad(model="smol", capacity=1, available=True, served=ready),
                pb.ModelLoad(model="mock", capacity=4, available=True),
            ]
            await node.send(pb.Envelope(node_status=pb.NodeStatus(node_id="node-a", models=loads, capacity=5)))
            for _ in range(250):  # the report is taken in order with the request: at most a few rounds
                if (then := await listed())[0].served.state == pb.SERVED_STATE_READY:
                    break
                await asyncio.sleep(0.02)
        finally:
            for connection in (admin, node):
                await connection.close()
    assert [(m.model, m.served) for m in first] == [("smol", starting)]
    assert [(m.model, m.available, m.served) for m in then] == [("smol", True, ready), ("mock", True, pb.ServedModel())]
    assert not then[1].HasField("served")  # a model whose server the node does not run has none
