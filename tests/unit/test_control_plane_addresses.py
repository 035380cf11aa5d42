"""``control_plane.addresses`` (several control-planes) on every service's settings, and the edge's
merge of their capability answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from iop_edge.settings import load_settings as edge_settings
from iop_edge.upstream import merge_capabilities
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.settings import load_settings as node_settings
from iop_wire.connection import ConnectionConfig
from iop_wire.settings import ConfigError
from iop_wire.tls import TlsConfig
from iop_worker.settings import load_settings as worker_settings


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "service.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("load", [node_settings, edge_settings, worker_settings], ids=["node", "edge", "worker"])
def test_addresses_list_every_control_plane_and_address_stays_one(tmp_path: Path, load: object) -> None:
    several = load(_config(tmp_path, "control_plane: {addresses: ['cp-a:7400', '[::1]:7401']}\n"))  # type: ignore[operator]
    assert several.control_plane.all_addresses == ("cp-a:7400", "[::1]:7401")
    targets = several.control_plane.targets(TlsConfig(), ConnectionConfig())
    assert [(target.host, target.port) for target in targets] == [("cp-a", 7400), ("::1", 7401)]
    one = load(_config(tmp_path, "control_plane: {address: 'cp-a:7400'}\n"))  # type: ignore[operator]
    assert one.control_plane.all_addresses == ("cp-a:7400",)


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ("{address: 'a:1', addresses: ['b:2']}", "control_plane.addresses: set address or addresses, not both"),
        ("{addresses: ['a:1', 'a:1']}", "control_plane.addresses: an address is named twice"),
        ("{addresses: ['a']}", "control_plane.addresses: 'a' has no port"),
        ("{addresses: []}", "control_plane.addresses: name at least one host:port"),
    ],
)
def test_bad_addresses_are_one_line_naming_the_key(tmp_path: Path, section: str, says: str) -> None:
    with pytest.raises(ConfigError) as raised:
        node_settings(_config(tmp_path, f"control_plane: {section}\n"))
    message = str(raised.value).strip()
    key, _, text = says.partition(": ")
    assert "\n" not in message and message.startswith(key) and text in message, message


def test_the_edge_continues_a_run_cut_after_output_migrations_times_and_refuses_a_bad_value(tmp_path: Path) -> None:
    assert edge_settings(_config(tmp_path, "control_plane: {address: 'a:1'}\n")).control_plane.migrations == 2
    assert edge_settings(_config(tmp_path, "control_plane: {migrations: 0}\n")).control_plane.migrations == 0
    for bad in ("-1", "17", "many"):
        with pytest.raises(ConfigError) as raised:
            edge_settings(_config(tmp_path, f"control_plane: {{migrations: {bad}}}\n"))
        message = str(raised.value).strip()
        assert "\n" not in message and message.startswith("control_plane.migrations"), message


def _answer(*models: str, adapter: str = "mock") -> pb.CapabilityResponse:
    infos = [pb.ModelInfo(name=name) for name in models]
    return pb.CapabilityResponse(adapters=[pb.AdapterInfo(name=adapter, models=infos)])


def test_capabilities_of_several_control_planes_merge_each_model_once() -> None:
    merged = merge_capabilities([_answer("a", "b"), _answer("b", "c"), _answer("d", adapter="cli")])
    assert {adapter.name: [model.name for model in adapter.models] for adapter in merged.adapters} == {
        "mock": ["a", "b", "c"],
        "cli": ["d"],
    }
