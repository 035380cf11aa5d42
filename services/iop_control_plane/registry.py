"""The registry's live view: which nodes there are, their state, and each one's load per model.

Plain values in, no protobuf: the service turns ``node.register`` and ``node.status`` into
:class:`ModelLoad` and :class:`Status` (a thin adapter) and calls the methods here. Every change
keeps the model's :class:`~iop_control_plane.pool.ModelPool` current, so a decision reads
ready-made indexes.

Each model has a pool of candidates, and one more for each set of labels decisions ask for
(made on first use; the most recently used ``label_pools`` are kept), so a decision with label
constraints never skips nodes without them. A run that continues delivered output asks for the
pseudo-label ``(CONTINUES, kind)`` (:func:`continuing`): the nodes whose model can continue that
kind of run (``NodeView.continuable``), kept as a pool the same way. A run of a kind not every
backend takes (counting tokens) asks for ``(CONTINUES, "runs <kind>")`` (:func:`running`): the
nodes whose model lists that kind (``NodeView.kinds``).

A node's load for a model, as the scheduler sees it, is what the node last reported (in flight
plus queued) plus the runs this control-plane sent it since (``sent_since_report``); a run that
finishes takes one off, from the runs sent since the report first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from iop_control_plane.pool import ModelPool
from iop_control_plane.views import ModelView, NodeState, NodeView

if TYPE_CHECKING:
    from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = [
    "CONTINUES",
    "RUNS",
    "Labels",
    "ModelLoad",
    "ModelView",
    "NodeState",
    "NodeView",
    "Registry",
    "Status",
    "continuing",
    "running",
]

Labels = tuple[tuple[str, str], ...]
"""Label constraints as sorted (name, value) pairs: a node must carry all of them."""
CONTINUES = ""
"""The name of the pseudo-label that asks for nodes able to continue a kind of run (no label is named ""
in a policy: names have a character at least; sorted, it comes first)."""


RUNS = "runs "
"""The start of the pseudo-label's value that asks for nodes taking a kind of run (``runs 5``); a value
without it asks for nodes continuing one."""


def continuing(kind: int, labels: Labels) -> Labels:
    """``labels`` and the pseudo-label of nodes that can continue runs of ``kind`` (a ``pb.RunKind`` value)."""
    return ((CONTINUES, str(kind)), *labels)


def running(kind: int, labels: Labels) -> Labels:
    """``labels`` and the pseudo-label of nodes whose model takes runs of ``kind`` (a ``pb.RunKind`` value)."""
    return ((CONTINUES, f"{RUNS}{kind}"), *labels)


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """A node's report for one model (``pb.ModelLoad``)."""

    model: str
    """Model name."""
    in_flight: int = 0
    """Runs executing now."""
    queued: int = 0
    """Runs waiting for a slot on the node."""
    capacity: int = 1
    """Runs the node executes at once; below 1 the node is no candidate for the model."""
    available: bool = True
    """False while the backend serving it is down."""
    served: pb.ServedModel | None = None
    """The state of its server, when the node runs it (a route with an engine); shown by nodes.list."""


@dataclass(frozen=True, slots=True)
class Status:
    """A node's status report (``pb.NodeStatus``): every model it serves, with its load."""

    node_id: str
    """The reporting node."""
    models: tuple[ModelLoad, ...]
    """Load per model; a model missing here is no longer served."""
    draining: bool = False
    """True once the node stopped taking runs."""


