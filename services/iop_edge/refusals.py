"""A refusal by one of the edge's limits: counted in ``iop_edge_refused_total{limit}`` and logged,
at most once a second per limit, so a client refused in a loop costs one line a second, not one a request."""

from __future__ import annotations

import time

import structlog

from iop_edge.metrics import EdgeMetrics

__all__ = ["Refusals"]

_log = structlog.get_logger("iop.edge")
_LOG_EVERY = 1.0
"""Seconds between two log lines of one limit."""


class Refusals:
    """Counts and logs the refusals of each limit; the line says how many went unlogged since the last one."""

    def __init__(self, metrics: EdgeMetrics) -> None:
        self._metrics = metrics
        self._logged: dict[str, tuple[float, int]] = {}
        """limit -> (when its last line was logged, refusals since then not logged)."""

    def refused(self, limit: str, event: str, **fields: object) -> None:
        """Count one refusal by ``limit``; log ``event`` with ``fields`` unless a line of it left under a second ago."""
        self._metrics.refused.labels(limit).inc()
        now = time.monotonic()
        last, unlogged = self._logged.get(limit, (now - _LOG_EVERY, 0))
        if now - last < _LOG_EVERY:
            self._logged[limit] = (last, unlogged + 1)
            return
        self._logged[limit] = (now, 0)
        _log.warning(event, limit=limit, not_logged_since_last=unlogged, **fields)
