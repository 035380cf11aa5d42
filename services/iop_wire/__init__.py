"""The IOP wire: framing, codecs, mTLS and multiplexed connections shared by every service.

Layers, bottom up (each usable and testable without the ones above it):

- ``framing``: sans-IO length-prefixed frames (no sockets, no logging).
- ``codec``: Envelope <-> bytes, protobuf binary or proto3 canonical JSON.
- ``messages``: envelope builders, message-type names, betterproto2 <-> upb conversion.
- ``tls`` and ``certs``: mTLS contexts, peer identity from certificates, certificate minting.
- ``runs``: a run's two ends: the RunStream its caller reads and the EventSink its server
  writes (adapter callbacks straight to upb-encoded run.event frames: the fast path).
- ``connection``: one TCP connection carrying many runs both ways, heartbeats, backpressure.
- ``endpoint``: listen and dial, the connection preface (codec agreement) and role checks.
"""

from __future__ import annotations
