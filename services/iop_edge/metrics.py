"""Prometheus metrics of one edge, as its clients see it, in a registry of its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from iop_edge.edge import Edge

__all__ = ["EdgeMetrics", "KeyCollector"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class EdgeMetrics:
    """``iop_edge_<thing>_<unit>``: requests, time to first token, time between tokens, streams open."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "iop_edge_requests_total",
            "HTTP requests answered, by route, model and status.",
            ["route", "model", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "iop_edge_time_to_first_token_seconds",
            "From the request's arrival to its first token leaving the edge, by model.",
            ["model"],
            buckets=_LATENCY,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "iop_edge_inter_token_seconds",
            "Time between two tokens of a stream leaving the edge, by model.",
            ["model"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=self.registry,
        )
        self.streams = Gauge("iop_edge_streams_open", "Streaming responses in progress.", registry=self.registry)
        self.in_flight = Gauge("iop_edge_requests_in_flight", "Requests being served.", registry=self.registry)
        self.refused = Counter(
            "iop_edge_refused_total",
            "Requests refused by an edge limit, by limit (in_flight, body_size, rpm, tpm, max_concurrent,"
            " file_size, header_timeout, head_size, header_count, url_size, body_timeout, upload_too_slow).",
            ["limit"],
            registry=self.registry,
        )
        self.watchers = Gauge(
            "iop_edge_console_watchers", "Console live streams open (/console/api/live).", registry=self.registry
        )
        self.watchers_refused = Counter(
            "iop_edge_console_watchers_refused_total",
            "Console live streams refused: console.max_watchers, or console.max_watchers_per_key of one key, open.",
            registry=self.registry,
        )
        self.watchers_dropped = Counter(
            "iop_edge_console_watchers_dropped_total",
            "Console live streams closed by the edge because their client stopped reading.",
            registry=self.registry,
        )
        self.watchers_renewed = Counter(
            "iop_edge_console_watchers_renewed_total",
            "Console live streams ended after 8-10 minutes (iop_edge.live.RENEW_SECONDS) for their page to reconnect.",
            registry=self.registry,
        )
        self.cancelled = Counter(
            "iop_edge_client_disconnects_total",
            "Requests whose client went away before the answer ended (their runs are cancelled).",
            ["route"],
            registry=self.registry,
        )


class KeyCollector(Collector):
    """The keys' figures, read from their parts when scraped: the store, the shared limits, the usage backlog."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """One sample each (the limit figures only with a shared store)."""
        edge = self._edge
        keys, usage, limits = edge.keys, edge.usage, edge.limits
        if keys is not None:
            up = not keys.failing and (limits is None or not limits.failing)
            yield GaugeMetricFamily("iop_edge_key_store_up", "1 while the key store answers, else 0.", value=int(up))
            yield CounterMetricFamily(
                "iop_edge_key_store_sessions_lost",
                "Key store operations that met sessions PostgreSQL had ended (a restart) and ran again on new ones.",
                value=keys.storage.sessions_lost,
            )
        if usage is not None:
            yield CounterMetricFamily(
                "iop_edge_usage_dropped", "Requests whose usage was not recorded: backlog full.", value=usage.dropped
            )
            yield GaugeMetricFamily(
                "iop_edge_usage_backlog_rows", "Usage rows (key, minute) waiting to be written.", value=len(usage)
            )
        if limits is not None:
            yield CounterMetricFamily(
                "iop_edge_limit_store_calls", "Budget takes and slot holds sent to the store.", value=limits.takes
            )
            yield CounterMetricFamily(
                "iop_edge_limit_waits", "Requests that waited on a budget take (share ran out).", value=limits.waits
            )
            yield GaugeMetricFamily("iop_edge_limit_edges", "Edges seen sharing the store.", value=limits.edges)
