"""The job store suite, run against both stores (SQLite and PostgreSQL): same interface, same behaviour."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import asyncpg
import pytest

from iop_worker.pg_store import PgJobStore
from iop_worker.sqlite_store import SqliteJobStore
from iop_worker.store import (
    CHUNK_SIZE,
    BatchRecord,
    BatchStatus,
    FileRecord,
    JobStore,
    LineRecord,
    LineStatus,
    RequestCounts,
    Usage,
    new_batch_id,
    new_file_id,
)
from worker.conftest import StoreFactory

T = TypeVar("T")
SHORT = 0.05  # seconds: a lease meant to lapse during the test
LONG = 60.0  # seconds: a lease meant to hold for the whole test


async def eventually(probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], timeout: float = 5.0) -> T:
    """Call ``probe`` until ``done`` holds for its result; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = await probe()
        if done(result):
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s; last result {result!r}")
        await asyncio.sleep(0.01)


async def lease_until(store: JobStore, owner: str, count: int) -> list[LineRecord]:
    """Lease until ``owner`` holds ``count`` lines (as others' leases lapse); the lines in the order taken."""
    taken: list[LineRecord] = []

    async def more() -> int:
        taken.extend(await store.lease(owner, limit=count - len(taken), lease_seconds=LONG))
        return len(taken)

    await eventually(more, lambda held: held >= count)
    return taken


