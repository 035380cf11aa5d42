"""Mutual TLS: contexts for listeners and dialers, and peer identity from certificates.

A certificate names its holder in the subject: CN is the name (``node-7``), OU the role
(one of :class:`Role`). Listeners require a client certificate signed by the configured CA
(TLS 1.2 minimum) and accept only the roles they are for; see ``endpoint``. A listener that
takes certless peers (a control-plane that lets machines join) asks for a certificate without
requiring one: a peer that presents none is :data:`CERTLESS`, one that presents one is verified
as always.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import cast

from iop_wire.contexts import mutual_tls_context

__all__ = [
    "ANONYMOUS",
    "CERTLESS",
    "TRUSTED_ROLES",
    "PeerIdentity",
    "Role",
    "TlsConfig",
    "acting_caller",
    "certless_context",
    "client_context",
    "peer_identity",
    "server_context",
]


class Role(StrEnum):
    """What a certificate's holder is allowed to be."""

    CONTROL_PLANE = "control-plane"
    NODE = "node"
    EDGE = "edge"
    WORKER = "worker"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """The seed's ``tls`` keys: with ``enabled``, cert, key and ca are required."""

    enabled: bool = False
    """Use mTLS; plaintext TCP otherwise (tests and local demos only)."""
    cert: Path | None = None
    """This peer's certificate (PEM)."""
    key: Path | None = None
    """This peer's private key (PEM)."""
    ca: Path | None = None
    """The CA that signs every peer's certificate (PEM)."""

    def files(self) -> tuple[Path, Path, Path]:
        """The three files, or ValueError naming the first missing key."""
        for key in ("cert", "key", "ca"):
            if getattr(self, key) is None:
                raise ValueError(f"tls.{key} is required when tls.enabled is true")
        return self.cert, self.key, self.ca  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """Who is on the other end, from its certificate (anonymous without TLS)."""

    name: str
    """The certificate's common name."""
    role: Role | None
    """The certificate's role (OU); None for plaintext or a certificate without one."""
    serial: str = ""
    """The certificate's serial number, lower-case hex ("" without a certificate)."""
    not_after: float | None = None
    """When the certificate expires (epoch seconds; None without a certificate)."""
    certless: bool = False
    """Over TLS but without a client certificate (a listener taking certless peers): nobody vouched for it."""


ANONYMOUS = PeerIdentity(name="", role=None)
"""A peer over plaintext TCP."""
CERTLESS = PeerIdentity(name="", role=None, certless=True)
"""A peer over TLS that presented no certificate (only where a listener takes certless peers)."""

TRUSTED_ROLES = frozenset({Role.CONTROL_PLANE, Role.EDGE, Role.WORKER})
"""Roles that act for others: only their requests may name a caller other than themselves."""


def acting_caller(peer: PeerIdentity, named: str) -> str:
    """Who a request is attributed to: the ``named`` caller from a trusted role, else the peer itself.

    Identity comes from the certificate; a request field is only honoured from a peer whose
    role is to act for others (an edge for its API keys, a worker for its jobs, a control-plane
    for its requesters). Record it next to ``peer.name``, which says who vouched for it.
    """
    if named and peer.role in TRUSTED_ROLES:
        return named
    return peer.name


def server_context(config: TlsConfig, *, certless: bool = False) -> ssl.SSLContext:
    """A listener's context: client certificates required and verified against the CA (with
    ``certless``, asked for and verified when presented, but not required)."""
    context = mutual_tls_context(ssl.Purpose.CLIENT_AUTH, *config.files())
    context.verify_mode = ssl.CERT_OPTIONAL if certless else ssl.CERT_REQUIRED
    return context


def client_context(config: TlsConfig) -> ssl.SSLContext:
    """A dialer's context: presents its certificate and verifies the server's name and CA."""
    return mutual_tls_context(ssl.Purpose.SERVER_AUTH, *config.files())


def certless_context(ca_pem: bytes | None = None) -> ssl.SSLContext:
    """A dialer's context without a certificate of its own (a machine joining): with ``ca_pem`` it
    verifies the server's certificate and name against that CA; without, it verifies nothing (only
    for asking a control-plane for its CA, which the caller then checks against a pinned hash)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_pem is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context.load_verify_locations(cadata=ca_pem.decode())
    return context


def peer_identity(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> PeerIdentity:
    """The verified peer's name and role; anonymous when there is no TLS, certless when TLS carried no certificate."""
    if ssl_object is None:
        return ANONYMOUS
    cert = ssl_object.getpeercert()
    if not cert:
        return CERTLESS
    rdns = cast("tuple[tuple[tuple[str, str], ...], ...]", cert.get("subject", ()))
    subject = {key: value for rdn in rdns for key, value in rdn}
    role_name = subject.get("organizationalUnitName", "")
    role = Role(role_name) if role_name in Role._value2member_map_ else None
    serial = str(cert.get("serialNumber", "")).lower().lstrip("0")
    expires = cert.get("notAfter")
    not_after = ssl.cert_time_to_seconds(expires) if isinstance(expires, str) else None
    return PeerIdentity(name=subject.get("commonName", ""), role=role, serial=serial, not_after=not_after)
