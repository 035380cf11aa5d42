"""Finishing a batch writes its output file as the store pages the lines out: bounded memory.

Before, every output line was gathered in a list first: a batch of 40 MB of results held 40 MB
(and 50,000 lines of 4 KB, 200 MB) in the worker at once.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

from iop_worker.metrics import WorkerMetrics
from iop_worker.sqlite_store import SqliteJobStore
from iop_worker.store import BatchRecord, BatchStatus, LineRecord, LineStatus, Usage, new_batch_id
from worker.test_engine_supervision import _engine

LINES, RESULT_BYTES = 10_000, 4_000
PEAK_MB = 12
"""The output file is 40 MB; writing it may hold a few 1 MiB chunks and a page of lines, not the file."""


async def test_the_output_file_is_written_in_bounded_memory(tmp_path: Path) -> None:
    store = SqliteJobStore(tmp_path / "jobs.sqlite3")
    await store.open()
    now = int(time.time())
    batch = BatchRecord(
        new_batch_id(), "/v1/chat/completions", "file-x", "24h", now, now + 3600, BatchStatus.IN_PROGRESS
    )
    await store.create_batch(batch, [LineRecord(batch.id, n, f"c-{n}", "{}") for n in range(LINES)])
    leased = await store.lease("w", limit=LINES, lease_seconds=600)
    result = json.dumps({"pad": "x" * RESULT_BYTES})
    await store.finish_many("w", [(batch.id, line.line, LineStatus.COMPLETED, result, Usage()) for line in leased])
    engine = _engine(store, WorkerMetrics())
    tracemalloc.start()
    try:
        await engine.step()  # every line ended: the step finalizes the batch
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    done = await store.get_batch(batch.id)
    assert done is not None and done.status is BatchStatus.COMPLETED and done.output_file_id is not None
    output = await store.get_file(done.output_file_id)
    assert output is not None and output.bytes == LINES * (len(result) + 1)
    assert peak < PEAK_MB * 1024 * 1024, f"finishing the batch peaked at {peak / 1e6:.0f} MB"
    await store.aclose()
