"""Runs their requester cancelled, held back from the ledger until their node says what they used.

A requester that cancels (an edge's client went away, or the requester's connection closed) is
answered at once, and the relay stops: its node's terminal event, which counts what the run used
(``Error.usage``: the prompt and the output it streamed), would come after. So the run's ledger
entry is handed here with the run's node stream (cancelled upstream already): a task waits up to
``wait`` seconds for the node's end (:meth:`iop_wire.RunStream.cancel_and_wait`) and takes its
usage into the entry (a complete's, if the run finished meanwhile) before it is recorded. Past
``wait`` (the node slow, frozen or gone) the entry keeps the control-plane's estimate, flagged
estimated, and a line is logged (at most once a second).

Bounded: at most ``limit`` entries wait at once (each holds its entry and its stream, which keeps
no output); past it a cancelled run is recorded at once with the estimate. Every outcome is
counted (``iop_control_plane_cancelled_usage_total``), the waits in progress gauged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from iop_control_plane.ledger import LedgerEntry
from iop_control_plane.metrics import ControlPlaneMetrics
from iop_wire import RunStream
from iop_wire.logs import RateLimitedLog

__all__ = ["CancelledRuns"]

_log = structlog.get_logger("iop.control_plane")


class CancelledRuns:
    """Ledger entries of cancelled runs waiting for their node's count of what they used."""

    def __init__(
        self,
        record: Callable[[LedgerEntry], None],
        metrics: ControlPlaneMetrics,
        *,
        wait: float = 2.0,
        limit: int = 1024,
    ) -> None:
        self._record = record
        self._metrics = metrics
        self.wait = wait
        """Seconds at most a cancelled run's entry waits for its node's terminal event (0: not at all)."""
        self.limit = limit
        """Entries that may wait at once."""
        self._waiting: set[asyncio.Task[None]] = set()
        self._logs = RateLimitedLog(every=1.0)

    @property
    def waiting(self) -> int:
        """Entries waiting now."""
        return len(self._waiting)

    def hold(self, entry: LedgerEntry, stream: RunStream) -> None:
        """Record ``entry`` (ended cancelled, with the estimate) once ``stream``'s node says what the run used,
        or at once when waits are off or ``limit`` entries already wait."""
        if self.wait <= 0:
            self._recorded(entry, "not_waited")
            return
        if len(self._waiting) >= self.limit:
            self._logs.warning(
                "limit",
                _log,
                "cancelled run recorded with the estimate",
                run_id=entry.run_id,
                reason="too many waits",
                limit=self.limit,
            )
            self._recorded(entry, "skipped")
            return
        task = asyncio.get_running_loop().create_task(self._settle(entry, stream), name=f"iop-cancelled-{entry.run_id}")
        self._waiting.add(task)
        self._metrics.cancelled_usage_waiting.inc()
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._waiting.discard(task)
        self._metrics.cancelled_usage_waiting.dec()

    async def _settle(self, entry: LedgerEntry, stream: RunStream) -> None:
        outcome = "stopped"  # the control-plane stopped while it waited
        try:
            event = await stream.cancel_and_wait(self.wait, entry.error_message)
            if event is None:
                outcome = "timeout"
                self._logs.warning(
                    "timeout",
                    _log,
                    "cancelled run recorded with the estimate",
                    run_id=entry.run_id,
                    node_id=entry.attempts[-1].node_id,
                    reason=f"its node did not end it within {self.wait} s",
                )
            else:
                outcome = "counted" if entry.counted(event) else "uncounted"
        finally:
            self._recorded(entry, outcome)

    def _recorded(self, entry: LedgerEntry, outcome: str) -> None:
        self._metrics.cancelled_usage.labels(outcome).inc()
        self._record(entry)

    async def aclose(self) -> None:
        """Stop waiting: every entry still waiting is recorded with the estimate."""
        waiting = list(self._waiting)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
