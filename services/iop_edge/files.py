"""OpenAI's Files API, kept by the worker: upload, list, describe, download, delete.

An upload (``POST /v1/files``, multipart/form-data with ``purpose`` then ``file``, the order
OpenAI's SDK sends them in) is streamed to the worker as it arrives, never held: the body is
parsed piece by piece (:mod:`iop_edge.forms`) and the file goes out on one connection as

    file.create {filename, purpose}            -> file.upload_progress {upload_id}
    file.chunk {upload_id, data: 256 KiB}      -> file.upload_progress     (each awaited)
    ...
    file.chunk {upload_id, data: rest, last}   -> file.info                (once the body ended)

Each chunk is awaited before the body is read further, so the edge holds at most one chunk
being sent and one being gathered, plus the piece uvicorn handed over. An upload that stops
(413, a malformed body, a client gone) is simply not continued: the worker drops uploads left
idle. A download (``GET /v1/files/{id}/content``) is file.read requests of 256 KiB, one at a
time, each written before the next is asked for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from iop_edge.access import authenticate, caller_of, declared_length, error_response, serve_json
from iop_edge.forms import CHUNK_SIZE, Field, FileBytes, FileEnd, FileStart, FormEvent, UploadForm
from iop_edge.keys import ApiKey
from iop_edge.worker import STORE_TIMEOUT, Worker
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection
from iop_wire.openai import batches as rules
from iop_wire.openai.errors import ApiError

if TYPE_CHECKING:
    from iop_edge.edge import Edge

_log = structlog.get_logger("iop.edge")

__all__ = [
    "FileRoutes",
    "check_purpose",
    "file_chunks",
    "file_object",
    "list_object",
    "page_limit",
    "read_file",
    "seconds",
]

UPLOAD_MAX = 3600.0
"""Seconds an upload may take in all (as long as the worker keeps one open)."""
MIN_UPLOAD_RATE = 16 * 1024
"""Bytes a second an upload must average once its first ``http.body_timeout`` seconds are over."""
_FORM_SLACK = 64 * 1024
"""Bytes a form may hold besides its file (boundaries, headers, fields) before Content-Length alone is a 413."""


def seconds(timestamp: Any) -> int | None:
    """A set ``google.protobuf.Timestamp`` as unix seconds; None when unset (zero)."""
    return int(timestamp.seconds) if timestamp.seconds or timestamp.nanos else None


def file_object(info: pb.FileInfo) -> dict[str, Any]:
    """OpenAI's file object (``OpenAIFile``); ``expires_at`` only when set (its spec has no null)."""
    body: dict[str, Any] = {
        "id": info.id,
        "object": "file",
        "bytes": info.bytes,
        "created_at": seconds(info.created_at) or 0,
        "filename": info.filename,
        "purpose": info.purpose,
        "status": "processed",
    }
    expires_at = seconds(info.expires_at)
    if expires_at is not None:
        body["expires_at"] = expires_at
    return body


