"""Minting a CA and per-role certificates for mTLS (``iop certs init DIR``, and tests), and the
pieces of joining a machine: a key and certificate request made where the key stays, the CA's
pinned hash, and signing a request (the control-plane, for ``join.request`` and ``cert.renew``)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from iop_wire.tls import Role

__all__ = [
    "Authority",
    "CertificateFacts",
    "IssuedCert",
    "RequestError",
    "ca_hash",
    "certificate_facts",
    "certificate_request",
    "init_dir",
    "key_pem",
    "new_key",
    "requested_name",
]

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


class RequestError(ValueError):
    """A certificate request that cannot be signed: malformed, badly signed, or naming what it may not."""


@dataclass(frozen=True, slots=True)
class CertificateFacts:
    """What a certificate says of its holder."""

    name: str
    """The subject's CN."""
    role: str
    """The subject's OU ("" without one)."""
    serial: str
    """The serial number, lower-case hex."""
    not_before: datetime.datetime
    not_after: datetime.datetime


def new_key() -> ec.EllipticCurvePrivateKey:
    """A new P-256 private key (made where it will be used; it never travels)."""
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM (write it with mode 0600)."""
    encoding, private = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    return key.private_bytes(encoding, private, serialization.NoEncryption())


def certificate_request(key: ec.EllipticCurvePrivateKey, name: str, role: Role | str = "node") -> bytes:
    """A PKCS#10 request (PEM) for ``key``: CN ``name``, OU ``role``, signed by the key."""
    subject = _subject(name, role)
    request = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    return request.public_bytes(serialization.Encoding.PEM)


def ca_hash(ca_pem: bytes) -> str:
    """The CA's pin for ``iop join --ca``: "sha256:" and the hex SHA-256 of its SubjectPublicKeyInfo
    (as kubeadm's ``--discovery-token-ca-cert-hash``); ValueError if ``ca_pem`` is no certificate."""
    certificate = x509.load_pem_x509_certificate(ca_pem)
    spki = certificate.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    digest = hashes.Hash(hashes.SHA256())
    digest.update(spki)
    return "sha256:" + digest.finalize().hex()


def requested_name(csr_pem: bytes, role: Role | str = "node") -> str:
    """The CN a PKCS#10 request asks for, after the checks :meth:`Authority.sign_request` makes
    (RequestError if it would refuse it): look at the name before signing anything."""
    return _checked_request(csr_pem, role)[1]


def _checked_request(csr_pem: bytes, role: Role | str) -> tuple[x509.CertificateSigningRequest, str]:
    """The parsed request and its CN; RequestError if malformed, badly signed, nameless, of another
    role, or for a key that is neither EC nor RSA."""
    try:
        request = x509.load_pem_x509_csr(csr_pem)
    except ValueError:
        raise RequestError("the certificate request is not a PEM PKCS#10 request") from None
    if not request.is_signature_valid:
        raise RequestError("the certificate request's signature does not match its key")
    name = _attribute(request.subject, NameOID.COMMON_NAME)
    if not name:
        raise RequestError("the certificate request names no CN")
    asked = _attribute(request.subject, NameOID.ORGANIZATIONAL_UNIT_NAME)
    if asked and asked != str(role):
        raise RequestError(f"the certificate request asks for role {asked!r}; only {str(role)!r} is issued here")
    if not isinstance(request.public_key(), ec.EllipticCurvePublicKey | rsa.RSAPublicKey):
        raise RequestError("the certificate request's key must be EC or RSA")
    return request, name


def certificate_facts(cert_pem: bytes) -> CertificateFacts:
    """Name, role, serial and validity of a PEM certificate; ValueError if it is none."""
    certificate = x509.load_pem_x509_certificate(cert_pem)
    return CertificateFacts(
        name=_attribute(certificate.subject, NameOID.COMMON_NAME),
        role=_attribute(certificate.subject, NameOID.ORGANIZATIONAL_UNIT_NAME),
        serial=format(certificate.serial_number, "x"),
        not_before=certificate.not_valid_before_utc,
        not_after=certificate.not_valid_after_utc,
    )


def _subject(name: str, role: Role | str) -> x509.Name:
    common, unit = NameOID.COMMON_NAME, NameOID.ORGANIZATIONAL_UNIT_NAME
    return x509.Name([x509.NameAttribute(common, name), x509.NameAttribute(unit, str(role))])


def _attribute(name: x509.Name, oid: x509.ObjectIdentifier) -> str:
    values = name.get_attributes_for_oid(oid)
    value = values[0].value if values else ""
    return value if isinstance(value, str) else value.decode()


class Authority:
    """A certificate authority that signs IOP peer certificates."""

    def __init__(
        self,
        name: str = "IOP CA",
        *,
        days: int = 3650,
        cert: x509.Certificate | None = None,
        key: ec.EllipticCurvePrivateKey | None = None,
    ) -> None:
        if cert is not None and key is not None:  # an existing CA (see load)
            self._cert, self._key = cert, key
            return
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

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> Authority:
        """The CA in these PEM files (``ca.crt``, ``ca.key``); OSError if unreadable, ValueError if
        they hold no CA certificate and matching EC key."""
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path} is not an EC private key")
        if key.public_key().public_numbers() != cert.public_key().public_numbers():  # type: ignore[union-attr]
            raise ValueError(f"{key_path} is not the key of {cert_path}")
        return cls(cert=cert, key=key)

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate, to configure as ``tls.ca``."""
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def sign_request(
        self, csr_pem: bytes, *, role: Role | str, lifetime: datetime.timedelta, sans: Iterable[str] = ()
    ) -> tuple[bytes, CertificateFacts]:
        """Sign a PKCS#10 request for its key, as ``role``: the subject is the request's CN and
        ``role`` as OU, whatever else the request asks; valid from a minute ago for ``lifetime``.
        RequestError if the request is malformed, not signed by its key, has no CN, or an OU
        other than ``role``."""
        request, name = _checked_request(csr_pem, role)
        public_key = request.public_key()
        assert isinstance(public_key, ec.EllipticCurvePublicKey | rsa.RSAPublicKey)  # checked
        now = datetime.datetime.now(datetime.UTC)
        subject = _subject(name, role)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + lifetime)
            .add_extension(x509.SubjectAlternativeName(_general_names((name, *sans))), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        pem = cert.public_bytes(serialization.Encoding.PEM)
        return pem, certificate_facts(pem)

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
