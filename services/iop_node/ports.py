"""The node's ports: small Protocols its core depends on. Adapters and stores conform; none inherit.

Lifecycle is part of each port: the composition root (``bootstrap.NodeApp``) opens a store, starts
adapters (``start``), and closes stores and adapters (``aclose``) once, in reverse order of opening.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Protocol

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.domain import ExecutionSpec, RunRecord, RunStatus

__all__ = ["Adapter", "EventSink", "RunStore"]


class EventSink(Protocol):
    """Where an adapter writes a run's output. The core has already sent ``start``.

    An adapter calls ``delta`` for each piece of text (the per-token fast path) or ``output``
    for richer output (tool-call fragments, logprobs, embeddings, with or without text), then
    ``complete`` once; or it raises ``IopError`` (the core sends the error event). Usage it
    does not pass is counted on the node.
    """

    async def delta(self, text: str) -> None:
        """New text."""
        ...

    async def output(self, delta: pb.RunDelta) -> None:
        """New output of any kind."""
        ...

    async def complete(
        self,
        finish_reason: pb.FinishReason.ValueType,
        usage: pb.Usage | None = None,
        timings: pb.Timings | None = None,
    ) -> None:
        """The run finished; ``usage`` and ``timings`` where the backend reported them."""
        ...

    async def counted(self, tokens: int) -> None:
        """A RUN_KIND_COUNT_TOKENS run finished: the prompt is ``tokens`` tokens (its usage stays zero)."""
        ...

    def annotate(self, key: str, value: str) -> None:
        """Keep ``value`` in the run record (``stderr_tail``, or any other key in ``extra``)."""
        ...

    def counting(self, prompt_tokens: int, *, token_per_delta: bool = False) -> None:
        """The backend's exact count of the prompt's tokens, known before its output (the mock's; a backend
        that reports it early); ``token_per_delta``: each ``delta`` is one token (the mock's). Then a run
        that ends without ``complete`` (cancelled, failed) is counted exactly, not estimated."""
        ...


class Adapter(Protocol):
    """Executes runs against one kind of backend."""

    name: str

    async def capabilities(self) -> list[pb.ModelInfo]:
        """The models this adapter can serve now (``available`` false while its backend is down)."""
        ...

    def available(self, model: str) -> bool:
        """Whether ``model``'s backend is up, as last seen (no I/O: node.status asks often)."""
        ...

    def served(self, model: str) -> pb.ServedModel | None:
        """The state of the server the node runs for ``model`` (a route with an engine); None for a
        backend someone else runs. No I/O: node.status asks often."""
        ...

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> None:
        """Run ``spec``, writing output to ``sink``; cancelled (CancelledError) when the run is."""
        ...

    async def start(self) -> None:
        """Start what the adapter runs (an engine's server), without waiting for it to be ready;
        called once, before the first run."""
        ...

    async def aclose(self) -> None:
        """Release what the adapter holds (connection pools, probes, the servers it started); called
        once, after the last run."""
        ...


class RunStore(Protocol):
    """The run history."""

    async def open(self) -> int:
        """Make it ready for writes; returns how many runs an earlier stop left running (now interrupted)."""
        ...

    async def aclose(self) -> None:
        """Write everything recorded so far and release the store; called once, at stop."""
        ...

    async def record_start(self, record: RunRecord) -> None:
        """Write the row of a run that was received (status running)."""
        ...

    async def record_end(self, record: RunRecord) -> None:
        """Complete the row with the run's outcome."""
        ...

    async def get(self, run_id: str) -> RunRecord | None:
        """One run by id."""
        ...

    async def list(
        self,
        *,
        status: RunStatus | None = None,
        model: str | None = None,
        since: datetime.datetime | None = None,
        limit: int = 100,
    ) -> Sequence[RunRecord]:
        """Runs, newest first, filtered."""
        ...
