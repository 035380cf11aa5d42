"""Where ``iop up --listen`` makes the platform reachable from other machines.

``--listen ADDRESS`` (repeatable; an IP address or host name of this machine) adds ADDRESS to the
hosts the control-plane and the worker listen on and the edge serves HTTP on, beside
127.0.0.1, and to every certificate's names (SANs): a certificate in ``DIR/certs`` that lacks
one is issued again from the same CA, for the same role, with one line saying so. ``iop
status`` and ``iop join-token create`` read the addresses back from the configs: every listen
host but the loopback ones ``iop up`` always adds is an address other machines use.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path

import yaml
from cryptography import x509

from iop_cli.output import CliError
from iop_wire.certs import Authority
from iop_wire.tls import Role

__all__ = ["LOOPBACK", "check_listen", "configured_hosts", "ensure_sans", "listen_hosts", "others_use"]

LOOPBACK = "127.0.0.1"
_THIS_MACHINE_ONLY = frozenset({LOOPBACK, "::1", "localhost"})
_DEFAULT_SANS = ("localhost", LOOPBACK)
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def check_listen(addresses: Sequence[str]) -> list[str]:
    """The ``--listen`` addresses, each checked to be one this machine can listen on; CliError (exit 2) if not."""
    for address in addresses:
        _check_one(address)
    return list(dict.fromkeys(addresses))


def _check_one(address: str) -> None:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        if not _HOST_NAME.fullmatch(address):
            raise CliError(f"--listen {address!r} is neither an IP address nor a host name", 2) from None
    else:
        if ip.is_unspecified:
            raise CliError(
                f"--listen takes an address other machines use to reach this one, not {address} (every address)", 2
            )
    try:
        with socket.create_server((address, 0)):
            pass
    except OSError as exc:
        raise CliError(f"--listen {address}: this machine cannot listen there: {exc.strerror or exc}", 2) from None


def listen_hosts(addresses: Sequence[str]) -> str | list[str]:
    """The ``host`` to write for ``--listen addresses``: loopback alone, or a list starting with it."""
    return [LOOPBACK, *(a for a in addresses if a != LOOPBACK)] if addresses else LOOPBACK


def configured_hosts(config: Path, section: str = "listen") -> list[str]:
    """The hosts in ``section.host`` of ``config`` (127.0.0.1 when it names none)."""
    try:
        host = yaml.safe_load(config.read_text())[section]["host"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return [LOOPBACK]
    hosts = [host] if isinstance(host, str) else host if isinstance(host, list) else []
    return [str(h) for h in hosts] or [LOOPBACK]


def others_use(config: Path, section: str = "listen") -> list[str]:
    """The hosts in ``section.host`` of ``config`` that other machines use (not loopback); [] if none."""
    return [host for host in configured_hosts(config, section) if host not in _THIS_MACHINE_ONLY]


def ensure_sans(certs: Path, addresses: Sequence[str]) -> None:
    """Give every role's certificate in ``certs`` the names localhost, 127.0.0.1 and ``addresses``:
    one that lacks any is issued again from the CA in ``certs`` (same role, its names kept)."""
    wanted = [*_DEFAULT_SANS, *addresses]
    lacking: dict[Role, tuple[list[str], list[str]]] = {}
    for role in Role:
        found = _missing(certs / f"{role.value}.crt", wanted)
        if found is not None and found[1]:
            lacking[role] = found
    if not lacking:
        return
    try:
        authority = Authority.load(certs / "ca.crt", certs / "ca.key")
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot issue certificates naming {', '.join(addresses)}: {exc}", 2) from None
    for role, (present, _) in lacking.items():
        authority.issue(role.value, role, sans=[*present, *wanted]).write(certs, role.value)
    names = sorted({name for _, missing in lacking.values() for name in missing})
    print(f"reissued {len(lacking)} certificates in {certs} from the same CA: they did not name {', '.join(names)}")


def _missing(cert: Path, wanted: Iterable[str]) -> tuple[list[str], list[str]] | None:
    """The names ``cert`` holds and those of ``wanted`` it lacks; None when there is no such file."""
    try:
        certificate = x509.load_pem_x509_certificate(cert.read_bytes())
    except (OSError, ValueError):
        return None
    try:
        extension = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        present: list[str] = []
    else:
        present = [*extension.get_values_for_type(x509.DNSName)]
        present += [str(ip) for ip in extension.get_values_for_type(x509.IPAddress)]
    return present, [name for name in wanted if name not in present]
