"""The IOP wire: the library every IOP service (and any Python client) builds on.

Layers, bottom up (each usable and testable without the ones above it):

- ``framing``: sans-IO length-prefixed frames (no sockets, no logging).
- ``codec``: Envelope <-> bytes, protobuf binary or proto3 canonical JSON.
- ``messages``: message-type names and the one place errors become ``Error`` messages.
- ``tls`` and ``certs``: mTLS contexts, peer identity from certificates, certificate minting.
- ``runs``: a run's two ends, the RunStream its caller reads and the EventSink its server
  writes, and :func:`relay`, which forwards a run from one connection to another.
- ``config``: :class:`ConnectionConfig`, every limit and timer of one connection.
- ``liveness``: sans-IO clocks that decide when a peer is dead (silent, not reading, a cut frame).
- ``connection``: one TCP connection carrying many runs both ways, heartbeats, bounds, and
  what it serves (:class:`Handler`: a run handler and ``{body field: handler}``).
- ``endpoint``: :class:`Listener` and :func:`dial`, the preface (codec agreement), role checks.
- ``blocking``: a blocking one-request-at-a-time client without asyncio, for short-lived processes.
- ``dialer``: :class:`KeepConnected`, one connection kept open with backoff and jitter; :class:`Links`, several.
- ``failover``: :func:`open_run_anywhere`, a run opened again on another peer: before output, or continued after.
- ``settings``: the TLS, listen and limit settings every service shares, and the YAML loader.

Messages are the upb classes generated in ``iop_gen.pb.iop.runtime_pb2``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names are, for type checkers; at run time each module loads when first asked for
    from iop_wire.connection import Connection, ConnectionConfig, Handler, Inbound, MessageHandler, RunHandler
    from iop_wire.dialer import Backoff, KeepConnected, Links, Target
    from iop_wire.endpoint import Listener, ListenerConfig, dial
    from iop_wire.errors import ConnectionClosed, DecodeError, FrameError, HandshakeError, IopError, code_name
    from iop_wire.runs import TERMINAL_EVENTS, EventSink, RunStream, relay
    from iop_wire.tls import TRUSTED_ROLES, PeerIdentity, Role, TlsConfig, acting_caller

__all__ = [
    "TERMINAL_EVENTS",
    "TRUSTED_ROLES",
    "Backoff",
    "Connection",
    "ConnectionClosed",
    "ConnectionConfig",
    "DecodeError",
    "EventSink",
    "FrameError",
    "Handler",
    "HandshakeError",
    "Inbound",
    "IopError",
    "KeepConnected",
    "Links",
    "Listener",
    "ListenerConfig",
    "MessageHandler",
    "PeerIdentity",
    "Role",
    "RunHandler",
    "RunStream",
    "Target",
    "TlsConfig",
    "acting_caller",
    "code_name",
    "dial",
    "relay",
]


# Lazy (PEP 562): importing one light module (``iop_wire.framing``, ``iop_wire.tls``) must not load the
# connection, and with it asyncio, structlog and prometheus_client: `iop nodes ls` starts a new process
# each time and needs none of them.
_HOMES = {
    "iop_wire.connection": ("Connection", "ConnectionConfig", "Handler", "Inbound", "MessageHandler", "RunHandler"),
    "iop_wire.dialer": ("Backoff", "KeepConnected", "Links", "Target"),
    "iop_wire.endpoint": ("Listener", "ListenerConfig", "dial"),
    "iop_wire.errors": ("ConnectionClosed", "DecodeError", "FrameError", "HandshakeError", "IopError", "code_name"),
    "iop_wire.runs": ("TERMINAL_EVENTS", "EventSink", "RunStream", "relay"),
    "iop_wire.tls": ("TRUSTED_ROLES", "PeerIdentity", "Role", "TlsConfig", "acting_caller"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> object:
    """``iop_wire.X``: the re-exported name, its module imported on first use."""
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'iop_wire' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME_OF])
