"""What the edge's routes share (:class:`Edge`), in a module of its own that imports no route:
the routes (app, files, batches) and the helpers they share (access) all name it, so kept in
app.py it tied them into an import cycle."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from iop_edge.admin import AdminLinks
from iop_edge.keys import KeyStore, Limiter
from iop_edge.metrics import EdgeMetrics
from iop_edge.settings import Settings
from iop_edge.shared import SharedLimits
from iop_edge.upstream import Pool, Upstream
from iop_edge.usage import UsageRecorder

__all__ = ["Edge"]


@dataclass
class Edge:
    """What the routes share: settings, the control-plane and worker pools, keys, limits, metrics."""

    settings: Settings
    upstream: Upstream
    metrics: EdgeMetrics
    worker: Pool | None = None
    """The worker's pool (files and batches); None: those endpoints answer 503."""
    keys: KeyStore | None = None
    limiter: Limiter = field(default_factory=Limiter)
    """The keys' limits kept by this edge alone (a key file)."""
    limits: SharedLimits | None = None
    """The keys' limits shared with the other edges of ``store.url``; None: ``limiter``."""
    usage: UsageRecorder | None = None
    """Where finished requests' usage goes; None: not recorded (``auth: none``)."""
    admin: AdminLinks | None = None
    """The console's connections with the admin certificate (``console.admin_cert``); made by ``build_app``."""
    started: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0
