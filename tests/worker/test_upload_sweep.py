"""The upload sweep deletes what a dead worker left half written, and never an upload under way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from iop_worker.files import Files
from iop_worker.store import CHUNK_SIZE, FileRecord, JobStore, new_file_id


async def _held(first: bytes, release: asyncio.Event, rest: bytes) -> AsyncIterator[bytes]:
    """An upload's body: ``first``, then (once ``release`` is set) ``rest``: a client mid-upload."""
    yield first
    await release.wait()
    yield rest


def _record(created_at: int) -> FileRecord:
    return FileRecord(new_file_id(), "in.jsonl", "batch", 0, created_at)


async def test_a_live_upload_survives_the_sweep_and_a_dead_workers_is_deleted(store: JobStore) -> None:
    release = asyncio.Event()
    live, stale = _record(int(time.time())), _record(int(time.time()) - 3 * 3600)  # the sweep's bound is 2 h
    first, rest = b"a" * CHUNK_SIZE, b"b" * 10
    live_upload = asyncio.create_task(store.put_file(live, _held(first, release, rest)))
    stale_upload = asyncio.create_task(store.put_file(stale, _held(first, asyncio.Event(), rest)))
    await asyncio.sleep(0.2)  # both have written their first chunk and wait for more
    assert not live_upload.done() and not stale_upload.done()
    assert await Files(store, max_bytes=1 << 30).sweep() == 1
    release.set()
    stored = await live_upload
    assert stored.bytes == len(first) + len(rest)
    assert b"".join([chunk async for chunk in store.read_file(live.id)]) == first + rest
    stale_upload.cancel()
    await asyncio.gather(stale_upload, return_exceptions=True)
    assert await store.get_file(stale.id) is None
