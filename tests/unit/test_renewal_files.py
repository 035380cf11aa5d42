"""A node stopped (kill -9) in the middle of putting a renewed certificate in place starts again
with a matching certificate and key: the new pair when both drafts were whole, else the old one."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import yaml

from iop_node.renewal import _draft, _install, finish_interrupted_renewal
from iop_node.settings import load_settings
from iop_wire.certs import Authority, certificate_facts, certificate_request, key_pem, new_key
from iop_wire.tls import Role

_LIFETIME = datetime.timedelta(days=7)


def _pair(authority: Authority, name: str) -> tuple[bytes, bytes]:
    key = new_key()
    pem, _ = authority.sign_request(certificate_request(key, name), role=Role.NODE, lifetime=_LIFETIME)
    return pem, key_pem(key)


@pytest.fixture
def files(tmp_path: Path) -> tuple[Authority, Path, Path, Path]:
    authority = Authority("test CA")
    ca = authority.write(tmp_path)
    cert, key = tmp_path / "node.crt", tmp_path / "node.key"
    old_cert, old_key = _pair(authority, "gpu-1")
    cert.write_bytes(old_cert)
    key.write_bytes(old_key)
    config = tmp_path / "node.yaml"
    tls = {"enabled": True, "cert": str(cert), "key": str(key), "ca": str(ca)}
    config.write_text(yaml.safe_dump({"node_id": "gpu-1", "tls": tls}))
    return authority, cert, key, config


def _serial(cert: Path) -> str:
    return certificate_facts(cert.read_bytes()).serial


@pytest.mark.parametrize("stopped_after", ["key draft", "both drafts", "key renamed"])
def test_a_renewal_stopped_midway_leaves_a_pair_that_loads(
    files: tuple[Authority, Path, Path, Path], stopped_after: str
) -> None:
    authority, cert, key, config = files
    old = _serial(cert)
    new_cert, new_key_pem = _pair(authority, "gpu-1")
    _draft(key).write_bytes(new_key_pem)  # what _install does, step by step, stopped where asked
    if stopped_after != "key draft":
        _draft(cert).write_bytes(new_cert)
    if stopped_after == "key renamed":
        _draft(key).replace(key)
    settings = load_settings(config)  # the tls check loads the pair: a mismatch would raise
    assert settings.tls.cert == cert
    expected = old if stopped_after == "key draft" else certificate_facts(new_cert).serial
    assert _serial(cert) == expected
    assert not _draft(cert).exists() and not _draft(key).exists()


def test_a_whole_renewal_replaces_the_pair_and_leaves_no_drafts(files: tuple[Authority, Path, Path, Path]) -> None:
    authority, cert, key, config = files
    new_cert, new_key_pem = _pair(authority, "gpu-1")
    _install(cert, key, new_cert, new_key_pem)
    assert cert.read_bytes() == new_cert and key.read_bytes() == new_key_pem
    assert (cert.stat().st_mode & 0o777, key.stat().st_mode & 0o777) == (0o600, 0o600)
    assert finish_interrupted_renewal(cert, key) is None
    load_settings(config)
