"""A refusal by one of the edge's limits: counted in ``iop_edge_refused_total{limit}`` and logged,
at most once a second per limit, so a client refused in a loop costs one line a second, not one a request."""

from __future__ import annotations

import structlog

from iop_edge.metrics import EdgeMetrics
from iop_wire.logs import RateLimitedLog

__all__ = ["Refusals"]

_log = structlog.get_logger("iop.edge")


class Refusals:
    """Counts and logs the refusals of each limit; the line says how many went unlogged since the last one."""

    def __init__(self, metrics: EdgeMetrics) -> None:
        self._metrics = metrics
        self._logs = RateLimitedLog(every=1.0)

    def refused(self, limit: str, event: str, **fields: object) -> None:
        """Count one refusal by ``limit``; log ``event`` with ``fields`` unless a line of it left under a second ago."""
        self._metrics.refused.labels(limit).inc()
        self._logs.warning(limit, _log, event, limit=limit, **fields)
