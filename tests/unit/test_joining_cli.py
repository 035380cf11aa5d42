"""The pure parts of joining a machine on the CLI and node side: names, durations, hosts, renewal time."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import yaml

from iop_cli.addresses import listen_hosts, others_use
from iop_cli.configs import set_value, yaml_value
from iop_cli.join import _name
from iop_cli.output import CliError
from iop_cli.tokens import _duration
from iop_node.renewal import renew_at
from iop_wire.certs import CertificateFacts

_T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


@pytest.mark.parametrize("name", ["gpu-0", "a", "host.example.com", "N_1", "x" * 63])
def test_node_names_that_are_taken(name: str) -> None:
    assert _name(name) == name


@pytest.mark.parametrize("name", ["", "-a", ".a", "a b", "a/b", "x" * 64, "node", "admin", "control-plane"])
def test_node_names_that_are_refused(name: str) -> None:
    with pytest.raises(CliError):
        _name(name)


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("30m", 1800), ("1h", 3600), ("7d", 604800)])
def test_token_lifetimes(text: str, seconds: int) -> None:
    assert _duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0h", "1w", "h", "1.5h", "-1h"])
def test_token_lifetimes_refused(text: str) -> None:
    with pytest.raises(CliError):
        _duration(text)


def test_listen_hosts_start_with_loopback() -> None:
    assert listen_hosts([]) == "127.0.0.1"
    assert listen_hosts(["10.0.0.5", "127.0.0.1", "cp.lan"]) == ["127.0.0.1", "10.0.0.5", "cp.lan"]


def test_others_use_leaves_out_loopback(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("listen:\n  host: [127.0.0.1, 10.0.0.5, '::1', localhost]\n  port: 7400\n")
    assert others_use(config) == ["10.0.0.5"]
    config.write_text("listen:\n  host: 127.0.0.1\n")
    assert others_use(config) == []
    assert others_use(tmp_path / "missing.yaml") == []


def test_a_host_list_is_set_in_place_and_back(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("# mine\nlisten:\n  host: 127.0.0.1  # loopback\n  port: 7400\n")
    set_value(config, ("listen", "host"), ["127.0.0.1", "10.0.0.5"])
    assert config.read_text() == '# mine\nlisten:\n  host: ["127.0.0.1", "10.0.0.5"]  # loopback\n  port: 7400\n'
    set_value(config, ("listen", "host"), ["127.0.0.1", "10.0.0.6"])
    assert '["127.0.0.1", "10.0.0.6"]' in config.read_text()
    assert yaml_value(config, ("listen", "host")) is None  # a list is no scalar
    assert yaml_value(config, ("listen", "port")) == "7400"


def test_renewal_is_due_two_thirds_into_the_lifetime() -> None:
    facts = CertificateFacts("n", "node", "1", _T0, _T0 + datetime.timedelta(days=3))
    assert renew_at(facts) == _T0 + datetime.timedelta(days=2)


def test_a_host_list_written_as_a_block_is_set_in_place(tmp_path: Path) -> None:
    """``iop up --listen A`` writes ``host`` as a block sequence; a later ``--listen A --listen B`` once
    replaced it with flow text that swallowed the line break (``["A", "B"]port: 7400``)."""
    config = tmp_path / "c.yaml"
    rest = "  port: 7400\ntls:\n  enabled: true\n"
    config.write_text("listen:\n  host:\n  - 127.0.0.1\n" + rest)
    set_value(config, ("listen", "host"), ["127.0.0.1", "10.0.0.5"])
    assert config.read_text() == 'listen:\n  host:\n  - "127.0.0.1"\n  - "10.0.0.5"\n' + rest
    set_value(config, ("listen", "host"), "127.0.0.1")
    expected = {"listen": {"host": ["127.0.0.1"], "port": 7400}, "tls": {"enabled": True}}
    assert yaml.safe_load(config.read_text()) == expected
