"""Minting a CA and per-role certificates for mTLS (``iop certs init DIR``, and tests)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from iop_wire.tls import Role

__all__ = ["Authority", "IssuedCert", "init_dir"]

_DEFAULT_SANS = ("localhost", "127.0.0.1")
_ONE_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class IssuedCert:
    """A certificate and its key, PEM encoded."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path, stem: str) -> tuple[Path, Path]:
        """Write ``stem.crt`` and ``stem.key`` (mode 0600) and return their paths."""
        cert, key = directory / f"{stem}.crt", directory / f"{stem}.key"
        _write_private(cert, self.cert_pem)
        _write_private(key, self.key_pem)
        return cert, key


class Authority:
    """A certificate authority that signs IOP peer certificates."""

    def __init__(self, name: str = "IOP CA", *, days: int = 3650) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _ONE_DAY)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate, to configure as ``tls.ca``."""
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        name: str,
        role: Role | str | None,
        *,
        sans: Iterable[str] = _DEFAULT_SANS,
        days: int = 825,
        not_before: datetime.datetime | None = None,
        not_after: datetime.datetime | None = None,
    ) -> IssuedCert:
        """A certificate for ``name`` in ``role`` (OU), usable as client and server."""
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [x509.NameAttribute(NameOID.COMMON_NAME, name)]
        if role is not None:
            attributes.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, str(role)))
        now = datetime.datetime.now(datetime.UTC)
        start = not_before or now - _ONE_DAY
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attributes))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(not_after or now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(_general_names(sans)), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        return IssuedCert(
            cert_pem=cert.public_bytes(serialization.Encoding.PEM),
            key_pem=key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )

    def write(self, directory: Path) -> Path:
        """Write ``ca.crt`` and ``ca.key`` (0600) and return the certificate's path."""
        key_pem = self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        _write_private(directory / "ca.key", key_pem)
        _write_private(directory / "ca.crt", self.cert_pem)
        return directory / "ca.crt"


def _general_names(sans: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for san in dict.fromkeys(sans):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            names.append(x509.DNSName(san))
    return names


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)


def tls_section(directory: Path, role: str) -> dict[str, object]:
    """The ``tls`` section of a service's config for ``role``'s certificate in ``directory`` (as
    :func:`init_dir` wrote it), with absolute paths."""
    certs = directory.resolve()
    return {
        "enabled": True,
        "cert": str(certs / f"{role}.crt"),
        "key": str(certs / f"{role}.key"),
        "ca": str(certs / "ca.crt"),
    }


def init_dir(directory: Path, *, extra_sans: Iterable[str] = ()) -> list[Path]:
    """Write a new CA and one certificate + key per role into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    authority = Authority()
    written = [authority.write(directory)]
    sans = (*_DEFAULT_SANS, *extra_sans)
    for role in Role:
        written.extend(authority.issue(role.value, role, sans=sans).write(directory, role.value))
    return written
