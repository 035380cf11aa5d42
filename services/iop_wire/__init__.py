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
- ``dialer``: :class:`KeepConnected`, one connection kept open with backoff and jitter; :class:`Links`, several.
- ``failover``: :func:`open_run_anywhere`, a run opened again on another peer while it has no output.
- ``settings``: the TLS, listen and limit settings every service shares, and the YAML loader.

Messages are the upb classes generated in ``iop_gen.pb.iop.runtime_pb2``.
"""

from __future__ import annotations

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
