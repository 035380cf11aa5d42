"""A served model's state in words (a model whose server the node runs: a route with an ``engine``).

``iop nodes ls``, ``iop models`` and ``iop status`` show each one as the node last reported it
(``pb.ServedModel`` in the control-plane's ``nodes.listed``): the engine, the state (starting,
ready, restarting, failed, stopping), how long it has been up (from ``since``, when ready), its
pid and port, its restarts, and why it is not ready. ``iop up`` waits with ``ServedWait`` until
each is ready or failed. Protobuf types only: ``iop nodes ls`` imports this, and starts fast.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = ["SERVED_STATES", "ServedWait", "served_dict", "served_state", "served_text", "span"]

SERVED_STATES = {
    pb.SERVED_STATE_STARTING: "starting",
    pb.SERVED_STATE_READY: "ready",
    pb.SERVED_STATE_RESTARTING: "restarting",
    pb.SERVED_STATE_FAILED: "failed",
    pb.SERVED_STATE_STOPPING: "stopping",
}
_REASON_CHARS = 200  # a table cell: the reason on one line, its middle cut; --json has all of it


def served_state(served: pb.ServedModel) -> str:
    """``ready``, ``starting``, ...; ``unspecified`` for a state this command does not know."""
    return SERVED_STATES.get(served.state, "unspecified")


def served_text(served: pb.ServedModel, now: float, *, whole_reason: bool = False) -> str:
    """``llama.cpp: ready, up 3m, pid 1234, port 40123, 1 restart``; ``llama.cpp: failed: REASON``.

    The reason on one line (its middle cut when long), unless ``whole_reason``."""
    state = served_state(served)
    facts = [f"{served.engine}: {state}"]
    if served.state == pb.SERVED_STATE_READY and served.HasField("since"):
        facts.append(f"up {span(now - _seconds(served))}")
    if served.pid:
        facts.append(f"pid {served.pid}")
    if served.port:
        facts.append(f"port {served.port}")
    if served.restarts:
        facts.append(f"{served.restarts} restart{'s' if served.restarts != 1 else ''}")
    if served.failed_starts and served.state != pb.SERVED_STATE_READY:
        facts.append(f"{served.failed_starts} failed start{'s' if served.failed_starts != 1 else ''}")
    text = ", ".join(facts)
    if served.reason and served.state != pb.SERVED_STATE_READY:
        text += f": {served.reason.strip() if whole_reason else _one_line(served.reason)}"
    return text


def served_dict(served: pb.ServedModel, now: float) -> dict[str, Any]:
    """The fields ``--json`` shows: state, reason, restarts, uptime (seconds, when ready), pid, port."""
    since = _seconds(served) if served.HasField("since") else None
    ready = served.state == pb.SERVED_STATE_READY
    return {
        "engine": served.engine,
        "state": served_state(served),
        "reason": served.reason,
        "restarts": served.restarts,
        "failed_starts": served.failed_starts,
        "since": since,
        "uptime_s": round(max(0.0, now - since), 1) if ready and since is not None else None,
        "pid": served.pid or None,
        "port": served.port or None,
    }


def span(seconds: float) -> str:
    """``45s``, ``3m``, ``2h5m``, ``3d4h``: an uptime at a glance."""
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60}m"
    return f"{whole // 86400}d{whole % 86400 // 3600}h"


class ServedWait:
    """``iop up`` waiting for the served models ``models`` of node ``node_id`` to be ready or failed.

    ``listed`` asks the control-plane for ``nodes.listed`` (raises when it cannot be asked: tried
    again); ``report`` gets each model's line once it is ready or failed; ``began`` (monotonic
    seconds, default now): when the platform started, the times reported count from it."""

    def __init__(
        self,
        listed: Callable[[], pb.NodesListed],
        node_id: str,
        models: Iterable[str],
        report: Callable[[str], None] = print,
        began: float | None = None,
    ) -> None:
        self.listed, self.node_id, self.report = listed, node_id, report
        self.began = time.monotonic() if began is None else began
        self.waiting = list(models)
        self.last: dict[str, pb.ServedModel] = {}
        self.failed: list[str] = []

    def wait(self, timeout: float, interval: float = 0.25) -> bool:
        """True once every model is ready; False when one failed or ``timeout`` passed (``pending`` says how)."""
        started = time.monotonic()
        while self.waiting and time.monotonic() - started < timeout:
            self._look(time.monotonic() - self.began)
            if self.waiting:
                time.sleep(interval)
        return not self.waiting and not self.failed

    def pending(self) -> list[str]:
        """One line per model neither ready nor failed: the state it was last seen in."""
        now = time.time()
        return [
            f"model {model}: still {served_text(self.last[model], now)}"
            if model in self.last
            else f"model {model}: not reported by the node yet"
            for model in self.waiting
        ]

    def _look(self, elapsed: float) -> None:
        try:
            nodes = self.listed().nodes
        except Exception:  # noqa: BLE001 - asked again at the next look; pending() says what was last seen
            return
        loads = {load.model: load for node in nodes if node.node_id == self.node_id for load in node.models}
        for model in list(self.waiting):
            load = loads.get(model)
            if load is None or not load.HasField("served"):
                continue
            served = self.last[model] = load.served
            if served.state == pb.SERVED_STATE_READY:
                self.report(f"model {model}: ready ({_facts(served)}) in {elapsed:.1f} s")
            elif served.state == pb.SERVED_STATE_FAILED:
                self.report(f"model {model}: {served_text(served, time.time(), whole_reason=True)}")
                self.failed.append(model)
            else:
                continue
            self.waiting.remove(model)


def _facts(served: pb.ServedModel) -> str:
    return ", ".join([served.engine, *([f"pid {served.pid}"] if served.pid else []), f"port {served.port}"])


def _seconds(served: pb.ServedModel) -> float:
    return served.since.seconds + served.since.nanos / 1e9


def _one_line(reason: str) -> str:
    """The reason on one line for a table cell: its start (what happened) and its end (the server's
    last words, where the cause usually is), the middle cut when it is long."""
    line = " ".join(reason.split())
    if len(line) <= _REASON_CHARS:
        return line
    head = _REASON_CHARS * 2 // 5
    return f"{line[:head]} ... {line[head + 5 - _REASON_CHARS :]}"
