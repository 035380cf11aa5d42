"""Files over IOP: uploads in chunks, pages of files, ranged reads, deletes (OpenAI's Files API).

An upload is ``file.create`` then ``file.chunk`` requests, each answered once its bytes are
handed to the store: the edge never has more than a chunk or two in flight, and the worker holds
at most two chunks per upload (a bounded queue between the requests and the store's writer).
An upload whose next chunk does not come within ``_IDLE`` seconds is dropped with what it wrote.
Reads come as ``file.read`` with an offset; a download reads its file front to back, so the
reader of the last offset served is kept (a few, least recently used) and the next piece
continues it instead of skipping from the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog
from prometheus_client import Counter

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import Inbound, IopError, MessageHandler, Role
from iop_wire.openai import batches as rules
from iop_wire.openai.errors import ID_SHOWN
from iop_worker.store import FileRecord, JobStore, new_file_id
from iop_worker.supervise import repeat

__all__ = ["Files", "file_info", "owner", "scope", "sees"]

_log = structlog.get_logger("iop.worker")
_IDLE = 60.0
"""Seconds an upload may wait for its next chunk."""
_UPLOAD_MAX = 3600.0
"""Seconds an upload may take in all; a slower one is dropped."""
_SWEEP_EVERY = 600.0
"""Seconds between looks for uploads that a dead worker left half written."""
_MAX_UPLOADS = 64
"""Uploads open at once; more are refused (RESOURCE_EXHAUSTED)."""
_READ_DEFAULT, _READ_MAX = 256 * 1024, 1024 * 1024
_READERS = 16
"""Downloads whose position is kept."""
_END = b""


def scope(inbound: Inbound) -> str | None:
    """Whose files and batches a request sees: its caller's (``Inbound.caller``); an admin naming none, everyone's."""
    if inbound.peer.role is Role.ADMIN and not inbound.envelope.caller:
        return None
    return inbound.caller


def owner(inbound: Inbound) -> str:
    """Whose a file or batch the request creates is: its caller (an admin's own name when it names none)."""
    return inbound.caller


def sees(caller: str, seen_by: str | None) -> bool:
    """Whether a file or batch of ``caller`` is seen by a request whose scope is ``seen_by``."""
    return seen_by is None or caller == seen_by


def file_info(record: FileRecord) -> pb.FileInfo:
    """The wire form of a stored file."""
    info = pb.FileInfo(id=record.id, filename=record.filename, purpose=record.purpose, bytes=record.bytes)
    info.created_at.FromSeconds(record.created_at)
    if record.expires_at is not None:
        info.expires_at.FromSeconds(record.expires_at)
    return info


@dataclass
class _Upload:
    """An upload in progress: chunks go through ``queue`` to the store's writer."""

    id: str
    record: FileRecord
    queue: asyncio.Queue[bytes] = field(default_factory=lambda: asyncio.Queue(maxsize=2))
    received: int = 0
    writer: asyncio.Task[FileRecord] | None = None
    idle: asyncio.TimerHandle | None = None
    deadline: asyncio.TimerHandle | None = None


class Files:
    """The file message handlers."""

    def __init__(self, store: JobStore, *, max_bytes: int) -> None:
        self.store, self.max_bytes = store, max_bytes
        self._uploads: dict[str, _Upload] = {}
        self._readers: OrderedDict[tuple[str, int], tuple[AsyncIterator[bytes], bytes]] = OrderedDict()

    def handlers(self) -> dict[str, MessageHandler]:
        """``{body field: handler}`` for an edge's (or admin's) connection."""
        return {
            "file_create": self.create,
            "file_chunk": self.chunk,
            "file_get": self.get,
            "files_list": self.listing,
            "file_read": self.read,
            "file_delete": self.delete,
        }

    async def aclose(self) -> None:
        """Drop uploads in progress (nothing of them is kept)."""
        for upload in list(self._uploads.values()):
            self._drop(upload, "the worker is stopping")

    async def create(self, inbound: Inbound) -> None:
        message = inbound.envelope.file_create
        if message.purpose != "batch":
            raise IopError(
                pb.ERROR_CODE_INVALID_ARGUMENT,
                f"'{message.purpose}' is not a purpose this server takes; use 'batch'",
                param="purpose",
            )
        if message.bytes > self.max_bytes:
            raise _too_large(self.max_bytes)
        if len(self._uploads) >= _MAX_UPLOADS:
            raise IopError(pb.ERROR_CODE_RESOURCE_EXHAUSTED, f"{_MAX_UPLOADS} uploads are in progress", retryable=True)
        name = message.filename or "upload.jsonl"
        record = FileRecord(new_file_id(), name, "batch", 0, int(time.time()), caller=owner(inbound))
        upload = _Upload(f"up-{secrets.token_hex(8)}", record)
        upload.writer = asyncio.create_task(self.store.put_file(record, _chunks(upload.queue)))
        self._uploads[upload.id] = upload
        self._touch(upload)
        loop = asyncio.get_running_loop()
        upload.deadline = loop.call_later(_UPLOAD_MAX, self._drop, upload, f"open for over {_UPLOAD_MAX:g} s")
        await inbound.reply(pb.Envelope(file_upload_progress=pb.FileUploadProgress(upload_id=upload.id)))

    async def chunk(self, inbound: Inbound) -> None:
        message = inbound.envelope.file_chunk
        upload = self._uploads.get(message.upload_id)
        if upload is None or not sees(upload.record.caller, scope(inbound)):
            raise IopError(pb.ERROR_CODE_INVALID_ARGUMENT, f"no upload {message.upload_id!r}", param="upload_id")
        upload.received += len(message.data)
        if upload.received > self.max_bytes:
            self._drop(upload, "over the size limit")
            raise _too_large(self.max_bytes)
        self._touch(upload)
        assert upload.writer is not None
        if message.data:
            await _put(upload, message.data)
        if not message.last:
            progress = pb.FileUploadProgress(upload_id=upload.id, received=upload.received)
            await inbound.reply(pb.Envelope(file_upload_progress=progress))
            return
        await _put(upload, _END)
        del self._uploads[upload.id]
        _stop_timers(upload)
        stored = await upload.writer
        _log.info("file stored", file_id=stored.id, bytes=stored.bytes, filename=stored.filename)
        await inbound.reply(pb.Envelope(file_info=file_info(stored)))

    async def get(self, inbound: Inbound) -> None:
        record = await self.visible(inbound, inbound.envelope.file_get.file_id)
        await inbound.reply(pb.Envelope(file_info=file_info(record)))

    async def listing(self, inbound: Inbound) -> None:
        message = inbound.envelope.files_list
        limit = min(message.limit or rules.FILES_PAGE.default, rules.FILES_PAGE.maximum)
        records, more = await self.store.list_files(
            after=message.after or None, limit=limit, purpose=message.purpose or None, caller=scope(inbound)
        )
        listed = pb.FilesListed(files=[file_info(record) for record in records], has_more=more)
        await inbound.reply(pb.Envelope(files_listed=listed))

    async def read(self, inbound: Inbound) -> None:
        message = inbound.envelope.file_read
        record = await self.visible(inbound, message.file_id)
        length = min(message.length or _READ_DEFAULT, _READ_MAX)
        data = await self._piece(record, message.offset, length)
        eof = message.offset + len(data) >= record.bytes
        await inbound.reply(pb.Envelope(file_data=pb.FileData(data=data, eof=eof)))

    async def delete(self, inbound: Inbound) -> None:
        file_id = inbound.envelope.file_delete.file_id
        await self.visible(inbound, file_id)
        deleted = await self.store.delete_file(file_id)
        await inbound.reply(pb.Envelope(file_deleted=pb.FileDeleted(file_id=file_id, deleted=deleted)))

    async def visible(self, inbound: Inbound, file_id: str) -> FileRecord:
        """The file, if the request's caller may see it; else the error of an unknown one (a 404 at the edge)."""
        record = await self.store.get_file(file_id) if file_id else None
        if record is None or not sees(record.caller, scope(inbound)):
            raise IopError(pb.ERROR_CODE_NOT_FOUND, f"No such File object: {file_id[:ID_SHOWN]}", param="file_id")
        return record

    async def _piece(self, record: FileRecord, offset: int, length: int) -> bytes:
        """``length`` bytes of the file from ``offset``, continuing a download where it stopped."""
        reader, spare = self._readers.pop((record.id, offset), (None, b""))
        if reader is None:
            reader, spare = self.store.read_file(record.id), b""
            skip = offset
            while skip > 0:
                chunk = await anext(reader, _END)
                if not chunk:
                    return b""
                if len(chunk) > skip:
                    spare = chunk[skip:]
                    break
                skip -= len(chunk)
        parts, size = [spare] if spare else [], len(spare)
        while size < length:
            chunk = await anext(reader, _END)
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        data = b"".join(parts)
        piece, rest = data[:length], data[length:]
        if offset + len(piece) < record.bytes:
            self._readers[(record.id, offset + len(piece))] = (reader, rest)
            while len(self._readers) > _READERS:
                _, (old, _) = self._readers.popitem(last=False)
                with contextlib.suppress(Exception):
                    await old.aclose()  # type: ignore[attr-defined]
        return piece

    def _touch(self, upload: _Upload) -> None:
        if upload.idle is not None:
            upload.idle.cancel()
        loop = asyncio.get_running_loop()
        upload.idle = loop.call_later(_IDLE, self._drop, upload, f"no chunk for {_IDLE:g} s")

    def _drop(self, upload: _Upload, reason: str) -> None:
        if self._uploads.pop(upload.id, None) is None:
            return
        _stop_timers(upload)
        if upload.writer is not None:
            upload.writer.cancel()
        _log.warning("upload dropped", upload_id=upload.id, received=upload.received, reason=reason)

    async def sweep(self) -> int:
        """Delete uploads a dead worker left half written (every live one ends within ``_UPLOAD_MAX``)."""
        dropped = await self.store.drop_uploads(int(time.time() - 2 * _UPLOAD_MAX))
        if dropped:
            _log.warning("half-written uploads deleted", files=dropped, older_than=2 * _UPLOAD_MAX)
        return dropped

    async def sweep_forever(self, failures: Counter) -> None:
        """:meth:`sweep` now and every ``_SWEEP_EVERY`` seconds; a failure is logged, counted and tried again."""
        await repeat("sweep", self.sweep, functools.partial(asyncio.sleep, _SWEEP_EVERY), failures)


def _stop_timers(upload: _Upload) -> None:
    for timer in (upload.idle, upload.deadline):
        if timer is not None:
            timer.cancel()


async def _put(upload: _Upload, data: bytes) -> None:
    """Hand bytes to the store's writer; fails the request if the writer failed."""
    assert upload.writer is not None
    putting = asyncio.ensure_future(upload.queue.put(data))
    await asyncio.wait({putting, upload.writer}, return_when=asyncio.FIRST_COMPLETED)
    if not putting.done():
        putting.cancel()
        upload.writer.result()  # raises the writer's failure
        raise IopError(pb.ERROR_CODE_INTERNAL, "the upload's writer stopped")


async def _chunks(queue: asyncio.Queue[bytes]) -> AsyncIterator[bytes]:
    while chunk := await queue.get():
        yield chunk


def _too_large(limit: int) -> IopError:
    return IopError(
        pb.ERROR_CODE_FRAME_TOO_LARGE, f"the file is over this server's limit of {limit} bytes", param="file"
    )
