"""Batches over IOP: create (checking every line of the input file), get, list, cancel.

``batch.create`` checks the request (endpoint, window, the input file and its purpose), stores
the batch ``validating`` and answers at once, as OpenAI does; the file is checked beside the
worker's other requests (a task per batch), each line as OpenAI's Batch API does: a JSON object
with ``custom_id`` (unique in the file), ``method`` POST, ``url`` equal to the batch's endpoint
and an object ``body``. A file with any bad line makes the batch ``failed``, its ``errors``
naming each line (from 1); a good one has its lines stored a slice per transaction, then goes
``in_progress`` and the engine (:mod:`iop_worker.engine`) runs it. A worker that stops while
validating resumes at its next start. A line's body is checked when it runs: a bad body fails
that line alone (the error file), as OpenAI does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog
from prometheus_client import Counter

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import Inbound, IopError, MessageHandler
from iop_wire.messages import BATCH_TIMES
from iop_wire.openai import batches as rules
from iop_wire.openai.errors import ID_SHOWN
from iop_worker.files import Files, owner, scope, sees
from iop_worker.settings import BatchSettings
from iop_worker.store import BatchRecord, BatchStatus, JobStore, LineRecord, RequestCounts, new_batch_id

__all__ = ["Batches", "batch_info"]

_log = structlog.get_logger("iop.worker")
_LINES_PER_WRITE = 1000
"""Lines stored per transaction while a batch is validated: no one write holds the store for long."""
_YIELD_EVERY = 500
"""Lines checked between turns given to the worker's other requests."""
_MAX_ERRORS = 100
"""Line errors kept per failed batch (a file of 50,000 bad lines says so in 100)."""


def batch_info(batch: BatchRecord, counts: RequestCounts) -> pb.BatchInfo:
    """The wire form of a batch."""
    info = pb.BatchInfo(
        id=batch.id,
        endpoint=batch.endpoint,
        input_file_id=batch.input_file_id,
        completion_window=batch.completion_window,
        status=rules.STATUS_CODES[batch.status],
        output_file_id=batch.output_file_id or "",
        error_file_id=batch.error_file_id or "",
        request_counts=pb.BatchRequestCounts(total=counts.total, completed=counts.completed, failed=counts.failed),
        metadata=batch.metadata,
        usage=pb.Usage(prompt_tokens=batch.usage.prompt_tokens, completion_tokens=batch.usage.completion_tokens),
        caller=batch.caller,
    )
    for name in BATCH_TIMES:
        if (value := getattr(batch, name)) is not None:
            getattr(info, name).FromSeconds(value)
    for error in batch.errors:
        item = info.errors.add(code=error["code"], message=error["message"], param=error.get("param") or "")
        if error.get("line") is not None:
            item.line = error["line"]
    return info