class Registry:
    """Every registered node, and per model the pool of candidates."""

    def __init__(self, *, vnodes: int = 100, label_pools: int = 16) -> None:
        self.nodes: dict[str, NodeView] = {}
        """Registered nodes by id, in any state."""
        self._serving: dict[str, set[str]] = {}
        self._pools: dict[str, dict[Labels, ModelPool]] = {}
        self._vnodes, self._label_pools = vnodes, label_pools
        self._listeners: list[Callable[[], None]] = []
        self._leave_listeners: list[Callable[[str], None]] = []

    def on_more_room(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever a node may have room for more runs (registered, reported, made ready)."""
        self._listeners.append(listener)

    def on_leave(self, listener: Callable[[str], None]) -> None:
        """Call ``listener`` with a node's id when it leaves: removed, or marked unavailable (its connection closed)."""
        self._leave_listeners.append(listener)

    def _left(self, node_id: str) -> None:
        for listener in self._leave_listeners:
            listener(node_id)

    def _more_room(self) -> None:
        for listener in self._listeners:
            listener()

    def register(
        self,
        node_id: str,
        models: Iterable[ModelLoad],
        *,
        labels: Mapping[str, str] | None = None,
        continuable: Mapping[str, frozenset[int]] | None = None,
        kinds: Mapping[str, frozenset[int]] | None = None,
    ) -> NodeView:
        """Add a ready node; one registered under the same id before is replaced. ``continuable``: the
        run kinds each model can continue (``NodeView.continuable``); ``kinds``: those it takes."""
        self.remove(node_id)
        node = self.nodes[node_id] = NodeView(
            node_id, labels=dict(labels or {}), continuable=dict(continuable or {}), kinds=dict(kinds or {})
        )
        self._set_loads(node, models)
        self._more_room()
        return node

    def remove(self, node_id: str) -> None:
        """Forget a node (nothing if it is not registered)."""
        node = self.nodes.pop(node_id, None)
        for model in node.models if node else ():
            self._drop(node_id, model)
        if node is not None:
            self._left(node_id)

    def report(self, status: Status) -> None:
        """Take a node's status report: its loads replace the last ones; ``sent_since_report`` restarts."""
        node = self.nodes[status.node_id]
        self._set_loads(node, status.models)
        if status.draining and node.state is NodeState.READY:
            self.mark(node.node_id, NodeState.DRAINING, "the node reports draining")
        self._more_room()

    def mark(self, node_id: str, state: NodeState, reason: str) -> None:
        """Put a node in ``state``, saying why."""
        node = self.nodes[node_id]
        node.state, node.reason = state, reason
        for view in node.models.values():
            self._refresh(view)
        if state is NodeState.READY:
            self._more_room()
        elif state is NodeState.UNAVAILABLE:
            self._left(node_id)

    def set_capabilities(
        self, node_id: str, continuable: Mapping[str, frozenset[int]], kinds: Mapping[str, frozenset[int]]
    ) -> None:
        """The node's capabilities changed (its routes were reloaded): the run kinds each model can
        continue, and those it takes."""
        node = self.nodes[node_id]
        node.continuable, node.kinds = dict(continuable), dict(kinds)
        for view in node.models.values():
            self._refresh(view)
        self._more_room()

    def sent(self, node_id: str, model: str) -> None:
        """A run of ``model`` was sent to the node."""
        view = self.nodes[node_id].models[model]
        view.sent_since_report += 1
        view.placed += 1
        self._refresh(view)

    def finished(self, node_id: str, model: str) -> None:
        """A run sent to the node ended, whatever its outcome (nothing if node or model is gone)."""
        node = self.nodes.get(node_id)
        view = node.models.get(model) if node else None
        if view is None:
            return
        view.placed = max(0, view.placed - 1)
        if view.sent_since_report:
            view.sent_since_report -= 1
        elif view.queued:
            view.queued -= 1  # one of the queued runs takes the slot
        elif view.in_flight:
            view.in_flight -= 1
        self._refresh(view)

    def pool(self, model: str, labels: Labels = ()) -> ModelPool | None:
        """The candidates for ``model`` that carry ``labels``; None when no registered node serves it.

        A pool for labels is made on first use (a pass over the model's candidates) and kept
        current from then on, while it is among the ``label_pools`` most recently used.
        """
        pools = self._pools.get(model)
        if pools is None or not labels:
            return pools[()] if pools else None
        pool = pools.pop(labels, None)
        if pool is None:
            pool = ModelPool(within=pools[()])
            for view in pools[()].views.values():
                if _fits(view, labels):
                    pool.update(view)
            if len(pools) > self._label_pools:
                del pools[next(key for key in pools if key)]  # the least recently used
        pools[labels] = pool  # last: the most recently used
        return pool

    def serving(self, model: str) -> int:
        """How many registered nodes serve ``model``, in any state."""
        return len(self._serving.get(model, ()))

    def taking(self, model: str, kind: int) -> int:
        """How many registered nodes serve ``model`` and list runs of ``kind`` for it, in any state."""
        return sum(kind in self.nodes[node_id].kinds.get(model, ()) for node_id in self._serving.get(model, ()))

    def _set_loads(self, node: NodeView, loads: Iterable[ModelLoad]) -> None:
        reported = {load.model: load for load in loads}
        for model in [model for model in node.models if model not in reported]:
            self._drop(node.node_id, model)
            del node.models[model]
        for model, load in reported.items():
            view = node.models.get(model)
            if view is None:
                view = node.models[model] = ModelView(node, model)
                self._serving.setdefault(model, set()).add(node.node_id)
                if model not in self._pools:
                    self._pools[model] = {(): ModelPool(self._vnodes)}
            view.in_flight, view.queued, view.capacity = load.in_flight, load.queued, load.capacity
            view.available, view.sent_since_report, view.served = load.available, 0, load.served
            self._refresh(view)

    def _refresh(self, view: ModelView) -> None:
        """Keep the model's pools current: the node is a candidate, with this load, or not."""
        candidate = view.node.state is NodeState.READY and view.available and view.capacity >= 1
        for labels, pool in self._pools[view.model].items():
            if candidate and (not labels or _fits(view, labels)):
                pool.update(view)
            else:
                pool.discard(view.node.node_id)

    def _drop(self, node_id: str, model: str) -> None:
        for pool in self._pools[model].values():
            pool.discard(node_id)
        serving = self._serving[model]
        serving.discard(node_id)
        if not serving:
            del self._serving[model], self._pools[model]


def _fits(view: ModelView, labels: Labels) -> bool:
    """Whether the view's node carries ``labels`` (and, asked ``CONTINUES``, can continue or takes that
    kind of run)."""
    node = view.node
    for name, value in labels:
        if name == CONTINUES:
            if value.startswith(RUNS):
                if int(value.removeprefix(RUNS)) not in node.kinds.get(view.model, ()):
                    return False
            elif int(value) not in node.continuable.get(view.model, ()):
                return False
        elif node.labels.get(name) != value:
            return False
    return True
