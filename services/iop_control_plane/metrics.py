"""Prometheus metrics of one control-plane, in a registry of its own (no global state)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iop_control_plane.registry import NodeState, Registry

__all__ = ["ControlPlaneMetrics"]


class ControlPlaneMetrics:
    """The control-plane's metrics, named ``iop_control_plane_<thing>_<unit>``."""

    def __init__(self, nodes: Registry, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.decisions = Counter(
            "iop_control_plane_decisions_total",
            "Scheduling decisions, by policy and outcome.",
            ["policy", "outcome"],
            registry=self.registry,
        )
        self.failovers = Counter(
            "iop_control_plane_failovers_total",
            "Runs moved to another node before their first output, by reason (error code, or connection_lost).",
            ["reason"],
            registry=self.registry,
        )
        self.node_lost = Counter(
            "iop_control_plane_node_lost_runs_total",
            "Runs ended with NODE_LOST: their node was lost after output.",
            registry=self.registry,
        )
        self.registry.register(_NodesByState(nodes))


class _NodesByState(Collector):
    """``iop_control_plane_nodes{state}``, read from the registry when scraped."""

    def __init__(self, nodes: Registry) -> None:
        self._nodes = nodes

    def collect(self) -> Iterator[Metric]:
        counts = Tally(node.state for node in self._nodes.nodes.values())
        family = GaugeMetricFamily("iop_control_plane_nodes", "Registered nodes, by state.", labels=["state"])
        for state in NodeState:
            family.add_metric([state.value], counts[state])
        yield family
