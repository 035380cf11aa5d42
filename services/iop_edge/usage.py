"""Each key's usage (requests, tokens) written to the key store in batches, never on a request's path.

A finished request adds to an in-memory row per (key, minute); :meth:`UsageRecorder.run` writes
the rows every ``interval`` seconds in one transaction. While the store is away the rows stay
and are written once it is back; past ``backlog`` rows, a request of a new (key, minute) is not
recorded: counted in ``dropped`` (``iop_edge_usage_dropped_total``) and logged at most once a
second. Rows merge per minute, so the backlog holds minutes of keys, not requests: 10,000 rows
are an hour's outage for 150 busy keys.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from iop_edge.key_storage import STORE_ERRORS, KeyStorage, UsageRow

__all__ = ["UsageRecorder"]

_log = structlog.get_logger("iop.edge.usage")


class UsageRecorder:
    """Usage of the keys through this edge, on its way to the store."""

    def __init__(self, storage: KeyStorage, edge: str, *, backlog: int = 10_000, interval: float = 0.5) -> None:
        self.storage = storage
        self.edge = edge
        self.backlog = backlog
        self.interval = interval
        self.dropped = 0
        """Requests not recorded because the backlog was full."""
        self.written = 0
        """Rows written."""
        self._rows: dict[tuple[str, int], list[int]] = {}
        self._logged = 0.0
        self._failing = False

    def __len__(self) -> int:
        """Rows waiting to be written."""
        return len(self._rows)

    def record(self, name: str, tokens: int, now: float | None = None) -> None:
        """One finished request of the key ``name`` and its prompt + completion tokens."""
        slot = (name, int((time.time() if now is None else now) // 60))
        row = self._rows.get(slot)
        if row is None:
            if len(self._rows) >= self.backlog:
                self._drop(name)
                return
            row = self._rows[slot] = [0, 0]
        row[0] += 1
        row[1] += max(tokens, 0)

    def _drop(self, name: str) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self._logged >= 1.0:
            self._logged = now
            _log.warning(
                "usage backlog full: request not recorded", key=name, backlog=self.backlog, dropped=self.dropped
            )

    async def flush(self) -> bool:
        """Write the rows waiting; whether it worked (else they stay for the next try)."""
        if not self._rows:
            return True
        rows, self._rows = self._rows, {}
        try:
            await self.storage.add_usage([UsageRow(n, m, r, t) for (n, m), (r, t) in rows.items()], self.edge)
        except STORE_ERRORS as exc:
            for slot, (requests, tokens) in rows.items():  # merged with what came meanwhile, bound kept loosely
                row = self._rows.setdefault(slot, [0, 0])
                row[0] += requests
                row[1] += tokens
            if not self._failing:
                _log.error("usage not written: the key store is away; kept to retry", error=str(exc), rows=len(rows))
            self._failing = True
            return False
        if self._failing:
            _log.info("usage written again", rows=len(rows))
        self._failing = False
        self.written += len(rows)
        return True

    async def run(self) -> None:
        """Write every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            await self.flush()
