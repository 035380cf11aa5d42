"""Runs left open by a control-plane that stopped, settled from their node's own record.

Recovery records such a run ``interrupted`` at once (:mod:`iop_control_plane.store`). But a run
that ended for its client just before its control-plane was killed (its ledger row still in the
writer's commit window) ran to its end on the node, which records every run in its own run
store. So each run recovered with a node is kept here, and that node, connected to this
control-plane now or once it registers, is asked (``runs.list`` naming the attempt's id on the
node) for its record: a record ``completed``, ``failed`` or ``cancelled`` replaces the
interrupted row (status, error, usage, finish reason; an UPDATE that only changes a row still
interrupted whose last attempt was on the node answering, so a node can only speak for its own
runs, and a second answer changes nothing). A node that does not answer within
:data:`ASK_TIMEOUT`, does not know the run, or is not back within :data:`KEEP_FOR` leaves it
interrupted.

Bounded: at most :data:`MAX_KEPT` runs wait (more are left interrupted, counted), each at most
:data:`KEEP_FOR` seconds; one question at a time per node.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import structlog
from prometheus_client import Counter

from iop_control_plane.ledger import SETTLED, LeftOpen
from iop_control_plane.nodes import NodeSessions
from iop_control_plane.state import StateStore
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import Connection, IopError

__all__ = ["ASK_TIMEOUT", "KEEP_FOR", "MAX_KEPT", "LeftOpenRuns"]

_log = structlog.get_logger("iop.control_plane")

MAX_KEPT = 10_000
"""Runs left open that may wait for their node's answer; beyond it they stay interrupted."""
KEEP_FOR = 300.0
"""Seconds a run left open waits for its node to register; then it stays interrupted."""
ASK_TIMEOUT = 5.0
"""Seconds a node has to answer for one run."""


class LeftOpenRuns:
    """Runs recorded interrupted, each waiting for its node's record (bounded in number and time)."""

    def __init__(self, state: StateStore, sessions: NodeSessions, outcomes: Counter | None = None) -> None:
        self._state, self._sessions, self._outcomes = state, sessions, outcomes
        self._waiting: dict[str, list[tuple[float, LeftOpen]]] = {}
        """Node id -> its runs left open, each with when it stops waiting (``time.monotonic()``)."""
        self._asking: dict[str, asyncio.Task[None]] = {}
        sessions.on_registered(self.ask)

    @property
    def kept(self) -> int:
        """Runs waiting for their node."""
        return sum(len(runs) for runs in self._waiting.values())

    def add(self, runs: Iterable[LeftOpen]) -> None:
        """Keep the runs recovered with a node, and ask the nodes connected now."""
        until = time.monotonic() + KEEP_FOR
        room, kept, refused = MAX_KEPT - self.kept, 0, 0
        for run in runs:
            if not run.node_id:
                continue  # never placed: no node knows it
            if kept >= room:
                refused += 1
                continue
            self._waiting.setdefault(run.node_id, []).append((until, run))
            kept += 1
        if kept:
            asyncio.get_running_loop().call_later(KEEP_FOR, self.expire)
        if refused:
            self._count("not_kept", refused)
            _log.warning("runs left open not kept for their node's record: too many", runs=refused, limit=MAX_KEPT)
        for node_id in list(self._waiting):
            self.ask(node_id)

    def ask(self, node_id: str) -> None:
        """Ask ``node_id`` for its runs left open, if it is connected and not being asked already."""
        if node_id not in self._waiting or node_id in self._asking or self._sessions.connection(node_id) is None:
            return
        task = asyncio.create_task(self._ask(node_id), name="iop-settle-left-open")
        self._asking[node_id] = task
        task.add_done_callback(lambda _: self._asking.pop(node_id, None))

    def expire(self) -> int:
        """Stop waiting for the runs whose time is up (they stay interrupted); how many."""
        now, expired = time.monotonic(), 0
        for node_id, runs in list(self._waiting.items()):
            if node_id in self._asking:
                continue  # its asker counts what expired on its way
            kept = [(until, run) for until, run in runs if until > now]
            expired += len(runs) - len(kept)
            if kept:
                runs[:] = kept
            else:
                del self._waiting[node_id]
        if expired:
            self._count("node_not_back", expired)
            _log.info("runs left open stay interrupted: their node did not come back in time", runs=expired)
        return expired

    async def aclose(self) -> None:
        """Stop asking."""
        for task in list(self._asking.values()):
            task.cancel()
        await asyncio.gather(*self._asking.values(), return_exceptions=True)

    async def _ask(self, node_id: str) -> None:
        runs = self._waiting.get(node_id, [])
        while runs:
            until, run = runs[0]
            connection = self._sessions.connection(node_id)
            if connection is None:
                return  # asked again when it registers
            self._count(await self._settle(connection, run) if until > time.monotonic() else "node_not_back")
            runs.pop(0)
        self._waiting.pop(node_id, None)

    async def _settle(self, connection: Connection, run: LeftOpen) -> str:
        """Ask the node for its record of ``run`` and put it in the ledger; the outcome, to count."""
        request = pb.Envelope(runs_list=pb.RunsList(run_id=run.node_run_id, limit=1))
        log = _log.bind(node_id=run.node_id, node_run_id=run.node_run_id)
        try:
            answer = await connection.request(request, timeout=ASK_TIMEOUT)
        except (IopError, TimeoutError, ConnectionError) as exc:
            log.info("run left open stays interrupted: its node did not answer", reason=str(exc) or type(exc).__name__)
            return "no_answer"
        found = [record for record in answer.runs_listed.runs if record.run_id == run.node_run_id]
        if not found or found[0].status not in SETTLED:
            log.info("run left open stays interrupted: its node has no record of its end")
            return "unknown"
        try:
            settled = await self._state.settle(run, found[0])
        except Exception as exc:  # noqa: BLE001 - the store's failure leaves the run interrupted, logged
            log.warning("run left open not settled: the store refused", reason=str(exc) or type(exc).__name__)
            return "store_failed"
        if not settled:
            return "settled_before"
        usage = found[0].usage
        log.info(
            "run left open recorded as its node recorded it",
            status=found[0].status,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
        )
        return found[0].status

    def _count(self, outcome: str, runs: int = 1) -> None:
        if self._outcomes is not None:
            self._outcomes.labels(outcome).inc(runs)