class Batches:
    """The batch message handlers."""

    def __init__(
        self, store: JobStore, settings: BatchSettings, files: Files, failures: Counter, *, wake: Any = None
    ) -> None:
        self.store, self.settings, self.files = store, settings, files
        self._wake = wake
        """Called when a batch is validated or cancelled: the engine looks for work at once."""
        self._failures = failures
        self._validating: set[asyncio.Task[None]] = set()
        """Validations under way here, each in a task of its own (owned: closed by :meth:`aclose`)."""

    def handlers(self) -> dict[str, MessageHandler]:
        """``{body field: handler}`` for an edge's (or admin's) connection."""
        return {
            "batch_create": self.create,
            "batch_get": self.get,
            "batches_list": self.listing,
            "batch_cancel": self.cancel,
        }

    async def create(self, inbound: Inbound) -> None:
        message = inbound.envelope.batch_create
        if message.endpoint not in rules.ENDPOINTS:
            allowed = ", ".join(rules.ENDPOINTS)
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, f"endpoint must be one of {allowed}", param="endpoint")
        try:
            window = rules.window_seconds(message.completion_window or rules.DEFAULT_WINDOW)
        except ValueError as exc:
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, str(exc), param="completion_window") from None
        source = await self.files.visible(inbound, message.input_file_id)  # unknown: names file_id, a 404 at the edge
        if source.purpose not in rules.PURPOSES:
            raise IopError(
                pb.ERROR_CODE_INVALID_ARGUMENT,
                f"file {source.id} has purpose '{source.purpose}'; a batch needs a file uploaded with purpose 'batch'",
                param="input_file_id",
            )
        now = int(time.time())
        batch = BatchRecord(
            id=new_batch_id(),
            endpoint=message.endpoint,
            input_file_id=source.id,
            completion_window=message.completion_window or rules.DEFAULT_WINDOW,
            created_at=now,
            expires_at=now + window,
            metadata=dict(message.metadata),
            caller=owner(inbound),
        )
        await self.store.create_batch(batch, [])
        _log.info("batch created", batch_id=batch.id, status=str(batch.status), bytes=source.bytes)
        self._validate_later(batch)
        await self._reply(inbound, batch)

    def resume(self, batches: Sequence[BatchRecord]) -> None:
        """Validate again the batches a stopped worker left ``validating`` (adding lines is idempotent)."""
        for batch in batches:
            if batch.status is BatchStatus.VALIDATING:
                self._validate_later(batch)

    async def aclose(self) -> None:
        """Stop the validations under way (a restarted worker resumes them)."""
        tasks = list(self._validating)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _validate_later(self, batch: BatchRecord) -> None:
        task = asyncio.create_task(self._validate(batch), name=f"iop-validate-{batch.id}")
        self._validating.add(task)
        task.add_done_callback(self._validated)

    def _validated(self, task: asyncio.Task[None]) -> None:
        self._validating.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:  # the store failed: resumed at restart
            self._failures.labels("validate").inc()
            _log.error("batch validation failed", task=task.get_name(), error=repr(error))

    async def _validate(self, batch: BatchRecord) -> None:
        """Check every line, then store them a slice at a time and move the batch on (failed if a line is bad).

        It runs beside the worker's requests, not in one: a file of 50,000 lines of 4 KB takes
        seconds to read twice, and the create has already answered ``validating``.
        """
        count, errors = await self._check_lines(batch)
        now = int(time.time())
        if errors:
            await self.store.transition(
                batch.id, (BatchStatus.VALIDATING,), BatchStatus.FAILED, failed_at=now, errors=tuple(errors)
            )
            _log.info("batch failed validation", batch_id=batch.id, errors=len(errors))
            return
        slice_: list[LineRecord] = []
        async for line in self._records(batch):
            slice_.append(line)
            if len(slice_) >= _LINES_PER_WRITE:
                if not await self._add(batch.id, slice_):
                    return
                slice_ = []
        if not await self._add(batch.id, slice_):
            return
        moved = await self.store.transition(
            batch.id, (BatchStatus.VALIDATING,), BatchStatus.IN_PROGRESS, in_progress_at=int(time.time())
        )
        _log.info("batch validated", batch_id=batch.id, lines=count, in_progress=moved)
        if self._wake is not None:
            self._wake()

    async def _add(self, batch_id: str, lines: list[LineRecord]) -> bool:
        """Store the lines unless the batch was cancelled meanwhile; whether it is still validating."""
        batch = await self.store.get_batch(batch_id)
        if batch is None or batch.status is not BatchStatus.VALIDATING:
            _log.info("batch validation stopped", batch_id=batch_id, status=str(batch.status) if batch else None)
            return False
        await self.store.add_lines(lines)
        return True

    async def get(self, inbound: Inbound) -> None:
        await self._reply(inbound, await self._batch(inbound, inbound.envelope.batch_get.batch_id))

    async def listing(self, inbound: Inbound) -> None:
        message = inbound.envelope.batches_list
        limit = min(message.limit or rules.BATCHES_PAGE.default, rules.BATCHES_PAGE.maximum)
        batches, more = await self.store.list_batches(after=message.after or None, limit=limit, caller=scope(inbound))
        infos = [batch_info(batch, await self.store.counts(batch.id)) for batch in batches]
        await inbound.reply(pb.Envelope(batches_listed=pb.BatchesListed(batches=infos, has_more=more)))

    async def cancel(self, inbound: Inbound) -> None:
        batch = await self._batch(inbound, inbound.envelope.batch_cancel.batch_id)
        open_statuses = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
        if await self.store.transition(batch.id, open_statuses, BatchStatus.CANCELLING, cancelling_at=int(time.time())):
            cancelled = await self.store.cancel_pending(batch.id)
            _log.info("batch cancelling", batch_id=batch.id, lines_not_started=cancelled)
            if self._wake is not None:
                self._wake()
        await self._reply(inbound, await self._batch(inbound, batch.id))

    async def _batch(self, inbound: Inbound, batch_id: str) -> BatchRecord:
        batch = await self.store.get_batch(batch_id) if batch_id else None
        if batch is None or not sees(batch.caller, scope(inbound)):
            raise IopError(pb.ERROR_CODE_NOT_FOUND, f"No such Batch object: {batch_id[:ID_SHOWN]}", param="batch_id")
        return batch

    async def _reply(self, inbound: Inbound, batch: BatchRecord) -> None:
        info = batch_info(batch, await self.store.counts(batch.id))
        await inbound.reply(pb.Envelope(batch_info=info))

    async def _check_lines(self, batch: BatchRecord) -> tuple[int, list[dict[str, Any]]]:
        """How many requests the input file has, and the errors that fail the batch (none: it is good)."""
        errors: list[dict[str, Any]] = []
        count = 0
        async for problem, _ in _checked_lines(self.store, batch.input_file_id, batch.endpoint):
            if problem is not None:
                if len(errors) < _MAX_ERRORS:
                    errors.append(problem)
                continue
            count += 1
            if count > self.settings.max_lines:
                message = f"the file has more than {self.settings.max_lines} requests, this server's limit"
                return count, [{"code": "too_many_requests", "message": message, "param": None, "line": None}]
        if not count and not errors:
            errors.append(
                {"code": "empty_file", "message": "the input file has no requests", "param": None, "line": None}
            )
        return count, errors

    async def _records(self, batch: BatchRecord) -> AsyncIterator[LineRecord]:
        """The input file's requests as the batch's lines (the file was checked: every line is good)."""
        index = 0
        async for _, request in _checked_lines(self.store, batch.input_file_id, batch.endpoint):
            if request is not None:
                yield LineRecord(batch.id, index, request[0], request[1])
                index += 1


