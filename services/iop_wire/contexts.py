"""SSL contexts from PEM files, as every IOP peer makes them: TLS 1.2 at least, peers verified against the CA.

:mod:`iop_wire.tls` builds its contexts here from a :class:`~iop_wire.tls.TlsConfig`. Kept apart
from it because its types are dataclasses: ``dataclasses`` imports ``inspect`` (with ``ast``,
``dis`` and ``tokenize``), 12% of the instructions of ``iop nodes ls``, a command that dials with
three files and exits (instructions by valgrind's callgrind).
"""

from __future__ import annotations

import ssl
from pathlib import Path

__all__ = ["mutual_tls_context"]


def mutual_tls_context(purpose: ssl.Purpose, cert: Path, key: Path, ca: Path) -> ssl.SSLContext:
    """A context that presents ``cert`` (with its ``key``) and trusts ``ca``'s certificates alone.

    ``ssl.Purpose.SERVER_AUTH`` for a dialer (it also checks the server's name), ``CLIENT_AUTH`` for a
    listener (whose caller sets how strictly it asks for the client's certificate)."""
    context = ssl.create_default_context(purpose, cafile=str(ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert), str(key))
    return context
