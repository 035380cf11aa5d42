"""Prometheus metrics of one control-plane, in a registry of its own (no global state)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Container, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iop_control_plane.admission import HOLDS_PER_PASS, AdmissionQueue
from iop_control_plane.registry import NodeState, Registry

if TYPE_CHECKING:
    from iop_control_plane.prefix import PrefixIndex
    from iop_control_plane.scheduler import Decision
    from iop_control_plane.store import AuditStore

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
        self.decision_time = Histogram(
            "iop_control_plane_decision_seconds",
            "Time one scheduling decision took (Scheduler.choose: resolution, candidates, pick).",
            buckets=(2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2),
            registry=self.registry,
        )
        self.background_yields = Counter(
            "iop_control_plane_background_yields_total",
            "Background runs (priority < 0) that arrived to find interactive runs awaiting their first output"
            " on every node with room, and waited.",
            registry=self.registry,
        )
        self.node_lost = Counter(
            "iop_control_plane_node_lost_runs_total",
            "Runs ended with NODE_LOST: their node was lost after output.",
            registry=self.registry,
        )
        self.migrations = Counter(
            "iop_control_plane_migrations_total",
            "Runs whose node was lost after output, by what came of continuing them elsewhere: continued"
            " (re-placed with their delivered output), not_continuable (tool calls, embeddings, several prompts,"
            " output over the relay's bound), limit (the policy's migrations used up), no_node (no node left"
            " that can continue the model and kind), deadline (no slot before the run's deadline or queue timeout),"
            " queue_full (the model's queue was full).",
            ["outcome"],
            registry=self.registry,
        )
        self.migration_gap = Histogram(
            "iop_control_plane_migration_gap_seconds",
            "Time a continued run's requester waited: its last output before the node was lost to the first"
            " output of the node that continued it (loss detection included).",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30),
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "iop_control_plane_queue_wait_seconds",
            "Time runs waited in the admission queue, by how they left (admitted, deadline, caller_limit, cancelled).",
            ["outcome"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.queue_refused = Counter(
            "iop_control_plane_queue_refused_total",
            "Runs refused RESOURCE_EXHAUSTED without waiting, by reason (full, deadline).",
            ["reason"],
            registry=self.registry,
        )
        self.names_refused = Counter(
            "iop_control_plane_names_refused_total",
            "Runs refused INVALID_ARGUMENT for a name over 256 characters, by field (model, caller, run_id).",
            ["field"],
            registry=self.registry,
        )
        self.ledger_dropped = Counter(
            "iop_control_plane_ledger_dropped_total",
            "Runs not recorded in the ledger because its write backlog was full.",
            registry=self.registry,
        )
        self.cancelled_usage = Counter(
            "iop_control_plane_cancelled_usage_total",
            "Runs their requester cancelled after they were placed, by how the ledger got what they used: counted"
            " (the node's count, from its end of the run), uncounted (the node's end carried none: its connection"
            " closed), timeout (no end within ledger.cancel_usage_wait), skipped (ledger.cancel_usage_waits runs"
            " were waiting already), not_waited (the wait is 0), stopped (the control-plane stopped meanwhile);"
            " all but counted keep the control-plane's estimate, flagged estimated.",
            ["outcome"],
            registry=self.registry,
        )
        self.cancelled_usage_waiting = Gauge(
            "iop_control_plane_cancelled_usage_waiting",
            "Cancelled runs whose ledger entry waits for their node's count of what they used.",
            registry=self.registry,
        )
        self.overview_folded = Counter(
            "iop_control_plane_overview_folded_total",
            "Runs the overview summed under '(other)': their second already held 256 models.",
            registry=self.registry,
        )
        self.left_open_settled = Counter(
            "iop_control_plane_left_open_runs_total",
            "Runs left open by a control-plane that stopped, recorded interrupted, by what their node's record did:"
            " completed, failed, cancelled (recorded as the node recorded it), unknown (the node has no record of"
            " its end), no_answer, node_not_back (not registered within 300 s), not_kept (over 10,000 waiting),"
            " settled_before, store_failed.",
            ["outcome"],
            registry=self.registry,
        )
        self.join_attempts = Counter(
            "iop_control_plane_join_attempts_total",
            "join.request attempts, by outcome (accepted, token_invalid, token_expired, token_revoked, token_used_up,"
            " name_taken, bad_request, too_many_attempts).",
            ["outcome"],
            registry=self.registry,
        )
        self.registrations_refused = Counter(
            "iop_control_plane_registrations_refused_total",
            "node.register and cert.renew refused for the certificate presented, by reason"
            " (identity_mismatch, certificate_revoked).",
            ["reason"],
            registry=self.registry,
        )
        self.connections_refused = Counter(
            "iop_control_plane_connections_refused_total",
            "Connections refused at the preface by the control-plane's own checks, by reason (certificate_revoked).",
            ["reason"],
            registry=self.registry,
        )
        self.certificates_issued = Counter(
            "iop_control_plane_certificates_issued_total",
            "Node certificates signed, by how (join, renew).",
            ["how"],
            registry=self.registry,
        )
        self.prefix_decisions = Counter(
            "iop_control_plane_prefix_decisions_total",
            "Runs placed by the prefix policy, by model (those the policy file names; others: other) and reason (hit:"
            " the node held part of the prompt; imbalance: only a node loaded past the bound did; miss: none did).",
            ["model", "reason"],
            registry=self.registry,
        )
        self.prefix_matched = Histogram(
            "iop_control_plane_prefix_matched_bytes",
            "Bytes of the prompt the chosen node held (its longest known prefix), per prefix hit, by model.",
            ["model"],
            buckets=(256, 1024, 4096, 16384, 65536, 262144),
            registry=self.registry,
        )
        self.prefix_waits = Counter(
            "iop_control_plane_prefix_waits_total",
            "Queued runs that waited for the full node holding their prompt's prefix while another had room, by"
            " model (as iop_control_plane_prefix_decisions_total); counted once a run.",
            ["model"],
            registry=self.registry,
        )
        self.holds_bound = Counter(
            "iop_control_plane_queue_holds_bound_total",
            f"Picks from a model's queue that ended after passing over {HOLDS_PER_PASS} runs waiting for their prefix's"
            " node: the runs behind them waited for the next pick.",
            registry=self.registry,
        )
        self.registry.register(_NodesByState(nodes))

    def waits_for_prefix(self, decision: Decision, configured: Container[str]) -> None:
        """Count a queued run waiting for its prefix's node (once a run: the caller says when)."""
        self.prefix_waits.labels(decision.model if decision.model in configured else "other").inc()

    def placed_by_prefix(self, decision: Decision, configured: Container[str]) -> None:
        """Count a decision of the prefix policy (nothing for others); a model not in ``configured`` is "other"."""
        if decision.prefix is None:
            return
        model = decision.model if decision.model in configured else "other"
        self.prefix_decisions.labels(model, decision.prefix).inc()
        if decision.matched:
            self.prefix_matched.labels(model).observe(decision.matched)

    def watch_prefixes(self, index: PrefixIndex) -> None:
        """Serve the prefix index's size and evictions, read when scraped."""
        self.registry.register(_PrefixIndexState(index))

    def watch_queue(self, queue: AdmissionQueue[Any]) -> None:
        """Serve ``iop_control_plane_queue_depth{model}``, read from ``queue`` when scraped."""
        self.registry.register(_QueueDepth(queue))

    def watch_store(self, store: AuditStore) -> None:
        """Serve the audit store's backlog, its state and its dropped node writes, read when scraped."""
        self.registry.register(_StoreState(store))


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


