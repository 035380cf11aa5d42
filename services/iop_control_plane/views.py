"""The registry's view of the nodes: each node's state and labels, and its load per model (plain data).

Kept apart from :mod:`iop_control_plane.registry` so that the pools the registry keeps
(:mod:`iop_control_plane.pool`) can read the views without importing the registry: the
registry imports the pools, never the other way round (an import-linter contract holds it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = ["ModelView", "NodeState", "NodeView"]


class NodeState(StrEnum):
    """Whether a node takes new runs."""

    READY = "ready"
    """Registered and heard from: takes runs."""
    UNAVAILABLE = "unavailable"
    """Its connection closed or it went silent: takes none."""
    DRAINING = "draining"
    """Finishing its runs, taking no new ones."""


@dataclass(eq=False, slots=True)
class ModelView:
    """One node's load for one model, as the scheduler sees it."""

    node: NodeView = field(repr=False)
    """The node."""
    model: str
    """Model name."""
    in_flight: int = 0
    """Runs executing, as last reported."""
    queued: int = 0
    """Runs waiting on the node, as last reported."""
    capacity: int = 1
    """Runs the node executes at once."""
    available: bool = True
    """False while the backend is down."""
    served: pb.ServedModel | None = None
    """The state of its server, as last reported, when the node runs it (a route with an engine)."""
    sent_since_report: int = 0
    """Runs this control-plane sent the node since its last report (less those finished since)."""
    placed: int = 0
    """Runs this control-plane sent the node that have not ended: a report never resets it."""

    @property
    def load(self) -> int:
        """Runs on the node: reported in flight and queued plus sent since, and never fewer than ours.

        A report the node sent before a run reached it restarts ``sent_since_report`` without
        counting that run; ``placed`` still does, so the node is not booked past its capacity.
        """
        return max(self.in_flight + self.queued + self.sent_since_report, self.placed)

    @property
    def free(self) -> bool:
        """Whether the node has a free slot for one more run."""
        return self.load < self.capacity


@dataclass(eq=False, slots=True)
class NodeView:
    """One node: state, labels, load per model."""

    node_id: str
    """Its id, unique in the cluster."""
    state: NodeState = NodeState.READY
    """Whether it takes runs."""
    labels: dict[str, str] = field(default_factory=dict)
    """Operator labels (zone, gpu type, ...) that label constraints match."""
    models: dict[str, ModelView] = field(default_factory=dict)
    """What it serves, by model name."""
    reason: str = "registered"
    """Why it is in its state."""
    continuable: dict[str, frozenset[int]] = field(default_factory=dict)
    """Run kinds (``pb.RunKind`` values) it can continue from delivered output, by model (its
    capabilities' ``continuable_kinds``); a model missing here continues none."""
    kinds: dict[str, frozenset[int]] = field(default_factory=dict)
    """Run kinds (``pb.RunKind`` values) it takes, by model (its capabilities' ``kinds``): a kind
    placed by it (:data:`~iop_control_plane.registry.RUNS`) goes only to a node listing it."""
    awaiting_first_output: int = 0
    """Interactive runs (priority >= 0) this control-plane sent the node that have not yet sent
    their first output: background runs are held back from the node while there are any."""
