"""``iop up --listen``, ``iop join-token``, ``iop join``, ``iop nodes remove`` and a joined node's
certificate renewal, as real processes on loopback.

One platform is started for the module with ``iop up --listen 127.0.0.2`` (an address of this
machine other than the 127.0.0.1 ``up`` always takes; no root needed) and certificates of 60 s
for joining nodes (``IOP_JOIN__CERTIFICATE_LIFETIME``), so that a node renews within the test.
Each joining "machine" is a state folder of its own under tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509

from iop_wire.certs import ca_hash, certificate_facts

IOP = [sys.executable, "-m", "iop_cli.main"]
LISTEN = "127.0.0.2"
ENV = {k: v for k, v in os.environ.items() if k not in ("IOP_STATE_DIR", "IOP_API_KEY", "IOP_CONTROL_PLANE")}
_JOIN_LINE = re.compile(r"iop join (\S+):(\d+) --token (iopjt-[a-z0-9]{6}\.[0-9a-f]{32}) --ca (sha256:[0-9a-f]{64})")


def _iop(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*IOP, *args], capture_output=True, text=True, timeout=timeout, check=False, env={**ENV, **(env or {})}
    )


def _failed_in_one_line(result: subprocess.CompletedProcess[str], command: str = "join") -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"iop {command}: "), result.stderr
    return lines[0]


def _sans(cert: Path) -> set[str]:
    names = x509.load_pem_x509_certificate(cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    return {*names.value.get_values_for_type(x509.DNSName), *map(str, names.value.get_values_for_type(x509.IPAddress))}


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``iop up --listen 127.0.0.2``: its state folder."""
    state = tmp_path_factory.mktemp("cp") / "state"
    started = _iop(
        "up", "--dir", str(state), "--port", "0", "--listen", LISTEN, env={"IOP_JOIN__CERTIFICATE_LIFETIME": "60"}
    )
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield state
    finally:
        _iop("down", "--dir", str(state))


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Path]:
    """A joining machine's state folder; whatever a test started there is stopped."""
    folder = tmp_path / "machine"
    yield folder
    if (folder / "node.pid").exists() or (folder / "supervise.pid").exists():
        _iop("down", "--dir", str(folder))


def _token(platform: Path, *extra: str) -> tuple[list[str], str]:
    """``iop join-token create``: the join line's arguments, and what it said on stderr."""
    created = _iop("join-token", "create", "--dir", str(platform), *extra)
    assert created.returncode == 0, created.stderr
    lines = created.stdout.splitlines()
    assert len(lines) == 1, created.stdout
    match = _JOIN_LINE.fullmatch(lines[0])
    assert match, lines[0]
    return lines[0].split()[2:], created.stderr


