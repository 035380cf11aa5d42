"""The gap a client sees when its stream's node is lost and the run continues on another (issue 22, item 6).

The scenario of ``tests/e2e/test_migration.py``, as processes (``iop control-plane``, three ``iop
node`` with the mock adapter, ``iop edge``), with the heartbeat settings at their defaults: 32
streams of 60 tokens at 20 a second, read at the wire level; once each has 10 deltas, the node
serving the most of them is killed (SIGKILL) or, in the other trials, frozen (SIGSTOP): one kind
of fault per trial, so each cut run is continued once. For each run the fault cut, the gap is
from the last delta of the lost attempt to the first of its continuation (the mock's usage says
which deltas those are); it includes the detection, timed apart: from the signal to the
control-plane listing the node unavailable (``nodes.list`` asked every 5 ms). ``TRIALS`` runs per
kind, each on a fresh platform. Prints a table; asserts nothing.
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the e2e platform and its scenario
from e2e.conftest import running_stack
from e2e.migration_helpers import (
    CONTINUED_ROUTES,
    NODES,
    STREAMS,
    Fault,
    attempts_on,
    control_plane_metric,
    cut_streams,
    requests,
)
from table import print_table

from iop_control_plane.settings import Settings as ControlPlaneSettings
from iop_node.settings import Settings as NodeSettings

TRIALS = 2
"""Runs of the scenario per kind of fault, each on a fresh platform."""
KINDS = {"kill -9": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP}
NODE_DEFAULTS = {"heartbeat_interval": NodeSettings.model_fields["heartbeat_interval"].default}
"""Each node beats at its default interval, so a frozen one is out after the default window (3 of them)."""
CP_SETTINGS = {
    "heartbeat_interval": ControlPlaneSettings.model_fields["heartbeat_interval"].default,
    "metrics": {"port": 0},
}
"""The control-plane's default heartbeat, and its /metrics on, for its own count of the gaps."""
GAP_METRIC = "iop_control_plane_migration_gap_seconds"


@dataclass
class Trial:
    """What one run of the scenario measured."""

    gaps: list[float]
    """Of the runs the fault cut, as their requester saw them."""
    fault: Fault
    not_completed: int
    """Of the 32 runs."""
    measured_sum: float
    """The control-plane's own ``GAP_METRIC``: the sum of the gaps it measured, and how many."""
    measured: int


def _trial(root: Path, label: str, sent: signal.Signals) -> Trial:
    nodes = dict.fromkeys(NODES, CONTINUED_ROUTES)
    with running_stack(root, nodes, control_plane=CP_SETTINGS, node_settings=NODE_DEFAULTS) as stack:
        received, (fault,) = asyncio.run(cut_streams(stack, requests(label), (sent,)))
        cut = attempts_on(stack, fault.node_id)
        measured_sum = control_plane_metric(stack, f"{GAP_METRIC}_sum")
        measured = int(control_plane_metric(stack, f"{GAP_METRIC}_count"))
    gaps = [run.gap_at_migration() for run in received if run.request.run_id in cut]
    failed = sum(not run.end.HasField("complete") for run in received)
    return Trial([gap for gap in gaps if gap is not None], fault, failed, measured_sum, measured)


def _p50_p95(values: list[float]) -> str:
    if not values:
        return "none continued"
    p95 = statistics.quantiles(values, n=20, method="inclusive")[18] if len(values) > 1 else values[0]
    return f"{statistics.median(values) * 1000:,.0f} / {p95 * 1000:,.0f} ms (n={len(values)})"


def _median_max(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:,.0f} / {max(values) * 1000:,.0f} ms" if values else "not seen"


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, sent in KINDS.items():
            labels = [f"{sent.name.lower()}{number}" for number in range(TRIALS)]
            trials = [_trial(Path(tmp) / label, label, sent) for label in labels]
            gaps = [gap for trial in trials for gap in trial.gaps]
            detections = [trial.fault.detection for trial in trials if trial.fault.detection is not None]
            failed = sum(trial.not_completed for trial in trials)
            measured = sum(trial.measured for trial in trials)
            own_mean = sum(trial.measured_sum for trial in trials) / measured if measured else 0.0
            heartbeat = f" (node heartbeat {NODE_DEFAULTS['heartbeat_interval']:g} s)" if sent == signal.SIGSTOP else ""
            rows += [
                (f"{kind}{heartbeat}: gap at a migration, p50 / p95 ({TRIALS} x {STREAMS} streams)", _p50_p95(gaps)),
                (f"{kind}: detection included (signal -> node unavailable), median / max", _median_max(detections)),
                (
                    f"{kind}: mean gap as the client saw it / as the control-plane measured it ({GAP_METRIC})",
                    f"{statistics.fmean(gaps) * 1000 if gaps else 0:,.0f} / {own_mean * 1000:,.0f} ms (n={measured})",
                ),
                (f"{kind}: streams that did not complete, of {TRIALS * STREAMS}", str(failed)),
            ]
    print_table(rows)


if __name__ == "__main__":
    main()