async def _checked_lines(
    store: JobStore, file_id: str, endpoint: str
) -> AsyncIterator[tuple[dict[str, Any] | None, tuple[str, str] | None]]:
    """Each non-blank line of the file checked: (its error, None) or (None, (custom_id, body JSON)).

    The custom_ids seen are kept as 16-byte digests: 50,000 ids of any length take under 2 MB.
    """
    seen: set[bytes] = set()
    number = 0
    async for text in _text_lines(store, file_id):
        number += 1
        if number % _YIELD_EVERY == 0:
            await asyncio.sleep(0)  # a file of small lines in one chunk: the worker's requests go on
        if text.strip():
            yield _check(text, number, endpoint, seen)


def _check(
    text: str, number: int, endpoint: str, seen: set[bytes]
) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """A line's (custom_id, body JSON) or its error, OpenAI's codes."""
    try:
        request = json.loads(text)
    except ValueError:
        request = None
    problem = _problem(request, number, endpoint, seen)
    if problem is not None:
        code, message, param = problem
        return {"code": code, "message": message, "param": param, "line": number}, None
    seen.add(_digest(request["custom_id"]))
    return None, (request["custom_id"], json.dumps(request["body"]))


def _digest(custom_id: str) -> bytes:
    return hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _problem(request: Any, number: int, endpoint: str, seen: set[bytes]) -> tuple[str, str, str | None] | None:
    """What is wrong with a parsed line, as (code, message, param); None when nothing is."""
    if not isinstance(request, dict):
        return "invalid_json_line", f"line {number} is not a JSON object", None
    missing = next((name for name in ("custom_id", "method", "url", "body") if name not in request), None)
    if missing is not None:
        return "missing_required_parameter", f"line {number} has no '{missing}'", missing
    custom_id = request["custom_id"]
    checks: tuple[tuple[bool, str, str, str], ...] = (
        (not isinstance(custom_id, str) or not custom_id, "invalid_request", "custom_id must be a string", "custom_id"),
        (request["method"] != "POST", "invalid_method", "method must be POST", "method"),
        (request["url"] != endpoint, "mismatched_endpoint", f"the line is for another endpoint than {endpoint}", "url"),
        (not isinstance(request["body"], dict), "invalid_request", "body must be a JSON object", "body"),
        (
            _digest(custom_id) in seen,
            "duplicate_custom_id",
            f"the custom_id '{custom_id}' is used by an earlier line",
            "custom_id",
        ),
    )
    for failed, code, message, param in checks:
        if failed:
            return code, f"line {number}: {message}", param
    return None


async def _text_lines(store: JobStore, file_id: str) -> AsyncIterator[str]:
    """The file's lines as text (UTF-8), read chunk by chunk."""
    pending = b""
    async for chunk in store.read_file(file_id):
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            yield raw.decode("utf-8", errors="replace")
    if pending:
        yield pending.decode("utf-8", errors="replace")
