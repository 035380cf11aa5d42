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
the worker that took it and by no one else. Leases are renewed while lines run. A line whose body
cannot become a run (no UTF-8, nested past protobuf's limit, refused by the wire) fails at once;
an unexpected error counts as an attempt. A line stopped (cancel, expiry, shutdown) cancels its run.

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
from google.protobuf import message as protobuf_message

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import ConnectionClosed, IopError, RunStream, code_name
from iop_wire.dialer import Links
from iop_wire.logs import RateLimitedLog
from iop_wire.messages import error_message
from iop_wire.openai import batches as rules
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
from iop_worker.supervise import repeat

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
        control_plane: Links,
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
        self._unexpected_log = RateLimitedLog(every=5.0)
        self._refill = max(1, settings.concurrency // 4)
        """Free slots that make a line's end start a step (lease): fewer wait for the poll."""

    def wake(self) -> None:
        """Look for work now (a batch was created or cancelled, a line ended)."""
        self._wake.set()

    async def run_forever(self) -> None:
        """Steps, and renews the leases of the lines running here, until cancelled.

        A failed step or renewal (any store error) is logged, counted and tried again after a
        growing pause (:func:`repeat`); if either part ends anyway, the other is cancelled and
        the error ends this call (the worker stops: never half-running).
        """
        failures = self.metrics.part_failures
        try:
            async with asyncio.TaskGroup() as parts:
                parts.create_task(repeat("step", self.step, self._idle, failures), name="iop-worker-step")
                parts.create_task(repeat("renew", self._renew, self._renew_pause, failures), name="iop-worker-renew")
        finally:
            await self.stop()

    async def _idle(self) -> None:
        """Until woken (a batch created or cancelled, slots free) or the poll interval passed."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self.settings.poll_interval)

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
        """The output file (completed lines) and the error file (failed lines); None for an empty one.

        Each file is written as the store pages its lines out (a chunk of about 256 KiB held at a
        time), so finishing a batch of any size takes bounded memory.
        """
        now = int(time.time())
        ids: list[str | None] = []
        failed = (await self.store.counts(batch.id)).failed
        for status, suffix in ((LineStatus.COMPLETED, "output"), (LineStatus.FAILED, "error")):
            if status is LineStatus.FAILED and not failed:
                ids.append(None)
                continue
            name = f"{batch.id}_{suffix}.jsonl"
            record = FileRecord(new_file_id(), name, rules.OUTPUT_PURPOSE, 0, now, caller=batch.caller)
            stored = await self.store.put_file(record, _jsonl(self._results(batch.id, status)))
            ids.append(stored.id)
        return ids[0], ids[1]

    async def _results(self, batch_id: str, status: LineStatus) -> AsyncIterator[str]:
        async for line in self.store.results(batch_id):
            if line.status is status:
                assert line.result is not None
                yield line.result

    async def _renew(self) -> None:
        if self.running:
            await self.store.renew(self.owner, list(self.running), self.settings.lease_seconds)

    async def _renew_pause(self) -> None:
        await asyncio.sleep(self.settings.lease_seconds / 3)  # three renewals a lease: one may fail

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
        except Exception as exc:  # noqa: BLE001 - one line's bug must not stop the others
            await self._unexpected(line, exc)
        finally:
            self.running.pop(line.key, None)
            if len(self.running) <= self.settings.concurrency - self._refill:
                self.wake()  # lease the free slots together: a query per few lines, not one a line

    async def _unexpected(self, line: LineRecord, exc: Exception) -> None:
        """A line's attempt failed unexpectedly (a bug, the store): it counts as an attempt.

        The line is leased again until it has had ``attempts`` leases, then fails with an error
        line; the traceback is logged at most once per few seconds (a bad line may fail fast).
        """
        self.metrics.line_errors.inc()
        self._unexpected_log.error(
            "unexpected",
            _log,
            "line failed unexpectedly",
            batch_id=line.batch_id,
            line=line.line,
            attempts=line.attempts,
            exc_info=exc,
        )
        try:
            if line.attempts < self.settings.attempts:
                await self.store.release(self.owner, [line.key])
                return
            message = f"the worker could not run this line ({type(exc).__name__}, {line.attempts} attempts)"
            error = pb.Error(code=pb.ERROR_CODE_INTERNAL, message=message)
            await self._finish((line.batch_id, line.line, LineStatus.FAILED, _error_line(line, "", error), Usage()))
        except Exception as again:  # noqa: BLE001 - the store too: the lease expires and the line is leased again
            _log.warning("line left to its lease expiry", batch_id=line.batch_id, line=line.line, error=repr(again))

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
            run, build = _sendable_run(batch, line, body, request_id)
        except http.ApiError as refused:
            return LineStatus.FAILED, _failed_line(line, request_id, refused), Usage()
        run.priority = self.settings.priority
        run.caller.id = batch.caller or f"batch:{batch.id}"  # the key that made the batch: policy and ledger see it
        run.metadata["batch_id"] = batch.id
        if batch.expires_at is not None:
            run.deadline.FromSeconds(batch.expires_at)
        stream = await self._open(run)
        if isinstance(stream, pb.Error):
            return LineStatus.FAILED, _error_line(line, request_id, stream), Usage()
        outcome = shape.Outcome()
        try:
            start, end = await shape.gather(stream, outcome)
        finally:  # the line was cancelled (batch cancelled or expired, shutdown): so is its run on the node
            if not stream.finished:
                stream.cancel_nowait("the batch line was stopped")
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

    async def _open(self, run: pb.RunRequest) -> RunStream | pb.Error:
        """The run's stream; the error that fails the line for good; _Retry for a passing failure."""
        try:
            connection = await self.control_plane.connected(timeout=5.0)
            return await connection.open_run(run, urgent=False)
        except (TimeoutError, ConnectionClosed) as exc:
            raise _Retry(pb.Error(code=pb.ERROR_CODE_UNAVAILABLE, message=f"no control-plane: {exc}"), 1.0) from None
        except IopError as exc:
            if exc.retryable:
                raise _Retry(error_message(exc), 1.0) from None
            return error_message(exc)  # the run was refused (cannot be encoded, too large): it never will be sent


def _sendable_run(
    batch: BatchRecord, line: LineRecord, body: dict[str, Any], request_id: str
) -> tuple[pb.RunRequest, Callable[[str, shape.Outcome, pb.RunComplete], dict[str, Any]]]:
    """:func:`_run_request`, checked to be a run the control-plane can read; ApiError (400) if not.

    A body can pass the OpenAI checks and still not be a run: a lone surrogate (``\\ud800``) is
    no UTF-8, and ``tools`` nested 40 deep is past protobuf's nesting limit when decoded. Such a
    line fails once, with this message, instead of being tried again and again.
    """
    try:
        run, build = _run_request(batch, line, body, request_id)
        pb.RunRequest.FromString(run.SerializeToString())  # the receiver's decode, with its nesting limit
    except UnicodeError:
        raise http.ApiError(400, "the body has a string that is not valid Unicode (a lone surrogate)") from None
    except (RecursionError, protobuf_message.Error):
        raise http.ApiError(400, "the body is nested too deeply to be sent as a run (protobuf's limit)") from None
    return run, build


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


async def _jsonl(lines: AsyncIterator[str]) -> AsyncIterator[bytes]:
    """Lines as JSONL, in chunks of about 256 KiB."""
    chunk: list[str] = []
    size = 0
    async for text in lines:
        chunk.append(text)
        size += len(text) + 1
        if size >= _FILE_CHUNK:
            yield ("\n".join(chunk) + "\n").encode()
            chunk, size = [], 0
    if chunk:
        yield ("\n".join(chunk) + "\n").encode()
