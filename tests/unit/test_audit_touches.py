"""Nodes' last-seen times reach the audit store coalesced: never a commit of their own each."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

from conftest import assert_eventually

from iop_control_plane.store import AuditStore


def _last_seen(path: Path, node_id: str) -> float | None:
    with contextlib.closing(sqlite3.connect(path)) as db:
        row = db.execute("SELECT last_seen FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
    return None if row is None else float(row[0])


async def test_a_touch_waits_for_a_commit_and_rides_with_the_next_write(tmp_path: Path) -> None:
    path = tmp_path / "cp.db"
    store = AuditStore(path)
    await store.open()
    try:
        store.node_seen("node-a", labels={}, address="127.0.0.1:1", models=["m"])
        await assert_eventually(lambda: _last_seen(path, "node-a") is not None)
        seen = _last_seen(path, "node-a")
        store.touched("node-a")
        await asyncio.sleep(0.3)  # an absence takes waiting: 15 commit windows of 20 ms
        assert _last_seen(path, "node-a") == seen  # not a transaction for every node reporting
        store.state_changed("node-b", "ready", "registered")  # a write of its own: committed within 20 ms
        await assert_eventually(lambda: (_last_seen(path, "node-a") or 0) > (seen or 0), timeout=2)
    finally:
        await store.aclose()
