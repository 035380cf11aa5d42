"""Following what other control-planes sharing the store change: the policy in force, drained
nodes, and revoked certificates (``nodes.remove`` there).

Every ``store.poll_interval`` seconds one query reads the change counters; only a kind whose
counter moved is read again. What is followed lives in memory, where runs, registrations and
TLS handshakes read it: while the database is away nothing that is in force changes, and the
poll logs once and tries again.
"""

from __future__ import annotations

import asyncio

import structlog

from iop_control_plane.admin import Operations
from iop_control_plane.identity import IdentityStore
from iop_control_plane.nodes import NodeSessions
from iop_control_plane.state import StateStore

__all__ = ["Replicas"]

_log = structlog.get_logger("iop.control_plane")


class Replicas:
    """The poll loop (:meth:`run`) and what one poll does (:meth:`poll`)."""

    def __init__(
        self,
        state: StateStore,
        *,
        operations: Operations,
        sessions: NodeSessions,
        identity: IdentityStore,
        interval: float,
    ) -> None:
        self.state, self.operations, self.sessions, self.identity = state, operations, sessions, identity
        self.interval = interval
        self.seen: dict[str, int] = {}
        """Change kind -> the counter last followed."""
        self._failing = False

    async def start(self) -> None:
        """Take the counters as they are (what they count was read at start)."""
        self.seen = await self.state.changes()

    async def run(self) -> None:
        """Poll until cancelled; a failed poll is logged (once until one succeeds) and retried."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll()
            except Exception as exc:  # noqa: BLE001 - a background loop logs and continues
                if not self._failing:
                    _log.warning(
                        "state store poll failed; what is in force stays", reason=str(exc) or type(exc).__name__
                    )
                self._failing = True
            else:
                if self._failing:
                    _log.info("state store poll resumed")
                self._failing = False

    async def poll(self) -> None:
        """Read the counters; follow each kind that moved."""
        changes = await self.state.changes()
        moved = {kind for kind, serial in changes.items() if self.seen.get(kind) != serial}
        if "policy" in moved and (newest := await self.state.newest_policy()) is not None:
            self.operations.follow(newest)
        if "drains" in moved:
            self.sessions.follow_drains(await self.state.drains())
        if "revocations" in moved and (new := self.identity.follow(await self.state.revoked())):
            await self.sessions.revoked(new)
        self.seen = changes