class _QueueDepth(Collector):
    """``iop_control_plane_queue_depth{model}``: runs waiting per model (models that had waiters stay, at 0)."""

    def __init__(self, queue: AdmissionQueue[Any]) -> None:
        self._queue = queue
        self._seen: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        depths = self._queue.depths()
        self._seen.update(depths)
        family = GaugeMetricFamily(
            "iop_control_plane_queue_depth", "Runs waiting for a slot, by model.", labels=["model"]
        )
        for model in sorted(self._seen):
            family.add_metric([model], depths.get(model, 0))
        yield family


class _StoreState(Collector):
    """The audit store's write backlog: what waits, whether writes succeed, node writes dropped past the bound."""

    def __init__(self, store: AuditStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        store = self._store
        yield GaugeMetricFamily(
            "iop_control_plane_store_backlog",
            "Ledger and node-audit writes waiting to be written (bounded by the store's backlog).",
            value=store.waiting,
        )
        yield GaugeMetricFamily(
            "iop_control_plane_store_up",
            "1 while the state store takes writes; 0 while they fail (the database is away) and wait.",
            value=0 if store.failing else 1,
        )
        yield CounterMetricFamily(
            "iop_control_plane_audit_dropped",
            "Node-audit writes (registrations, state changes) dropped because the write backlog was full.",
            value=store.dropped_writes,
        )
        yield CounterMetricFamily(
            "iop_control_plane_store_sessions_lost",
            "Store operations that met sessions PostgreSQL had ended (a restart) and ran again on new ones.",
            value=store.state.sessions_lost,
        )


class _PrefixIndexState(Collector):
    """The prefix policy's memory: entries held, and entries dropped by each bound."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    def collect(self) -> Iterator[Metric]:
        index = self._index
        yield GaugeMetricFamily(
            "iop_control_plane_prefix_entries",
            "Prompt prefixes remembered for the nodes (bounded by prefix.max_entries).",
            value=len(index),
        )
        evicted = CounterMetricFamily(
            "iop_control_plane_prefix_evictions",
            "Prefixes forgotten to stay within a bound (node: prefix.entries_per_node; global: prefix.max_entries).",
            labels=["bound"],
        )
        for bound, count in index.evicted.items():
            evicted.add_metric([bound], count)
        yield evicted