def _join(join_args: list[str], machine: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return _iop("join", *join_args, "--name", name, "--dir", str(machine), *extra, timeout=90)


def _nodes(platform: Path) -> dict[str, dict[str, Any]]:
    listed = _iop("nodes", "ls", "--dir", str(platform), "--json")
    assert listed.returncode == 0, listed.stderr
    return {node["node_id"]: node for node in json.loads(listed.stdout)}


def _join_attempts(platform: Path) -> dict[str, float]:
    """``iop_control_plane_join_attempts_total`` by outcome, from the control-plane's metrics."""
    port = json.loads((platform / "control-plane.ready").read_text())["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.findall(r'^iop_control_plane_join_attempts_total\{outcome="([a-z_]+)"\} (\S+)$', text, re.MULTILINE)
    return {outcome: float(value) for outcome, value in found}


def _assert_eventually(condition: Any, what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


# --- iop up --listen ----------------------------------------------------------------------------------


def test_listen_puts_the_address_in_every_config_and_certificate(platform: Path) -> None:
    for config, section in (("control-plane", "listen"), ("worker", "listen"), ("edge", "http")):
        assert yaml.safe_load((platform / f"{config}.yaml").read_text())[section]["host"] == ["127.0.0.1", LISTEN]
    control_plane = yaml.safe_load((platform / "control-plane.yaml").read_text())
    assert Path(control_plane["join"]["ca_key"]) == (platform / "certs" / "ca.key").resolve()
    for role in ("control-plane", "node", "worker", "edge", "admin"):
        assert _sans(platform / "certs" / f"{role}.crt") >= {"localhost", "127.0.0.1", LISTEN}


def test_the_edge_and_the_control_plane_answer_on_the_listen_address(platform: Path) -> None:
    edge = json.loads((platform / "edge.ready").read_text())["port"]
    with urllib.request.urlopen(f"http://{LISTEN}:{edge}/health", timeout=10) as answer:
        assert answer.status == 200
    port = json.loads((platform / "control-plane.ready").read_text())["port"]
    listed = _iop("nodes", "ls", "--dir", str(platform), "--control-plane", f"{LISTEN}:{port}", "--server-name", LISTEN)
    assert listed.returncode == 0, listed.stderr


def test_status_shows_the_addresses_other_machines_use(platform: Path) -> None:
    shown = _iop("status", "--dir", str(platform))
    ports = {name: json.loads((platform / f"{name}.ready").read_text())["port"] for name in ("control-plane", "edge")}
    line = next(line for line in shown.stdout.splitlines() if line.startswith("from other machines: "))
    assert f"control-plane {LISTEN}:{ports['control-plane']}" in line
    assert f"edge http://{LISTEN}:{ports['edge']}/v1" in line
    rows = {row["service"]: row for row in json.loads(_iop("status", "--dir", str(platform), "--json").stdout)}
    assert rows["control-plane"]["others_use"] == [f"{LISTEN}:{ports['control-plane']}"]


def test_listen_reissues_certificates_that_lack_the_address_from_the_same_ca(tmp_path: Path) -> None:
    from iop_cli.configs import prepare
    from iop_wire.certs import init_dir

    state = tmp_path / "state"
    init_dir(state / "certs")  # an older up's: localhost and 127.0.0.1 only
    ca = (state / "certs" / "ca.crt").read_bytes()
    before = certificate_facts((state / "certs" / "node.crt").read_bytes()).serial
    prepare(state, 0, None, [LISTEN])
    assert (state / "certs" / "ca.crt").read_bytes() == ca
    assert certificate_facts((state / "certs" / "node.crt").read_bytes()).serial != before
    for role in ("control-plane", "node", "worker", "edge", "admin"):
        cert = state / "certs" / f"{role}.crt"
        assert _sans(cert) >= {"localhost", "127.0.0.1", LISTEN}
        assert certificate_facts(cert.read_bytes()).role == role


def test_listen_on_an_address_this_machine_lacks_is_one_line(tmp_path: Path) -> None:
    for address, said in (("192.0.2.1", "cannot listen there"), ("0.0.0.0", "not 0.0.0.0"), ("a b", "neither")):  # noqa: S104 - refused
        refused = _iop("up", "--dir", str(tmp_path / "state"), "--listen", address)
        assert said in _failed_in_one_line(refused, "up")
    assert not (tmp_path / "state").exists()


# --- join tokens ---------------------------------------------------------------------------------------


def test_join_token_create_prints_the_join_line_for_the_listen_address(platform: Path) -> None:
    join_args, stderr = _token(platform, "--ttl", "30m", "--uses", "2", "--name-prefix", "gpu-")
    port = json.loads((platform / "control-plane.ready").read_text())["port"]
    assert join_args[0] == f"{LISTEN}:{port}"
    assert join_args[4] == ca_hash((platform / "certs" / "ca.crt").read_bytes())
    assert "2 machines" in stderr and "'gpu-'" in stderr
    token_id = join_args[2].removeprefix("iopjt-").split(".")[0]
    listed = json.loads(_iop("join-token", "ls", "--dir", str(platform), "--json").stdout)
    token = next(t for t in listed if t["id"] == token_id)
    assert (token["state"], token["uses"], token["used"], token["name_prefix"]) == ("valid", 2, 0, "gpu-")
    assert join_args[2].split(".")[1] not in json.dumps(listed)  # the secret is shown once, never listed


def test_a_revoked_token_is_listed_so_and_refused(platform: Path, machine: Path) -> None:
    join_args, _ = _token(platform)
    token_id = join_args[2].removeprefix("iopjt-").split(".")[0]
    revoked = _iop("join-token", "revoke", "--dir", str(platform), token_id)
    assert revoked.returncode == 0, revoked.stderr
    listed = json.loads(_iop("join-token", "ls", "--dir", str(platform), "--json").stdout)
    assert next(t for t in listed if t["id"] == token_id)["state"] == "revoked"
    _failed_in_one_line(_join(join_args, machine, "revoked-one"))
    assert not (machine / "joined.json").exists()


def test_a_bad_ttl_is_one_line(platform: Path) -> None:
    _failed_in_one_line(_iop("join-token", "create", "--dir", str(platform), "--ttl", "soon"), "join-token")


# --- iop join ------------------------------------------------------------------------------------------


def test_a_machine_joins_serves_and_stops(platform: Path, machine: Path) -> None:
    join_args, _ = _token(platform)
    joined = _join(join_args, machine, "gpu-b")
    assert joined.returncode == 0, joined.stdout + joined.stderr
    assert f"joined {join_args[0]} as node gpu-b" in joined.stdout
    assert "serves: mock-small, mock-fast" in joined.stdout
    assert _nodes(platform)["gpu-b"]["state"] == "ready"
    facts = certificate_facts((machine / "certs" / "node.crt").read_bytes())
    assert (facts.name, facts.role) == ("gpu-b", "node")
    assert (machine / "certs" / "node.key").stat().st_mode & 0o777 == 0o600
    node = yaml.safe_load((machine / "node.yaml").read_text())
    assert node["node_id"] == "gpu-b" and node["control_plane"] == {"address": join_args[0], "server_name": LISTEN}
    recorded = json.loads((machine / "joined.json").read_text())
    assert (recorded["address"], recorded["name"], recorded["ca"]) == (join_args[0], "gpu-b", join_args[4])

    status = _iop("status", "--dir", str(machine))
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"registered as gpu-b with {join_args[0]}" in status.stdout

    again, _ = _token(platform)
    assert "already joined" in _failed_in_one_line(_join(again, machine, "gpu-b"))

    down = _iop("down", "--dir", str(machine))
    assert down.returncode == 0 and "node" in down.stdout, down.stdout + down.stderr
    _assert_eventually(lambda: _nodes(platform).get("gpu-b", {}).get("state") != "ready", "gpu-b gone from ready")


@pytest.mark.timeout(120)
def test_up_in_a_joined_folder_starts_its_node_again_without_a_token(platform: Path, machine: Path) -> None:
    join_args, _ = _token(platform)
    assert _join(join_args, machine, "gpu-up").returncode == 0
    assert _iop("down", "--dir", str(machine)).returncode == 0  # as a reboot leaves it
    _assert_eventually(lambda: _nodes(platform).get("gpu-up", {}).get("state") != "ready", "gpu-up gone from ready")

    joins = _join_attempts(platform)["accepted"]

    restarted = _iop("up", "--dir", str(machine), timeout=90)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    assert _nodes(platform)["gpu-up"]["state"] == "ready"
    assert _join_attempts(platform)["accepted"] == joins  # the certificate it holds: no join again
    assert "--listen" in _failed_in_one_line(_iop("up", "--dir", str(machine), "--listen", LISTEN), "up")


def test_a_machine_joined_in_the_foreground_stops_on_ctrl_c(platform: Path, machine: Path) -> None:
    join_args, _ = _token(platform)
    command = [*IOP, "join", *join_args, "--name", "gpu-fg", "--dir", str(machine), "--foreground"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV) as process:
        try:
            assert process.stdout is not None
            seen = []
            for line in process.stdout:  # the node's own output follows, prefixed "node | "
                seen.append(line)
                if line.startswith("joined "):
                    break
            assert seen and seen[-1].startswith(f"joined {join_args[0]} as node gpu-fg"), seen
            assert _nodes(platform)["gpu-fg"]["state"] == "ready"
            process.send_signal(signal.SIGINT)
            rest, _ = process.communicate(timeout=30)
            assert process.returncode == 0, rest
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
    _assert_eventually(lambda: _nodes(platform).get("gpu-fg", {}).get("state") != "ready", "gpu-fg gone from ready")
    assert not (machine / "node.pid").exists() or not _alive(machine / "node.pid")


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text().split()[0]), 0)
    except (OSError, ValueError):
        return False
    return True


def test_a_wrong_ca_hash_sends_nothing_but_hello(platform: Path, machine: Path) -> None:
    join_args, _ = _token(platform)
    before = _join_attempts(platform)
    join_args[4] = "sha256:" + "0" * 64
    line = _failed_in_one_line(_join(join_args, machine, "pinned"))
    assert "presented CA sha256:" in line and "nothing was sent" in line
    assert _join_attempts(platform) == before  # no join.request reached it
    assert not machine.exists()  # nothing left behind: a retry starts clean


def test_a_bad_token_is_one_line_and_counted(platform: Path, machine: Path) -> None:
    join_args, _ = _token(platform)
    before = _join_attempts(platform).get("token_invalid", 0)
    join_args[2] = join_args[2][:-4] + "0000"
    line = _failed_in_one_line(_join(join_args, machine, "guessing"))
    assert "not valid" in line
    assert _join_attempts(platform).get("token_invalid", 0) == before + 1
    assert not machine.exists()  # nor the key made for a certificate never issued


def test_bad_arguments_are_one_line_before_anything_is_sent(platform: Path, machine: Path) -> None:
    join_args, _ = _token(platform)
    for index, value in ((0, "no-port"), (2, "not-a-token"), (4, "md5:abc")):
        bad = list(join_args)
        bad[index] = value
        _failed_in_one_line(_join(bad, machine, "fine"))
    _failed_in_one_line(_join(join_args, machine, "node"))  # a role's name
    _failed_in_one_line(_join(join_args, machine, "bad/name"))
    _failed_in_one_line(
        _iop("join", "127.0.0.1:9", "--token", join_args[2], "--ca", join_args[4], "--dir", str(machine))
    )


@pytest.mark.timeout(150)
def test_a_removed_node_is_closed_and_cannot_come_back(platform: Path, machine: Path) -> None:
    join_args, _ = _token(platform)
    assert _join(join_args, machine, "gpu-c").returncode == 0
    removed = _iop("nodes", "remove", "gpu-c", "--dir", str(platform), "--reason", "test")
    assert removed.returncode == 0, removed.stderr
    _assert_eventually(lambda: "gpu-c" not in _nodes(platform), "gpu-c no longer listed")
    _assert_eventually(lambda: "revoked" in (machine / "node.log").read_text(), "the refusal in the node's log")
    assert "gpu-c" not in _nodes(platform)

    def refused_at_home() -> bool:  # its own machine says so too, not "ready", once its next dial was refused
        status = _iop("status", "--dir", str(machine))  # (the closed connection is logged a moment before)
        return "not registered" in status.stdout and "revoked" in status.stdout

    _assert_eventually(refused_at_home, "iop status on the node's machine: not registered, revoked")
    assert _iop("down", "--dir", str(machine)).returncode == 0
    again = _iop("up", "--dir", str(machine), timeout=90)  # the revoked certificate, named in the one line
    assert again.returncode != 0 and "revoked: join again" in again.stderr, again.stdout + again.stderr
    assert len(again.stderr.strip().splitlines()) == 1, again.stderr
    unknown = _iop("nodes", "remove", "no-such-node", "--dir", str(platform))
    assert unknown.returncode == 1 and unknown.stderr.strip()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_joined_node_renews_its_certificate_and_stays_registered(platform: Path, machine: Path) -> None:
    join_args, _ = _token(platform)
    assert _join(join_args, machine, "gpu-renew").returncode == 0
    cert = machine / "certs" / "node.crt"
    first = certificate_facts(cert.read_bytes())
    assert (first.not_after - first.not_before).total_seconds() < 200  # join.certificate_lifetime 60 (+ 1 min back)
    renewed = _assert_eventually(
        lambda: (facts := certificate_facts(cert.read_bytes())).serial != first.serial and facts,
        "a renewed certificate",
        timeout=150,
    )
    assert renewed.name == "gpu-renew" and renewed.not_after > first.not_after
    assert cert.stat().st_mode & 0o777 == 0o600
    assert _nodes(platform)["gpu-renew"]["state"] == "ready"
    assert "certificate renewed" in (machine / "node.log").read_text()


def test_a_port_taken_on_a_listen_address_alone_is_not_chosen() -> None:
    import socket

    from iop_cli.configs import _default_or_free, _ephemeral_floor

    with socket.create_server(("127.0.0.3", 0)) as held:
        taken = held.getsockname()[1]
        chosen = _default_or_free(taken, "the test", ["127.0.0.1", "127.0.0.3"])
    assert chosen != taken
    assert chosen < _ephemeral_floor()  # not one the kernel may give another process's connection meanwhile
