"""The node's certificate, renewed before it expires over the node's own control-plane connection.

A joined node's certificate lives days, not years (``iop join``). Once two thirds of its lifetime
have passed, the node makes a new key, sends ``cert.renew`` with a certificate request for it on
the mTLS connection it is registered on, and puts the key and the certificate it gets back in
place of the old pair at the paths of its ``tls`` settings (both written aside first, then
renamed; a node stopped midway completes it at its next start, before its settings check the
pair: :func:`finish_interrupted_renewal`). The
live connection goes on with the old certificate; every dial builds its TLS context from the
files (``iop_wire.endpoint.open_stream``), so the next one presents the new certificate. A
renewal that fails is tried again after min(60 s, a tenth of the time left). A certificate that
expired cannot be renewed (the control-plane no longer accepts it): one error line says the node
must join again. The shared development certificate (CN ``node``) is not renewed: the
control-plane issues it no other.
"""

from __future__ import annotations

import asyncio
import datetime
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import CertificateFacts, certificate_facts, certificate_request, key_pem, new_key
from iop_wire.connection import Connection
from iop_wire.errors import IopError
from iop_wire.tls import Role

__all__ = ["CertificateRenewal", "finish_interrupted_renewal", "renew_at"]

_log = structlog.get_logger("iop.node")
_RETRY_CAP = 60.0
_LONGEST_SLEEP = 3600.0  # wake up now and then: the files may have been replaced (a new join)
_SHARED_NAMES = frozenset(role.value for role in Role)


def renew_at(facts: CertificateFacts) -> datetime.datetime:
    """When a certificate is due for renewal: two thirds into its lifetime."""
    return facts.not_before + (facts.not_after - facts.not_before) * 2 / 3


class CertificateRenewal:
    """Keeps the certificate at ``cert``/``key`` renewed, over the connection ``connected`` gives."""

    def __init__(self, cert: Path, key: Path, connected: Callable[[], Awaitable[Connection]]) -> None:
        self.cert, self.key, self._connected = cert, key, connected
        self.renewals = 0
        """Certificates received so far."""
        self.installing = asyncio.Lock()
        """Held while the new files are written: reading the settings meanwhile (a reload) would take the
        half-written renewal for an interrupted one and complete or drop it under the writer."""
        self._expired_said: str | None = None  # the serial whose expiry was logged

    async def run_forever(self) -> None:
        """Renew whenever due, until cancelled; failures are logged and tried again."""
        while True:
            try:
                wait = await self._step()
            except (OSError, ValueError) as exc:  # the files unreadable: said, looked at again later
                _log.warning("cannot read the certificate", cert=str(self.cert), reason=str(exc))
                wait = _RETRY_CAP
            await asyncio.sleep(wait)

    async def _step(self) -> float:
        """Renew if due; the seconds until the next look."""
        facts = certificate_facts(await asyncio.to_thread(self.cert.read_bytes))
        if facts.name in _SHARED_NAMES:
            return _LONGEST_SLEEP
        now = datetime.datetime.now(datetime.UTC)
        left = (facts.not_after - now).total_seconds()
        if left <= 0:
            self._say_expired(facts)
            return _RETRY_CAP
        due = (renew_at(facts) - now).total_seconds()
        if due > 0:
            return min(due, _LONGEST_SLEEP)
        try:
            await self._renew(facts.name)
        except (IopError, OSError, TimeoutError, ValueError) as exc:
            retry = min(_RETRY_CAP, left / 10)
            _log.warning("certificate renewal failed", reason=str(exc) or type(exc).__name__, retry_in_s=retry)
            return retry
        return 0.0  # look at the new certificate at once: the next renewal's time

    async def _renew(self, name: str) -> None:
        connection = await asyncio.wait_for(self._connected(), _RETRY_CAP)
        key = await asyncio.to_thread(new_key)
        request = pb.CertRenew(csr_pem=certificate_request(key, name).decode())
        reply = await connection.request(pb.Envelope(cert_renew=request))
        if reply.WhichOneof("body") != "cert_renewed":
            raise IopError(
                pb.ERROR_CODE_PROTOCOL_VIOLATION, "the control-plane answered cert.renew with something else"
            )
        pem = reply.cert_renewed.certificate_pem.encode()
        facts = certificate_facts(pem)
        if facts.name != name:
            raise ValueError(f"the renewed certificate names {facts.name!r}, not {name!r}")
        async with self.installing:
            await asyncio.to_thread(_install, self.cert, self.key, pem, key_pem(key))
        self.renewals += 1
        _log.info("certificate renewed", node_id=name, serial=facts.serial, not_after=facts.not_after.isoformat())

    def _say_expired(self, facts: CertificateFacts) -> None:
        if self._expired_said == facts.serial:
            return
        self._expired_said = facts.serial
        _log.error(
            "certificate expired: this node must join again ('iop join' with a new token)",
            node_id=facts.name,
            not_after=facts.not_after.isoformat(),
            cert=str(self.cert),
        )


def _draft(path: Path) -> Path:
    return path.with_name(path.name + ".new")


def _write_whole(path: Path, data: bytes) -> None:
    """``path`` written whole (mode 0600, synced): aside first, then renamed, so it is old or new."""
    aside = path.with_name(path.name + ".tmp")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    aside.replace(path)


def _install(cert: Path, key: Path, cert_pem: bytes, key_data: bytes) -> None:
    """Put a new certificate and key in place. Both are written beside the old ones first
    (``.new``, the key's before the certificate's), then renamed over them (the key, then the
    certificate): a stop at any point leaves the old pair, or drafts that
    :func:`finish_interrupted_renewal` completes at the next start."""
    _write_whole(_draft(key), key_data)
    _write_whole(_draft(cert), cert_pem)
    _draft(key).replace(key)
    _draft(cert).replace(cert)


def finish_interrupted_renewal(cert: Path, key: Path) -> str | None:
    """Complete (or drop) a renewal stopped between its writes, so the certificate and key match;
    what was done, None when nothing was. The certificate's draft exists only once both drafts
    are whole: then the renewal is completed; a key draft alone is dropped (the old pair stands)."""
    cert_draft, key_draft = _draft(cert), _draft(key)
    if cert_draft.exists():
        if key_draft.exists():
            key_draft.replace(key)
        cert_draft.replace(cert)
        return "completed a certificate renewal that was stopped midway"
    if key_draft.exists():
        key_draft.unlink()
        return "dropped the key of a certificate renewal that was stopped before its certificate came"
    return None
