"""The control-plane service's pure parts: protobuf -> registry adapters, capability merge, attempts."""

from __future__ import annotations

from pathlib import Path

from iop_control_plane.metrics import ControlPlaneMetrics
from iop_control_plane.nodes import NodeSessions, loads, status
from iop_control_plane.policy import load_policy
from iop_control_plane.registry import ModelLoad, NodeState, Registry
from iop_control_plane.relay import RunRelay
from iop_control_plane.scheduler import Scheduler
from iop_control_plane.store import AuditStore
from iop_gen.pb.iop import runtime_pb2 as pb


def _capabilities(*models: str, adapter: str = "mock") -> pb.CapabilityResponse:
    infos = [pb.ModelInfo(name=name, max_concurrency=2, available=True, kinds=[pb.RUN_KIND_CHAT]) for name in models]
    return pb.CapabilityResponse(adapters=[pb.AdapterInfo(name=adapter, models=infos)])


def test_status_becomes_the_registry_view() -> None:
    message = pb.NodeStatus(
        models=[pb.ModelLoad(model="m", in_flight=1, queued=2, capacity=4, available=True)], draining=True
    )
    assert status("n", message).models == (ModelLoad("m", 1, 2, 4, available=True),)
    assert status("n", message).draining
    # a registration without per-model loads takes its models from the capabilities
    assert loads(pb.NodeStatus(), _capabilities("a")) == [ModelLoad("a", capacity=2, available=True)]


def test_capabilities_merge_ready_nodes_only(tmp_path: Path) -> None:
    registry = Registry()
    sessions = NodeSessions(registry, AuditStore(tmp_path / "a.db"), heartbeat_interval=1)
    for node_id, models in (("n1", ("a", "b")), ("n2", ("a",)), ("n3", ("c",))):
        sessions.capabilities[node_id] = _capabilities(*models)
        registry.register(node_id, loads(pb.NodeStatus(), sessions.capabilities[node_id]))
    registry.mark("n3", NodeState.UNAVAILABLE, "gone")
    merged = sessions.ready_capabilities()
    assert merged.node_id == "control-plane"
    models = {model.name: model.max_concurrency for model in merged.adapters[0].models}
    assert models == {"a": 4, "b": 2}


def test_attempts_come_from_the_policy_else_the_settings() -> None:
    registry = Registry()
    scheduler = Scheduler(registry)
    relay = RunRelay(scheduler, None, ControlPlaneMetrics(registry), attempts=3)  # type: ignore[arg-type]
    assert relay.attempts("m") == 3
    scheduler.apply(load_policy("defaults: {attempts: 1}\nmodels: {big: {attempts: 5}}\n"))
    assert (relay.attempts("m"), relay.attempts("big")) == (1, 5)
