"""Prometheus metrics of one worker, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["WorkerMetrics"]


class WorkerMetrics:
    """``iop_worker_<thing>_<unit>``: lines by outcome (their rate is lines/s), retries, takeovers, lines running."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.lines = Counter(
            "iop_worker_lines_total",
            "Batch lines ended here, by outcome (completed, failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.line_seconds = Histogram(
            "iop_worker_line_seconds",
            "Time from leasing a line to recording its outcome.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.retries = Counter(
            "iop_worker_retries_total",
            "Attempts of lines that failed retryably, by error code.",
            ["code"],
            registry=self.registry,
        )
        self.lease_takeovers = Counter(
            "iop_worker_lease_takeovers_total",
            "Lines taken over from a worker whose lease expired (it died or stalled).",
            registry=self.registry,
        )
        self.part_failures = Counter(
            "iop_worker_part_failures_total",
            "Failures of a background part (step, renew, sweep), each followed by a growing pause.",
            ["part"],
            registry=self.registry,
        )
        self.line_errors = Counter(
            "iop_worker_line_errors_total",
            "Attempts of lines that failed unexpectedly (a bug or the store); they count as attempts.",
            registry=self.registry,
        )
        self.running = Gauge("iop_worker_lines_running", "Lines running on this worker.", registry=self.registry)
        self.pending = Gauge(
            "iop_worker_lines_pending",
            "Lines of batches in progress not yet ended (all workers).",
            registry=self.registry,
        )