class FileRoutes:
    """The /v1/files routes."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.worker = Worker(edge.worker)

    def register(self, app: FastAPI) -> None:
        """Add the routes to ``app``."""
        app.add_api_route("/v1/files", self.create, methods=["POST"])
        app.add_api_route("/v1/files", self.list_files, methods=["GET"])
        app.add_api_route("/v1/files/{file_id}", self.retrieve, methods=["GET"])
        app.add_api_route("/v1/files/{file_id}", self.delete, methods=["DELETE"])
        app.add_api_route("/v1/files/{file_id}/content", self.content, methods=["GET"])

    async def create(self, request: Request) -> Response:
        """POST /v1/files: the upload streamed to the worker."""

        async def upload(key: ApiKey | None) -> dict[str, Any]:
            return file_object(await self._upload(request, caller_of(key)))

        return await serve_json(self.edge, "files.create", request, upload)

    async def list_files(self, request: Request) -> Response:
        """GET /v1/files: newest first (``order=desc``, the default, is the only order)."""

        async def page(key: ApiKey | None) -> dict[str, Any]:
            query = request.query_params
            if query.get("order", "desc") != "desc":
                raise ApiError(400, "this server lists files newest first only: order must be 'desc'", param="order")
            listing = pb.FilesList(after=query.get("after", ""), purpose=query.get("purpose", ""))
            listing.limit = page_limit(query.get("limit"), rules.FILES_PAGE)
            reply = await self.worker.ask(pb.Envelope(files_list=listing), "files_listed", caller=caller_of(key))
            files = [file_object(info) for info in reply.files_listed.files]
            return list_object(files, has_more=reply.files_listed.has_more)

        return await serve_json(self.edge, "files.list", request, page)

    async def retrieve(self, request: Request, file_id: str) -> Response:
        """GET /v1/files/{file_id}."""

        async def describe(key: ApiKey | None) -> dict[str, Any]:
            get = pb.Envelope(file_get=pb.FileGet(file_id=file_id))
            return file_object(
                (await self.worker.ask(get, "file_info", caller=caller_of(key), about=file_id)).file_info
            )

        return await serve_json(self.edge, "files.retrieve", request, describe)

    async def delete(self, request: Request, file_id: str) -> Response:
        """DELETE /v1/files/{file_id}."""

        async def delete(key: ApiKey | None) -> dict[str, Any]:
            ask = pb.Envelope(file_delete=pb.FileDelete(file_id=file_id))
            deleted = (await self.worker.ask(ask, "file_deleted", caller=caller_of(key), about=file_id)).file_deleted
            return {"id": deleted.file_id or file_id, "object": "file", "deleted": deleted.deleted}

        return await serve_json(self.edge, "files.delete", request, delete)

    async def content(self, request: Request, file_id: str) -> Response:
        """GET /v1/files/{file_id}/content: the bytes, read from the worker as they are sent."""
        requests = self.edge.metrics.requests
        try:
            caller = caller_of(authenticate(self.edge.keys, request))
            first = await self._read(file_id, 0, caller)  # an unknown file is a 404 before any header leaves
        except ApiError as error:
            requests.labels("files.content", "", str(error.status)).inc()
            return error_response(error)
        requests.labels("files.content", "", "200").inc()
        return StreamingResponse(self._content(file_id, first, caller), media_type="application/octet-stream")

    async def _content(self, file_id: str, data: pb.FileData, caller: str) -> AsyncIterator[bytes]:
        async for chunk in file_chunks(self.worker, file_id, data, caller):
            yield chunk

    async def _read(self, file_id: str, offset: int, caller: str) -> pb.FileData:
        return await read_file(self.worker, file_id, offset, caller)

    async def _upload(self, request: Request, caller: str) -> pb.FileInfo:
        limit = self.edge.settings.http.max_file_bytes
        if (declared := declared_length(request)) is not None and declared > limit + _FORM_SLACK:
            self.edge.metrics.refused.labels("file_size").inc()
            raise ApiError(413, f"the request body is {declared} bytes, over this edge's file limit of {limit}")
        form = UploadForm(request.headers.get("content-type", ""))
        upload = _Upload(self.worker, limit, caller)
        pace = _Pace(asyncio.get_running_loop().time(), self.edge.settings.http.body_timeout)
        pieces = aiter(request.stream())
        try:
            while (piece := await pace.next_piece(pieces)) is not None:
                for event in form.feed(piece):
                    await upload.take(event)
        except TimeoutError:
            self.edge.metrics.refused.labels("upload_too_slow").inc()
            _log.warning("upload too slow", received=pace.received, why=pace.why)
            message = f"the upload is too slow: {pace.why}; {pace.received} bytes came"
            raise ApiError(408, message, code="timeout") from None
        except ClientDisconnect:
            raise ApiError(499, "the client closed the request", code="cancelled") from None
        except ApiError as error:
            if error.status == 413:
                self.edge.metrics.refused.labels("file_size").inc()
            raise
        form.close()
        return await upload.finish()


class _Pace:
    """How long an upload may wait for its next piece: the least of three bounds, each a 408.

    ``idle`` (http.body_timeout) with no byte; :data:`UPLOAD_MAX` in all (the worker's own bound);
    and, after the first ``idle`` seconds, an average of :data:`MIN_UPLOAD_RATE`: a client
    trickling a byte a minute holds a connection and a worker upload for minutes, not an hour.
    """

    def __init__(self, started: float, idle: float) -> None:
        self.started, self.idle = started, idle
        self.received = 0
        """Bytes of the body so far."""
        self.why = ""
        """Which bound the last wait hit."""

    async def next_piece(self, pieces: AsyncIterator[bytes]) -> bytes | None:
        """The next piece of the body, None at its end; TimeoutError past the first bound due."""
        now = asyncio.get_running_loop().time()
        paced = self.started + self.idle + self.received / MIN_UPLOAD_RATE  # when the average falls under
        bounds = {
            f"no data for {self.idle:g} s (http.body_timeout)": now + self.idle,
            f"not done within {UPLOAD_MAX:g} s": self.started + UPLOAD_MAX,
            f"under {MIN_UPLOAD_RATE // 1024} KiB/s on average": paced,
        }
        self.why, deadline = min(bounds.items(), key=lambda bound: bound[1])
        async with asyncio.timeout_at(deadline):
            piece = await anext(pieces, None)
        self.received += len(piece or b"")
        return piece


class _Upload:
    """One upload's progress: the form's events turned into the worker's requests."""

    def __init__(self, worker: Worker, limit: int, caller: str) -> None:
        self.worker, self.limit, self.caller = worker, limit, caller
        self.purpose: str | None = None
        self.connection: Connection | None = None
        self.upload_id = ""
        self.received = 0
        self.rest: bytes | None = None
        """The file's last bytes, sent (last=true) once the whole body has been read."""

    async def take(self, event: FormEvent) -> None:
        match event:
            case Field(name="purpose", value=value):
                self.purpose = check_purpose(value)
            case Field(name=name) if name.startswith("expires_after"):
                pass  # the worker decides when files expire; OpenAI's field is accepted, not used
            case Field(name="file"):
                raise ApiError(400, "'file' must be a file part (with a filename), not a text field", param="file")
            case Field(name=name):
                raise ApiError(400, f"Unrecognized request argument supplied: {name}")
            case FileStart(name=name, filename=filename):
                await self._open(name, filename)
            case FileBytes(data=data):
                await self._send(data)
            case FileEnd(data=data):
                self._count(len(data))
                self.rest = data

    async def _open(self, name: str, filename: str) -> None:
        if name != "file":
            raise ApiError(400, f"Unrecognized request argument supplied: {name}")
        if self.connection is not None:
            raise ApiError(400, "send one file per request", param="file")
        if self.purpose is None:
            message = "'purpose' must come before 'file' in the form (OpenAI's SDK sends it first)"
            raise ApiError(400, message, param="purpose")
        self.connection = self.worker.connection()  # every chunk of an upload goes on this one
        create = pb.Envelope(file_create=pb.FileCreate(filename=filename, purpose=self.purpose))
        reply = await self.worker.ask(create, "file_upload_progress", caller=self.caller, connection=self.connection)
        self.upload_id = reply.file_upload_progress.upload_id

    async def _send(self, data: bytes, *, last: bool = False) -> pb.Envelope:
        self._count(0 if last else len(data))
        chunk = pb.Envelope(file_chunk=pb.FileChunk(upload_id=self.upload_id, data=data, last=last))
        if last:
            return await self.worker.ask(
                chunk, "file_info", caller=self.caller, connection=self.connection, timeout=STORE_TIMEOUT
            )
        return await self.worker.ask(chunk, "file_upload_progress", caller=self.caller, connection=self.connection)

    def _count(self, size: int) -> None:
        self.received += size
        if self.received > self.limit:
            raise ApiError(413, f"the file is over this edge's limit of {self.limit} bytes (http.max_file_bytes)")

    async def finish(self) -> pb.FileInfo:
        """The last chunk sent; the stored file's description."""
        if self.rest is None:
            if self.purpose is None:
                raise ApiError(400, "Missing required parameter: 'purpose'.", param="purpose")
            raise ApiError(400, "Missing required parameter: 'file'.", param="file")
        return (await self._send(self.rest, last=True)).file_info


async def read_file(
    worker: Worker, file_id: str, offset: int, caller: str, connection: Connection | None = None
) -> pb.FileData:
    """One piece of a file of ``caller``'s (on ``connection``, else any), from ``offset``."""
    read = pb.Envelope(file_read=pb.FileRead(file_id=file_id, offset=offset, length=CHUNK_SIZE))
    return (await worker.ask(read, "file_data", caller=caller, about=file_id, connection=connection)).file_data


async def file_chunks(
    worker: Worker, file_id: str, data: pb.FileData, caller: str, connection: Connection | None = None
) -> AsyncIterator[bytes]:
    """A file's bytes from its first piece ``data`` on, each next piece read once the last is taken."""
    offset = 0
    while True:
        yield data.data
        offset += len(data.data)
        if data.eof:
            return
        if not data.data:  # no progress and no end: stop rather than ask forever
            raise ApiError(502, "the worker sent an empty piece before the end of the file", code="backend_error")
        data = await read_file(worker, file_id, offset, caller, connection)


def check_purpose(value: str) -> str:
    """``purpose`` as given; 400 for any the worker does not keep."""
    if value not in rules.PURPOSES:
        supported = ", ".join(f"'{purpose}'" for purpose in rules.PURPOSES)
        message = f"Invalid value for 'purpose': '{value}'. This server stores files for the Batch API: {supported}."
        raise ApiError(400, message, param="purpose", code="invalid_value")
    return value


def page_limit(value: str | None, page: rules.Page) -> int:
    """A list's ``limit`` query parameter; 400 naming ``limit`` unless a whole number from 1 to the page's cap."""
    try:
        return rules.page_limit(value, page)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="limit", code="invalid_value") from None


def list_object(data: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: ``{object: list, data, first_id, last_id, has_more}`` (the ids null when empty)."""
    first_id = data[0]["id"] if data else None
    last_id = data[-1]["id"] if data else None
    return {"object": "list", "data": data, "first_id": first_id, "last_id": last_id, "has_more": has_more}