async def chunked(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def file_record(created_at: int = 1_700_000_000, purpose: str = "batch") -> FileRecord:
    return FileRecord(id=new_file_id(), filename="input.jsonl", purpose=purpose, bytes=0, created_at=created_at)


def new_batch(
    lines: int = 5, *, created_at: int = 1_700_000_000, status: BatchStatus = BatchStatus.IN_PROGRESS
) -> tuple[BatchRecord, list[LineRecord]]:
    batch = BatchRecord(
        id=new_batch_id(),
        endpoint="/v1/chat/completions",
        input_file_id=new_file_id(),
        completion_window="24h",
        created_at=created_at,
        expires_at=created_at + 86_400,
        status=status,
        metadata={"project": "suite"},
    )
    records = [
        LineRecord(batch_id=batch.id, line=n, custom_id=f"req-{n}", body=json.dumps({"model": "m", "n": n}))
        for n in range(lines)
    ]
    return batch, records


async def created(store: JobStore, lines: int = 5, **options: object) -> tuple[BatchRecord, list[LineRecord]]:
    batch, records = new_batch(lines, **options)  # type: ignore[arg-type]
    await store.create_batch(batch, records)
    return batch, records


async def read_all(store: JobStore, file_id: str) -> list[bytes]:
    return [chunk async for chunk in store.read_file(file_id)]


# Files


async def test_a_file_round_trips_in_chunks(store: JobStore) -> None:
    data = random.Random(7).randbytes(5 * 1024 * 1024 + 123)
    record = file_record()
    stored = await store.put_file(record, chunked(data, 256 * 1024))
    assert stored.bytes == len(data) and stored.id == record.id
    assert await store.get_file(record.id) == stored
    chunks = await read_all(store, record.id)
    assert b"".join(chunks) == data
    assert all(len(chunk) <= CHUNK_SIZE for chunk in chunks) and len(chunks) == 6


async def test_one_large_write_is_stored_in_chunks(store: JobStore) -> None:
    data = bytes(range(256)) * (3 * CHUNK_SIZE // 256)
    record = file_record()
    assert (await store.put_file(record, chunked(data, len(data)))).bytes == len(data)
    assert [len(chunk) for chunk in await read_all(store, record.id)] == [CHUNK_SIZE] * 3


async def test_an_empty_file(store: JobStore) -> None:
    record = file_record()
    assert (await store.put_file(record, chunked(b"", 1))).bytes == 0
    assert await read_all(store, record.id) == []
    assert await store.get_file(record.id) is not None


async def test_files_list_newest_first_in_pages(store: JobStore) -> None:
    records = [file_record(created_at=100 + n, purpose="batch" if n % 2 else "batch_output") for n in range(5)]
    for record in records:
        await store.put_file(record, chunked(b"x", 1))
    newest_first = [record.id for record in reversed(records)]
    page, more = await store.list_files(limit=2)
    assert [file.id for file in page] == newest_first[:2] and more
    page, more = await store.list_files(after=page[-1].id, limit=2)
    assert [file.id for file in page] == newest_first[2:4] and more
    page, more = await store.list_files(after=page[-1].id, limit=2)
    assert [file.id for file in page] == newest_first[4:] and not more
    page, more = await store.list_files(limit=10, purpose="batch")
    assert [file.id for file in page] == [records[3].id, records[1].id] and not more
    assert await store.list_files(after="file-unknown", limit=10) == ([], False)


async def test_uploads_left_half_written_are_dropped_by_age(store: JobStore) -> None:
    """A worker killed mid-upload leaves a hidden, half-written file: drop_uploads deletes it once old enough."""
    release = asyncio.Event()
    written = [asyncio.Event(), asyncio.Event()]

    async def stuck(first: asyncio.Event) -> AsyncIterator[bytes]:
        yield b"x" * (CHUNK_SIZE + 1)
        first.set()  # asked for more: the first whole chunk is stored
        await release.wait()
        yield b"y"

    old, new = file_record(created_at=100), file_record(created_at=int(time.time()))
    writers = [
        asyncio.create_task(store.put_file(record, stuck(event)))
        for record, event in zip((old, new), written, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in written)), 10)
    assert await store.drop_uploads(started_before=1_000) == 1
    assert await store.drop_uploads(started_before=1_000) == 0
    writers[0].cancel()  # the dead worker's writer, gone
    release.set()
    stored = await writers[1]
    assert stored.bytes == CHUNK_SIZE + 2
    assert await store.get_file(old.id) is None and await read_all(store, old.id) == []
    assert [file.id for file in (await store.list_files())[0]] == [new.id]


async def test_files_and_batches_list_by_caller(store: JobStore) -> None:
    files = {caller: dataclasses.replace(file_record(), caller=caller) for caller in ("alice", "bob")}
    for record in files.values():
        await store.put_file(record, chunked(b"x", 1))
    batches = {}
    for caller in ("alice", "bob"):
        batch, lines = new_batch(1)
        batches[caller] = dataclasses.replace(batch, caller=caller)
        await store.create_batch(batches[caller], lines)
    for caller in ("alice", "bob"):
        assert [file.id for file in (await store.list_files(caller=caller))[0]] == [files[caller].id]
        assert [batch.id for batch in (await store.list_batches(caller=caller))[0]] == [batches[caller].id]
        got = await store.get_file(files[caller].id)
        assert got is not None and got.caller == caller
        assert await store.get_batch(batches[caller].id) == batches[caller]
    assert len((await store.list_files())[0]) == 2 and len((await store.list_batches())[0]) == 2
    assert await store.list_files(caller="carol") == ([], False)
    assert await store.list_batches(caller="carol") == ([], False)


async def test_a_store_from_before_callers_gets_them_on_open(make_store: StoreFactory) -> None:
    """A store written at schema version 1 (no callers) is brought to the current version; its rows are an admin's."""
    store = await make_store()
    record = await store.put_file(dataclasses.replace(file_record(), caller="alice"), chunked(b"x", 1))
    batch, lines = new_batch(1)
    await store.create_batch(dataclasses.replace(batch, caller="alice"), lines)
    await _back_to_version_1(store)
    await store.aclose()

    store = await make_store()
    files, _ = await store.list_files()
    assert [(file.id, file.caller) for file in files] == [(record.id, "")]
    assert await store.list_files(caller="alice") == ([], False)
    got = await store.get_batch(batch.id)
    assert got is not None and got.caller == ""
    await store.put_file(dataclasses.replace(file_record(), caller="bob"), chunked(b"y", 1))
    assert len((await store.list_files(caller="bob"))[0]) == 1
    await store.aclose()
    store = await make_store()  # opening a current store again changes nothing
    assert len((await store.list_files())[0]) == 2


async def _back_to_version_1(store: JobStore) -> None:
    """Drop what version 2 added, as a worker of version 1 left its store."""
    drop = [
        "DROP INDEX files_caller",
        "DROP INDEX batches_caller",
        "ALTER TABLE files DROP COLUMN caller",
        "ALTER TABLE batches DROP COLUMN caller",
    ]
    if isinstance(store, SqliteJobStore):
        with sqlite3.connect(store.path) as db:
            for statement in [*drop, "PRAGMA user_version = 1"]:
                db.execute(statement)
        return
    assert isinstance(store, PgJobStore)
    connection = await asyncpg.connect(store.url)
    try:
        for statement in [*drop, "UPDATE iop_worker_schema SET version = 1"]:
            await connection.execute(statement)
    finally:
        await connection.close()


async def test_a_deleted_file_is_gone(store: JobStore) -> None:
    record = file_record()
    await store.put_file(record, chunked(b"abc" * 1000, 100))
    assert await store.delete_file(record.id)
    assert await store.get_file(record.id) is None
    assert await read_all(store, record.id) == []
    assert await store.list_files() == ([], False)
    assert not await store.delete_file(record.id)


async def test_a_failed_upload_leaves_nothing(store: JobStore) -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield b"x" * (CHUNK_SIZE + 10)
        raise ConnectionResetError("client went away")

    record = file_record()
    with pytest.raises(ConnectionResetError):
        await store.put_file(record, broken())
    assert await store.get_file(record.id) is None
    assert await read_all(store, record.id) == []
    assert await store.list_files() == ([], False)


# Batches


async def test_a_batch_round_trips(store: JobStore) -> None:
    batch, _ = await created(store)
    assert await store.get_batch(batch.id) == batch
    assert await store.get_batch("batch_unknown") is None
    assert await store.counts(batch.id) == RequestCounts(total=5, completed=0, failed=0)


async def test_batches_list_newest_first_in_pages(store: JobStore) -> None:
    batches = [(await created(store, 1, created_at=100 + n))[0] for n in range(3)]
    page, more = await store.list_batches(limit=2)
    assert [b.id for b in page] == [batches[2].id, batches[1].id] and more
    page, more = await store.list_batches(after=page[-1].id, limit=2)
    assert [b.id for b in page] == [batches[0].id] and not more


async def test_update_batch_sets_named_fields(store: JobStore) -> None:
    batch, _ = await created(store, status=BatchStatus.VALIDATING)
    errors = [{"code": "invalid_json", "message": "line 3 is not JSON", "param": None, "line": 3}]
    updated = await store.update_batch(
        batch.id, status=BatchStatus.FAILED, failed_at=123, errors=errors, metadata={"a": "b"}, output_file_id="file-x"
    )
    assert updated is not None
    assert (updated.status, updated.failed_at, updated.output_file_id) == (BatchStatus.FAILED, 123, "file-x")
    assert updated.errors == tuple(errors) and updated.metadata == {"a": "b"}
    assert await store.get_batch(batch.id) == updated
    assert await store.update_batch("batch_unknown", failed_at=1) is None
    with pytest.raises(ValueError, match="created_at"):
        await store.update_batch(batch.id, created_at=1)


async def test_transition_changes_status_only_from_the_given_ones(store: JobStore) -> None:
    batch, _ = await created(store)
    assert not await store.transition(batch.id, [BatchStatus.VALIDATING], BatchStatus.FAILED)
    assert await store.transition(batch.id, [BatchStatus.IN_PROGRESS], BatchStatus.FINALIZING, finalizing_at=7)
    got = await store.get_batch(batch.id)
    assert got is not None and (got.status, got.finalizing_at) == (BatchStatus.FINALIZING, 7)
    assert not await store.transition("batch_unknown", [BatchStatus.IN_PROGRESS], BatchStatus.FAILED)


async def test_a_cancel_racing_a_finalize_has_one_winner(make_store: StoreFactory) -> None:
    first, second = await make_store(), await make_store()
    for _ in range(10):
        batch, _ = await created(first, 1)
        cancel, finalize = await asyncio.gather(
            first.transition(batch.id, [BatchStatus.IN_PROGRESS], BatchStatus.CANCELLING, cancelling_at=1),
            second.transition(batch.id, [BatchStatus.IN_PROGRESS], BatchStatus.FINALIZING, finalizing_at=2),
        )
        assert cancel != finalize
        got = await first.get_batch(batch.id)
        assert got is not None
        assert got.status == (BatchStatus.CANCELLING if cancel else BatchStatus.FINALIZING)
        assert (got.cancelling_at, got.finalizing_at) == ((1, None) if cancel else (None, 2))


# Leases


async def test_two_owners_lease_disjoint_lines(store: JobStore) -> None:
    batch, _ = await created(store, 10)
    first = await store.lease("a", limit=4, lease_seconds=LONG)
    second = await store.lease("b", limit=4, lease_seconds=LONG)
    assert [line.line for line in first] == [0, 1, 2, 3] and [line.line for line in second] == [4, 5, 6, 7]
    assert {(line.status, line.lease_owner, line.attempts) for line in first} == {(LineStatus.LEASED, "a", 1)}
    assert all(line.lease_expires is not None and line.lease_expires > time.time() for line in second)
    assert [line.line for line in await store.lease("a", limit=10, lease_seconds=LONG)] == [8, 9]
    assert await store.lease("c", limit=10, lease_seconds=LONG) == []
    assert store.lease_takeovers == 0 and first[0].batch_id == batch.id


async def test_lines_are_leased_oldest_batch_first_and_only_in_progress(store: JobStore) -> None:
    newer, _ = await created(store, 2, created_at=200)
    older, _ = await created(store, 2, created_at=100)
    await created(store, 2, created_at=50, status=BatchStatus.VALIDATING)
    await created(store, 2, created_at=60, status=BatchStatus.CANCELLING)
    taken = await store.lease("a", limit=10, lease_seconds=LONG)
    assert [line.key for line in taken] == [(older.id, 0), (older.id, 1), (newer.id, 0), (newer.id, 1)]


async def test_lease_can_keep_to_one_batch(store: JobStore) -> None:
    await created(store, 2, created_at=100)
    wanted, _ = await created(store, 2, created_at=200)
    taken = await store.lease("a", limit=10, lease_seconds=LONG, batch_id=wanted.id)
    assert [line.key for line in taken] == [(wanted.id, 0), (wanted.id, 1)]


async def test_an_expired_lease_is_taken_over_and_the_old_owner_is_fenced(store: JobStore) -> None:
    batch, _ = await created(store, 3)
    lost = await store.lease("dead", limit=2, lease_seconds=SHORT)
    taken = await lease_until(store, "alive", 3)
    assert store.lease_takeovers == 2
    assert sorted((line.line, line.attempts) for line in taken) == [(0, 2), (1, 2), (2, 1)]
    assert not await store.finish(
        "dead", batch.id, lost[0].line, status=LineStatus.COMPLETED, result="{}", usage=Usage(1, 1, 2)
    )
    assert await store.counts(batch.id) == RequestCounts(3, 0, 0)
    assert [line async for line in store.results(batch.id)] == []
    got = await store.get_batch(batch.id)
    assert got is not None and got.usage == Usage()
    assert await store.finish("alive", batch.id, 0, status=LineStatus.COMPLETED, result="{}", usage=Usage(1, 1, 2))


async def test_finish_many_writes_only_the_lines_still_leased_and_only_their_usage(store: JobStore) -> None:
    """The engine records outcomes in groups (``finish_many``): a lost lease in the group writes
    neither its result nor its usage, while the others in the same transaction do."""
    batch, _ = await created(store, 3)
    lost = await store.lease("dead", limit=1, lease_seconds=SHORT)
    kept = await store.lease("dead", limit=2, lease_seconds=LONG)
    taken = await lease_until(store, "alive", 1)
    assert [line.line for line in taken] == [lost[0].line]
    outcomes = [
        (batch.id, line.line, LineStatus.COMPLETED, f'{{"line": {line.line}}}', Usage(10, 1, 11))
        for line in (*lost, *kept)
    ]
    assert await store.finish_many("dead", outcomes) == [False, True, True]
    assert await store.counts(batch.id) == RequestCounts(3, 2, 0)
    assert [line.line async for line in store.results(batch.id)] == [line.line for line in kept]
    got = await store.get_batch(batch.id)
    assert got is not None and got.usage == Usage(20, 2, 22)


async def test_lines_added_while_validating_are_leased_only_once_the_batch_is_in_progress(store: JobStore) -> None:
    batch, lines = new_batch(4, status=BatchStatus.VALIDATING)
    await store.create_batch(batch, [])
    await store.add_lines(lines[:3])
    await store.add_lines(lines[2:])  # a resumed validation stores a line again: kept once
    assert await store.counts(batch.id) == RequestCounts(4, 0, 0)
    assert await store.lease("a", limit=10, lease_seconds=LONG) == []
    assert await store.transition(batch.id, (BatchStatus.VALIDATING,), BatchStatus.IN_PROGRESS)
    assert [line.line for line in await store.lease("a", limit=10, lease_seconds=LONG)] == [0, 1, 2, 3]


async def test_cancel_pending_marks_every_pending_line_of_a_large_batch(store: JobStore) -> None:
    """SQLite marks them a slice per transaction (others' requests get turns between): none is missed."""
    batch, _ = await created(store, 2_500)
    leased = await store.lease("a", limit=3, lease_seconds=LONG)
    assert await store.cancel_pending(batch.id) == 2_497
    assert await store.counts(batch.id) == RequestCounts(2_500, 0, 0, 2_497)
    assert [line.line for line in leased] == [0, 1, 2]


async def test_taking_back_ones_own_expired_lease_is_no_takeover(store: JobStore) -> None:
    await created(store, 1)
    await store.lease("a", limit=1, lease_seconds=SHORT)
    taken = await eventually(lambda: store.lease("a", limit=1, lease_seconds=LONG), bool)
    assert taken[0].attempts == 2 and store.lease_takeovers == 0


async def test_renew_keeps_a_lease(store: JobStore) -> None:
    batch, _ = await created(store, 3)
    taken = await store.lease("a", limit=2, lease_seconds=SHORT)
    assert await store.renew("a", [line.key for line in taken], LONG) == 2
    assert await store.renew("b", [line.key for line in taken], LONG) == 0
    assert await store.renew("a", [(batch.id, 2)], LONG) == 0  # never leased
    await asyncio.sleep(SHORT * 3)  # past the first expiry: the renewed leases must still hold
    assert [line.line for line in await store.lease("b", limit=10, lease_seconds=LONG)] == [2]


async def test_release_gives_lines_back(store: JobStore) -> None:
    batch, _ = await created(store, 3)
    taken = await store.lease("a", limit=3, lease_seconds=LONG)
    assert await store.release("b", [line.key for line in taken]) == 0
    assert await store.release("a", [line.key for line in taken[:2]]) == 2
    again = await store.lease("b", limit=10, lease_seconds=LONG)
    assert [(line.line, line.attempts) for line in again] == [(0, 2), (1, 2)]
    assert store.lease_takeovers == 0
    assert not await store.finish("a", batch.id, 0, status=LineStatus.COMPLETED, result="{}", usage=Usage())


async def test_cancel_pending_keeps_lines_in_flight(store: JobStore) -> None:
    batch, _ = await created(store, 6)
    await store.lease("a", limit=2, lease_seconds=LONG)  # lines 0, 1: still running
    await store.lease("dead", limit=1, lease_seconds=SHORT)  # line 2: its owner died
    assert await store.transition(batch.id, [BatchStatus.IN_PROGRESS], BatchStatus.CANCELLING)

    async def cancel() -> RequestCounts:
        await store.cancel_pending(batch.id)
        return await store.counts(batch.id)

    counts = await eventually(cancel, lambda counts: counts.cancelled == 4)  # once line 2's lease lapsed
    assert counts == RequestCounts(6, 0, 0, 4) and counts.unfinished == 2
    assert await store.lease("b", limit=10, lease_seconds=LONG) == []
    assert await store.finish("a", batch.id, 0, status=LineStatus.COMPLETED, result='{"ok": 0}', usage=Usage(1, 2, 3))
    assert await store.finish("a", batch.id, 1, status=LineStatus.FAILED, result='{"error": 1}', usage=Usage())
    assert not await store.finish("dead", batch.id, 2, status=LineStatus.COMPLETED, result="{}", usage=Usage())
    counts = await store.counts(batch.id)
    assert counts == RequestCounts(6, 1, 1, 4) and counts.unfinished == 0
    assert [line.line async for line in store.results(batch.id)] == [0, 1]


async def test_results_come_in_input_order_and_usage_adds_up(store: JobStore) -> None:
    batch, _ = await created(store, 5)
    taken = await store.lease("a", limit=5, lease_seconds=LONG)
    for line in reversed(taken):
        status = LineStatus.FAILED if line.line == 3 else LineStatus.COMPLETED
        result = json.dumps({"custom_id": line.custom_id})
        assert await store.finish(
            "a", batch.id, line.line, status=status, result=result, usage=Usage(10, line.line, 10 + line.line)
        )
    results = [line async for line in store.results(batch.id)]
    assert [(line.line, line.status) for line in results] == [
        (n, LineStatus.FAILED if n == 3 else LineStatus.COMPLETED) for n in range(5)
    ]
    assert [json.loads(line.result or "")["custom_id"] for line in results] == [f"req-{n}" for n in range(5)]
    assert await store.counts(batch.id) == RequestCounts(5, 4, 1)
    got = await store.get_batch(batch.id)
    assert got is not None and got.usage == Usage(50, 10, 60)
    assert not await store.finish("a", batch.id, 0, status=LineStatus.COMPLETED, result="{}", usage=Usage(1, 1, 2))


async def test_finish_takes_only_an_outcome(store: JobStore) -> None:
    batch, _ = await created(store, 1)
    await store.lease("a", limit=1, lease_seconds=LONG)
    with pytest.raises(ValueError, match="completed or failed"):
        await store.finish("a", batch.id, 0, status=LineStatus.PENDING, result="{}", usage=Usage())


async def test_a_reopened_store_resumes_what_was_unfinished(make_store: StoreFactory) -> None:
    store = await make_store()
    record = await store.put_file(file_record(), chunked(b"line\n" * 100, 64))
    open_batches = [
        (await created(store, 3, created_at=100 + n, status=status))[0]
        for n, status in enumerate(
            [BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING]
        )
    ]
    for status in (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED):
        await created(store, 1, created_at=50, status=status)
    running = open_batches[1]
    taken = await store.lease("before", limit=2, lease_seconds=SHORT)
    assert await store.finish("before", running.id, 0, status=LineStatus.COMPLETED, result="{}", usage=Usage(1, 1, 2))
    await store.aclose()  # the worker stops (or dies) here: line 1 stays leased, line 2 pending

    store = await make_store()
    assert [batch.id for batch in await store.unfinished_batches()] == [batch.id for batch in open_batches]
    assert b"".join(await read_all(store, record.id)) == b"line\n" * 100
    resumed = await lease_until(store, "after", 2)
    assert sorted(line.key for line in resumed) == [(running.id, 1), (running.id, 2)] and taken[1].line == 1
    got = await store.get_batch(running.id)
    assert got is not None and got.usage == Usage(1, 1, 2)


async def test_concurrent_workers_finish_every_line_exactly_once(make_store: StoreFactory) -> None:
    """Three workers share 500 lines; a fourth takes some and dies. Every line ends finished once."""
    lines = 500
    stores = [await make_store() for _ in range(4)]
    batch, _ = await created(stores[0], lines)
    dead = await stores[3].lease("dead", limit=30, lease_seconds=SHORT)  # and never finishes them
    finished: dict[int, list[str]] = {}

    async def work(store: JobStore, owner: str) -> None:
        deadline = time.monotonic() + 30
        while (await store.counts(batch.id)).unfinished and time.monotonic() < deadline:
            taken = await store.lease(owner, limit=20, lease_seconds=LONG)
            if not taken:
                await asyncio.sleep(0.01)  # only the dead worker's lines are left, not yet expired
            for line in taken:
                usage = Usage(1, 1, 2)
                if await store.finish(
                    owner, batch.id, line.line, status=LineStatus.COMPLETED, result=owner, usage=usage
                ):
                    finished.setdefault(line.line, []).append(owner)

    await asyncio.gather(*(work(store, f"worker-{n}") for n, store in enumerate(stores[:3])))
    assert sorted(finished) == list(range(lines))
    assert all(len(owners) == 1 for owners in finished.values())
    assert sum(store.lease_takeovers for store in stores) == len(dead)
    assert await stores[0].counts(batch.id) == RequestCounts(lines, lines, 0)
    results = [line async for line in stores[0].results(batch.id)]
    assert [line.line for line in results] == list(range(lines))
    assert [line.result for line in results] == [finished[n][0] for n in range(lines)]
    got = await stores[0].get_batch(batch.id)
    assert got is not None and got.usage == Usage(lines, lines, 2 * lines)
