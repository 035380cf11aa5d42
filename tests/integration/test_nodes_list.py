"""``nodes.list`` against a real control-plane: each node's fields as it registered."""

from __future__ import annotations

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
