"""The ``iop`` console script, run as a real subprocess."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

IOP = [sys.executable, "-m", "iop_cli.main"]
ROLES = ["control-plane", "node", "edge", "worker", "admin"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*IOP, *args], capture_output=True, text=True, timeout=60, check=False)


def test_certs_init_writes_a_ca_and_one_private_certificate_per_role(tmp_path: Path) -> None:
    result = _run("certs", "init", str(tmp_path / "certs"), "--san", "node.internal", "--san", "10.1.2.3")
    assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in (tmp_path / "certs").iterdir())
    assert files == sorted(["ca.crt", "ca.key", *(f"{r}.{ext}" for r in ROLES for ext in ("crt", "key"))])
    for path in (tmp_path / "certs").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    ca = x509.load_pem_x509_certificate((tmp_path / "certs" / "ca.crt").read_bytes())
    for role in ROLES:
        cert = x509.load_pem_x509_certificate((tmp_path / "certs" / f"{role}.crt").read_bytes())
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == role
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == ["localhost", "node.internal"]
        assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.1.2.3"]


def test_certs_init_refuses_to_replace_a_ca_without_force(tmp_path: Path) -> None:
    assert _run("certs", "init", str(tmp_path)).returncode == 0
    again = _run("certs", "init", str(tmp_path))
    assert again.returncode == 2
    assert "exists; pass --force" in again.stderr
    assert _run("certs", "init", str(tmp_path), "--force").returncode == 0
