"""Each key's usage (requests, tokens) written to the key store in batches, never on a request's path.

A finished request adds to an in-memory row per (key, minute); :meth:`UsageRecorder.run` writes
the rows every ``interval`` seconds in one transaction. While the store is away the rows stay
and are written once it is back; past ``backlog`` rows, a request of a new (key, minute) is not
recorded: counted in ``dropped`` (``iop_edge_usage_dropped_total``) and logged at most once a
second. Rows merge per minute, so the backlog holds minutes of keys, not requests: 10,000 rows
are an hour's outage for 150 busy keys.

Each batch has an id. A batch whose write failed is sent again alone, under its id, never merged
with rows recorded since: its write may have committed unseen (the reply lost as the database
stopped), and the store then finds it written (``key_usage_writes``) instead of adding it twice.
"""

from __future__ import annotations

import asyncio
import secrets
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
        self._unsent: tuple[str, dict[tuple[str, int], list[int]]] | None = None
        """A batch whose write failed, with its id: sent again as it was."""
        self._logged = 0.0
        self._failing = False

    def __len__(self) -> int:
        """Rows waiting to be written."""
        return len(self._rows) + (0 if self._unsent is None else len(self._unsent[1]))

    def record(self, name: str, tokens: int, now: float | None = None) -> None:
        """One finished request of the key ``name`` and its prompt + completion tokens."""
        slot = (name, int((time.time() if now is None else now) // 60))
        row = self._rows.get(slot)
        if row is None:
            if len(self) >= self.backlog:
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
        """Write the batch that failed, if any, then the rows waiting; whether all were written
        (what was not stays for the next try)."""
        if self._unsent is not None and not await self._send(*self._unsent):
            return False
        if not self._rows:
            return True
        self._unsent, self._rows = (secrets.token_hex(8), self._rows), {}
        return await self._send(*self._unsent)

    async def _send(self, batch: str, rows: dict[tuple[str, int], list[int]]) -> bool:
        try:
            await self.storage.add_usage([UsageRow(n, m, r, t) for (n, m), (r, t) in rows.items()], self.edge, batch)
        except STORE_ERRORS as exc:
            if not self._failing:
                _log.error("usage not written: the key store is away; kept to retry", error=str(exc), rows=len(rows))
            self._failing = True
            return False
        self._unsent = None
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
