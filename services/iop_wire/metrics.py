"""The wire's Prometheus metrics, in a registry of their own that each service exposes with its own.

Every limit a peer can run into is counted here by name when it bites (and logged where it
bites), so an operator sees which bound is doing the work: ``iop_wire_limit_hits_total{limit}``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["CONNECTIONS", "FAILOVERS", "HANDSHAKES", "LIMIT_HITS", "PEERS_LOST", "REGISTRY", "expose"]

REGISTRY = CollectorRegistry()
"""The wire's own registry: module-level, because connections and listeners are many per process."""

LIMIT_HITS = Counter(
    "iop_wire_limit_hits_total",
    "Times a resource limit refused, paused or cut off a peer, by limit.",
    ["limit"],
    registry=REGISTRY,
)
CONNECTIONS = Gauge(
    "iop_wire_connections", "Open IOP connections, by side (accepted or dialed).", ["side"], registry=REGISTRY
)
HANDSHAKES = Gauge("iop_wire_handshakes_in_progress", "TLS handshakes and prefaces under way.", registry=REGISTRY)
PEERS_LOST = Counter(
    "iop_wire_peers_lost_total",
    "Connections closed because the peer went silent or stopped reading, by reason.",
    ["reason"],
    registry=REGISTRY,
)
PROTOCOL_VIOLATIONS = Counter(
    "iop_wire_protocol_violations_total",
    "Envelopes dropped because the peer broke the protocol, by kind (run_event_for_unknown_run: a run "
    "it was not given, or one already ended).",
    ["kind"],
    registry=REGISTRY,
)

FAILOVERS = Counter(
    "iop_wire_run_failovers_total",
    "Runs whose control-plane connection or placement failed, by outcome: reopened (opened again through "
    "another control-plane before output), none_left (no other to try), continued (lost after output, "
    "continued through another control-plane from what was delivered), lost_after_output (lost after output "
    "and not continued: ended NODE_LOST, retryable; the log line run not continued says why).",
    ["outcome"],
    registry=REGISTRY,
)


class _Bridge(Collector):
    """Yields the wire registry's metrics from inside another registry."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()


def expose(registry: CollectorRegistry) -> None:
    """Serve the wire's metrics with ``registry``'s (call once per service registry)."""
    registry.register(_Bridge())
