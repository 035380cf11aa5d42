"""Running batches: lines leased from the store, run through the control-plane below interactive
traffic, their outcomes recorded exactly once, then the output and error files written.

Each pass (:meth:`Engine.step`, on a timer and whenever there may be work) looks after the open
batches this worker can see: one past its window is stopped and ends ``expired``; one being
cancelled has its lines that run here cancelled; one whose lines have all ended is finalized
(its files written, then ``completed``, ``expired`` or ``cancelled``; the status change is
conditional, so of several workers one finalizes). Then it leases lines up to ``concurrency``
and runs each in a task: the line's body becomes a run (priority ``batches.priority``, the
batch's deadline), submitted to the control-plane; a retryable failure (the queue full, no node,
a node lost, or a model no node serves in the first seconds after (re)connecting, while the nodes
dial a restarted control-plane back) is tried again after a pause, up to ``attempts``; a run cut
off by the batch's deadline leaves its line to the expiry (in neither file); the outcome is written with
``finish``, which is fenced by the lease, so a line whose lease this worker lost is written by
the worker that took it and by no one else. Leases are renewed while lines run.

Output lines are OpenAI's: ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}``; a failed line has the error in ``response.body`` with its HTTP status, and
``error`` ``{"code", "message"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import ConnectionClosed, IopError, code_name
from iop_wire.dialer import KeepConnected
from iop_wire.openai import errors as http
from iop_wire.openai import requests as parse
from iop_wire.openai import responses as shape
from iop_worker.metrics import WorkerMetrics
from iop_worker.settings import BatchSettings
from iop_worker.store import (
    BatchRecord,
    BatchStatus,
    FileRecord,
    JobStore,
    LineKey,
    LineRecord,
    LineStatus,
    Outcome,
    Usage,
    new_file_id,
)

__all__ = ["Engine"]

_log = structlog.get_logger("iop.worker")
_RETRYABLE = frozenset(
    {
        pb.ERROR_CODE_RESOURCE_EXHAUSTED,
        pb.ERROR_CODE_UNAVAILABLE,
        pb.ERROR_CODE_NODE_LOST,
        pb.ERROR_CODE_SHUTTING_DOWN,
    }
)
_FILE_CHUNK = 256 * 1024
_COUNT_EVERY = 2.0
"""Seconds between counts of the pending lines (a gauge)."""


class _Retry(Exception):
    """A retryable failure of one attempt, and how long to wait before the next."""

    def __init__(self, error: pb.Error, wait: float) -> None:
        super().__init__(error.message)
        self.error, self.wait = error, wait


class _CutOff(Exception):
    """The line's run passed its deadline, the batch's window: the line is left to the expiry, in no file."""


class Engine:
    """Runs the lines of the batches in progress, on one worker."""

    def __init__(
        self,
        store: JobStore,
        control_plane: KeepConnected,
        settings: BatchSettings,
        metrics: WorkerMetrics,
        *,
        name: str,
    ) -> None:
        self.store, self.control_plane, self.settings, self.metrics = store, control_plane, settings, metrics
        self.owner = f"{name}-{secrets.token_hex(4)}"
        """This process's name on its leases: a restarted worker does not own its old leases."""
        self.running: dict[LineKey, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._takeovers = 0
        self._batches: dict[str, BatchRecord] = {}
        """The open batches as the last step saw them (a line needs only their id, endpoint and window,
        which never change): one query a step instead of one a line."""
        self._outcomes: list[tuple[Outcome, asyncio.Future[bool]]] = []
        """Finished lines not yet written: written together, one transaction for all that ended meanwhile."""
        self._writing: asyncio.Task[None] | None = None
        self._counted_at = 0.0
        self._refill = max(1, settings.concurrency // 4)
        """Free slots that make a line's end start a step (lease): fewer wait for the poll."""

    def wake(self) -> None:
        """Look for work now (a batch was created or cancelled, a line ended)."""
        self._wake.set()

    async def run_forever(self) -> None:
        """Steps until cancelled; renews the leases of the lines running here."""
        renewing = asyncio.create_task(self._renew_forever(), name="iop-worker-renew")
        try:
            while True:
                try:
                    await self.step()
                except (OSError, IopError) as exc:  # the store or the control-plane: try again next time
                    _log.warning("worker step failed", reason=str(exc))
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.settings.poll_interval)
        finally:
            renewing.cancel()
            await self.stop()

    async def stop(self) -> None:
        """Cancel the lines running here and give their leases back (pending again)."""
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.running:
            await self.store.release(self.owner, list(self.running))
            self.running.clear()

    async def step(self) -> None:
        """Look after the open batches, then lease lines to fill the free slots."""
        now = int(time.time())
        batches = await self.store.unfinished_batches()
        self._batches = {batch.id: batch for batch in batches}
        for batch in batches:
            await self._look_after(batch, now)
        self.metrics.running.set(len(self.running))
        if time.monotonic() - self._counted_at >= _COUNT_EVERY:  # counting lines costs: not every step
            self._counted_at = time.monotonic()
            counts = [await self.store.counts(b.id) for b in batches if b.status is BatchStatus.IN_PROGRESS]
            self.metrics.pending.set(sum(count.unfinished for count in counts))
        free = self.settings.concurrency - len(self.running)
        if free <= 0:
            return
        taken_before = self.store.lease_takeovers
        lines = await self.store.lease(self.owner, limit=free, lease_seconds=self.settings.lease_seconds)
        if self.store.lease_takeovers > taken_before:
            self.metrics.lease_takeovers.inc(self.store.lease_takeovers - taken_before)
        for line in lines:
            self.running[line.key] = asyncio.create_task(
                self._run_line(line), name=f"iop-line-{line.batch_id}-{line.line}"
            )

    async def _look_after(self, batch: BatchRecord, now: int) -> None:
        if batch.status is BatchStatus.IN_PROGRESS and batch.expires_at is not None and now >= batch.expires_at:
            if await self.store.transition(
                batch.id, (BatchStatus.IN_PROGRESS,), BatchStatus.FINALIZING, finalizing_at=now
            ):
                _log.info("batch expired", batch_id=batch.id)
                await self._stop_lines(batch.id)
                await self._finalize(batch.id, BatchStatus.EXPIRED, "expired_at")
            return
        if batch.status is BatchStatus.CANCELLING:
            await self._stop_lines(batch.id)
            counts = await self.store.counts(batch.id)
            if counts.unfinished == 0:
                await self._finalize(batch.id, BatchStatus.CANCELLED, "cancelled_at", source=BatchStatus.CANCELLING)
            return
        if batch.status is BatchStatus.FINALIZING:  # a worker died while finalizing it: do it again
            expired = batch.expires_at is not None and now >= batch.expires_at
            if expired and (await self.store.counts(batch.id)).cancelled:
                await self._finalize(batch.id, BatchStatus.EXPIRED, "expired_at")
            else:
                await self._finalize(batch.id, BatchStatus.COMPLETED, "completed_at")
            return
        if (
            batch.status is BatchStatus.IN_PROGRESS
            and not any(key[0] == batch.id for key in self.running)  # unfinished while its lines run here
            and (await self.store.counts(batch.id)).unfinished == 0
            and await self.store.transition(
                batch.id, (BatchStatus.IN_PROGRESS,), BatchStatus.FINALIZING, finalizing_at=now
            )
        ):
            await self._finalize(batch.id, BatchStatus.COMPLETED, "completed_at")

    async def _stop_lines(self, batch_id: str) -> None:
        """Cancel this worker's running lines of the batch; they and its pending lines end cancelled."""
        keys = [key for key in self.running if key[0] == batch_id]
        tasks = [self.running[key] for key in keys]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if keys:
            await self.store.release(self.owner, keys)
        await self.store.cancel_pending(batch_id)

    async def _finalize(
        self, batch_id: str, final: BatchStatus, stamp: str, *, source: BatchStatus = BatchStatus.FINALIZING
    ) -> None:
        """Write the output and error files, then move the batch to its final status (one worker wins)."""
        batch = await self.store.get_batch(batch_id)
        if batch is None:
            return
        output, errors = await self._write_results(batch)
        now = int(time.time())
        fields: dict[str, Any] = {stamp: now, "output_file_id": output, "error_file_id": errors}
        if not await self.store.transition(batch_id, (source,), final, **fields):
            for file_id in (output, errors):  # another worker finalized it first
                if file_id is not None:
                    await self.store.delete_file(file_id)
            return
        counts = await self.store.counts(batch_id)
        _log.info(
            "batch ended",
            batch_id=batch_id,
            status=str(final),
            completed=counts.completed,
            failed=counts.failed,
            cancelled=counts.cancelled,
        )

    async def _write_results(self, batch: BatchRecord) -> tuple[str | None, str | None]:
        """The output file (completed lines) and the error file (failed lines); None for an empty one."""
        done: list[str] = []
        failed: list[str] = []
        async for line in self.store.results(batch.id):
            assert line.result is not None
            (done if line.status is LineStatus.COMPLETED else failed).append(line.result)
        now = int(time.time())
        ids: list[str | None] = []
        for name, lines in ((f"{batch.id}_output.jsonl", done), (f"{batch.id}_error.jsonl", failed)):
            if not lines and name.endswith("_error.jsonl"):
                ids.append(None)
                continue
            record = FileRecord(new_file_id(), name, "batch_output", 0, now, caller=batch.caller)
            stored = await self.store.put_file(record, _jsonl(lines))
            ids.append(stored.id)
        return ids[0], ids[1]

    async def _renew_forever(self) -> None:
        every = self.settings.lease_seconds / 3
        while True:
            await asyncio.sleep(every)
            if self.running:
                try:
                    await self.store.renew(self.owner, list(self.running), self.settings.lease_seconds)
                except OSError as exc:
                    _log.warning("lease renewal failed", reason=str(exc))

    async def _run_line(self, line: LineRecord) -> None:
        started = time.monotonic()
        try:
            batch = self._batches.get(line.batch_id) or await self.store.get_batch(line.batch_id)
            if batch is None:
                return
            try:
                status, result, usage = await self._attempts(batch, line)
            except _CutOff:  # pending again, so the expiry marks it cancelled like the lines not yet started
                await self.store.release(self.owner, [line.key])
                return
            if await self._finish((line.batch_id, line.line, status, result, usage)):
                self.metrics.lines.labels(str(status)).inc()
                self.metrics.line_seconds.observe(time.monotonic() - started)
            else:
                _log.warning("line lost its lease", batch_id=line.batch_id, line=line.line)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one line's bug must not stop the others
            _log.exception("line failed unexpectedly", batch_id=line.batch_id, line=line.line)
            await self.store.release(self.owner, [line.key])
        finally:
            self.running.pop(line.key, None)
            if len(self.running) <= self.settings.concurrency - self._refill:
                self.wake()  # lease the free slots together: a query per few lines, not one a line

    async def _finish(self, outcome: Outcome) -> bool:
        """Record a line's outcome with those of the lines ending meanwhile; False if its lease was lost."""
        written: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._outcomes.append((outcome, written))
        if self._writing is None or self._writing.done():
            self._writing = asyncio.create_task(self._write_outcomes(), name="iop-worker-finish")
        return await written

    async def _write_outcomes(self) -> None:
        while self._outcomes:
            outcomes, self._outcomes = self._outcomes, []
            try:
                done = await self.store.finish_many(self.owner, [outcome for outcome, _ in outcomes])
            except Exception as exc:  # noqa: BLE001 - every waiting line sees the store's error
                for _, written in outcomes:
                    if not written.done():
                        written.set_exception(exc)
                continue
            for (_, written), ok in zip(outcomes, done, strict=True):
                if not written.done():
                    written.set_result(ok)

    async def _attempts(self, batch: BatchRecord, line: LineRecord) -> tuple[LineStatus, str, Usage]:
        """Run the line, trying again after retryable failures; its outcome and output line."""
        request_id = f"batch_req_{secrets.token_hex(12)}"
        last: pb.Error | None = None
        for attempt in range(1, self.settings.attempts + 1):
            try:
                return await self._attempt(batch, line, request_id)
            except _Retry as retry:
                last = retry.error
                self.metrics.retries.labels(code_name(retry.error.code)).inc()
                if attempt < self.settings.attempts:
                    await asyncio.sleep(retry.wait * attempt)
        assert last is not None
        return LineStatus.FAILED, _error_line(line, request_id, last), Usage()

    async def _attempt(self, batch: BatchRecord, line: LineRecord, request_id: str) -> tuple[LineStatus, str, Usage]:
        body = json.loads(line.body)
        try:
            run, build = _run_request(batch, line, body, request_id)
        except http.ApiError as refused:
            return LineStatus.FAILED, _failed_line(line, request_id, refused), Usage()
        run.priority = self.settings.priority
        run.caller.id = batch.caller or f"batch:{batch.id}"  # the key that made the batch: policy and ledger see it
        run.metadata["batch_id"] = batch.id
        if batch.expires_at is not None:
            run.deadline.FromSeconds(batch.expires_at)
        try:
            connection = await self.control_plane.connected(timeout=5.0)
            stream = await connection.open_run(run, urgent=False)
        except (TimeoutError, ConnectionClosed, IopError) as exc:
            raise _Retry(pb.Error(code=pb.ERROR_CODE_UNAVAILABLE, message=f"no control-plane: {exc}"), 1.0) from None
        outcome = shape.Outcome()
        start, end = await shape.gather(stream, outcome)
        if end is None:
            raise _Retry(pb.Error(code=pb.ERROR_CODE_NODE_LOST, message="the run ended without a result"), 0.5)
        if end.HasField("error"):
            error = end.error
            if error.code == pb.ERROR_CODE_DEADLINE_EXCEEDED and batch.expires_at is not None:
                raise _CutOff
            if error.code in _RETRYABLE or error.retryable:  # a restarted control-plane: UNAVAILABLE while nodes return
                wait = error.retry_after.ToTimedelta().total_seconds() if error.HasField("retry_after") else 0.5
                raise _Retry(error, max(wait, 0.05))
            return LineStatus.FAILED, _error_line(line, request_id, error), Usage()
        usage = end.complete.usage
        answer = build(start.model or run.model, outcome, end.complete)
        total = usage.prompt_tokens + usage.completion_tokens
        return (
            LineStatus.COMPLETED,
            _line(line, request_id, 200, answer),
            Usage(usage.prompt_tokens, usage.completion_tokens, total),
        )


def _run_request(
    batch: BatchRecord, line: LineRecord, body: dict[str, Any], request_id: str
) -> tuple[pb.RunRequest, Callable[[str, shape.Outcome, pb.RunComplete], dict[str, Any]]]:
    """The run for a line's body, and how its answer's body is built; ApiError for a bad body."""
    created = int(time.time())
    if body.get("stream"):
        raise http.ApiError(400, "stream is not allowed in a batch", param="stream")
    if batch.endpoint == "/v1/chat/completions":
        chat = parse.chat_request(body, request_id)
        return chat.request, lambda model, outcome, complete: shape.chat_body(
            request_id, created, model, outcome, complete
        )
    if batch.endpoint == "/v1/completions":
        completion = parse.completion_request(body, request_id)
        if len(completion.requests) != 1:
            raise http.ApiError(400, "a batch line takes one prompt", param="prompt")
        prompt = completion.requests[0].prompt[0]
        echo = completion.echo
        return completion.requests[0], lambda model, outcome, complete: shape.completion_body(
            request_id, created, model, [(prompt if echo else "") + "".join(outcome.text)], [complete]
        )
    embedding = parse.embedding_request(body, request_id)
    return embedding.request, lambda model, outcome, complete: shape.embedding_body(
        model, outcome.embeddings, complete.usage, as_base64=embedding.base64, dimensions=embedding.dimensions
    )


def _line(line: LineRecord, request_id: str, status: int, body: dict[str, Any], error: Any = None) -> str:
    document = {
        "id": f"batch_req_{line.batch_id.removeprefix('batch_')}_{line.line}",
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }
    return json.dumps(document, separators=(",", ":"))


def _failed_line(line: LineRecord, request_id: str, refused: http.ApiError) -> str:
    return _line(
        line,
        request_id,
        refused.status,
        {"error": refused.body()},
        {"code": refused.code or refused.type, "message": refused.message},
    )


def _error_line(line: LineRecord, request_id: str, error: pb.Error) -> str:
    return _failed_line(line, request_id, http.from_iop(error))


async def _jsonl(lines: list[str]) -> AsyncIterator[bytes]:
    """Lines as JSONL, in chunks of about 256 KiB."""
    chunk: list[str] = []
    size = 0
    for text in lines:
        chunk.append(text)
        size += len(text) + 1
        if size >= _FILE_CHUNK:
            yield ("\n".join(chunk) + "\n").encode()
            chunk, size = [], 0
    if chunk:
        yield ("\n".join(chunk) + "\n").encode()
