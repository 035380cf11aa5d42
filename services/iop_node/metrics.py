"""Prometheus metrics of one node, in a registry of its own (no global state)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ModelMetrics", "NodeMetrics"]

_START_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class NodeMetrics:
    """The node's metrics, named ``iop_node_<thing>_<unit>``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.runs = Counter(
            "iop_node_runs_total",
            "Runs finished, by model and final status.",
            ["model", "status"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "iop_node_time_to_first_token_seconds",
            "From run start to the first output.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "iop_node_inter_token_latency_seconds",
            "Between consecutive outputs of a run.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge("iop_node_runs_in_flight", "Runs executing now.", ["model"], registry=self.registry)
        self.queued = Gauge("iop_node_runs_queued", "Runs waiting for a slot.", ["model"], registry=self.registry)
        self.adapter_errors = Counter(
            "iop_node_adapter_errors_total",
            "Runs an adapter failed, by error code.",
            ["adapter", "code"],
            registry=self.registry,
        )
        self.history_backlog = Gauge(
            "iop_node_history_backlog_writes",
            "Run history writes not yet committed (they pile up while the file refuses commits).",
            registry=self.registry,
        )
        self.history_commit_failures = Counter(
            "iop_node_history_commit_failures_total",
            "Run history commits the file refused (each is retried).",
            registry=self.registry,
        )
        self.history_writes_dropped = Counter(
            "iop_node_history_writes_dropped_total",
            "Run history writes given up on: backlog_full, unwritable (the row itself), closed (at shutdown).",
            ["reason"],
            registry=self.registry,
        )
        self.reloads = Counter(
            "iop_node_reloads_total",
            "Reloads of the routes (SIGHUP, nodes.reload), by outcome: applied, bad_config (nothing changed).",
            ["outcome"],
            registry=self.registry,
        )
        self.reload_grace_ended = Counter(
            "iop_node_reload_grace_runs_ended_total",
            "Runs of removed or replaced routes still going when the reload's grace ran out: ended SHUTTING_DOWN.",
            registry=self.registry,
        )
        self.engine_state = Gauge(
            "iop_node_engine_state",
            "Servers the node runs (routes with an engine): 1 for the state each is in now.",
            ["model", "state"],
            registry=self.registry,
        )
        self.engine_state_owners: dict[str, object] = {}
        """The supervisor whose model's ``engine_state`` series these are, by model: a replaced route's
        old server, stopping after the new one started, leaves the new one's series alone."""
        self.engine_restarts = Counter(
            "iop_node_engine_restarts_total",
            "Server restarts, by why: exited, hung (stopped answering its probe), start_failed.",
            ["model", "reason"],
            registry=self.registry,
        )
        self.schema_bounded = Counter(
            "iop_node_schema_bounded_total",
            "Values the mock made from a client's JSON schema (tool arguments, response_format) that a bound cut, "
            "by the first bound: depth, values, items, string, characters, text.",
            ["bound"],
            registry=self.registry,
        )
        self.engine_ready = Histogram(
            "iop_node_engine_ready_seconds",
            "From a server's start to its first ready answer.",
            ["model"],
            buckets=_START_BUCKETS,
            registry=self.registry,
        )

    @cache  # noqa: B019 - one NodeMetrics per node, kept for its life; labels() costs ~3 us a call
    def model(self, model: str) -> ModelMetrics:
        """The per-model children, resolved once instead of on every token."""
        return ModelMetrics(
            time_to_first_token=self.time_to_first_token.labels(model),
            inter_token=self.inter_token.labels(model),
            in_flight=self.in_flight.labels(model),
            queued=self.queued.labels(model),
            schema_bounded=self.schema_bounded,
        )


@dataclass(frozen=True, slots=True)
class ModelMetrics:
    """One model's labelled metrics."""

    time_to_first_token: Histogram
    inter_token: Histogram
    in_flight: Gauge
    queued: Gauge
    schema_bounded: Counter
    """By bound (not by model): counted when an adapter notes ``schema_bounded`` in the run record."""
