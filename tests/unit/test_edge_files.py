"""The edge's Files and Batch API without a worker or sockets: the streaming form parser, the
batch request checks, the OpenAI shapes (against OpenAI's spec and SDK), and the routes driven
over ASGI against a scripted stand-in for the worker's connection."""

from __future__ import annotations

import asyncio
import json
import random
import typing
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from e2e.openai_schema import validate
from openai.types import Batch, FileDeleted, FileObject

from iop_edge.app import Edge, build_app
from iop_edge.batches import batch_object, batch_request
from iop_edge.files import file_object, list_object
from iop_edge.forms import CHUNK_SIZE, Field, FileBytes, FileEnd, FileStart, FormEvent, UploadForm
from iop_edge.metrics import EdgeMetrics
from iop_edge.settings import Settings
from iop_edge.upstream import Upstream
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import IopError
from iop_wire.openai import batches as rules
from iop_wire.openai.errors import ApiError, from_worker

_BOUNDARY = "iop-test-boundary"
_FORM = f"multipart/form-data; boundary={_BOUNDARY}"


def _form(*parts: tuple[str, str | None, bytes]) -> bytes:
    """A multipart body of (name, filename or None, content) parts."""
    out = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{_BOUNDARY}\r\nContent-Disposition: {disposition}\r\n".encode()
        out += b"Content-Type: application/octet-stream\r\n" if filename else b""
        out += b"\r\n" + content + b"\r\n"
    return out + f"--{_BOUNDARY}--\r\n".encode()


def _pieces(body: bytes, seed: int = 1) -> list[bytes]:
    """``body`` cut at random places into pieces of 1 byte to 100 KiB."""
    rng, pieces, at = random.Random(seed), [], 0
    while at < len(body):
        size = rng.choice((1, 7, 4093, 65536, 100_000))
        pieces.append(body[at : at + size])
        at += size
    return pieces


def _refused(call: Callable[..., Any], *args: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)
    return caught.value


# -- the form parser ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_form_fed_in_odd_pieces_gives_its_fields_and_the_file_in_bounded_chunks(seed: int) -> None:
    content = random.Random(seed).randbytes(3 * CHUNK_SIZE + 1234)
    body = _form(("purpose", None, b"batch"), ("file", "in.jsonl", content))
    form = UploadForm(_FORM)
    events: list[FormEvent] = []
    for piece in _pieces(body, seed):
        events += form.feed(piece)
    form.close()
    assert events[0] == Field("purpose", "batch")
    assert events[1] == FileStart("file", "in.jsonl")
    chunks = events[2:-1]
    assert all(isinstance(chunk, FileBytes) and len(chunk.data) == CHUNK_SIZE for chunk in chunks)
    end = events[-1]
    assert isinstance(end, FileEnd) and end.size == len(content) and 0 < len(end.data) <= CHUNK_SIZE
    assert b"".join(event.data for event in events if isinstance(event, FileBytes | FileEnd)) == content


def test_a_file_of_whole_chunks_ends_with_a_full_chunk_and_an_empty_file_with_nothing() -> None:
    form = UploadForm(_FORM, chunk_size=4)
    events = form.feed(_form(("file", "a.jsonl", b"12345678"), ("file", "b.jsonl", b"")))
    data = [(type(event).__name__, getattr(event, "data", None)) for event in events]
    assert data == [
        ("FileStart", None),
        ("FileBytes", b"1234"),
        ("FileEnd", b"5678"),
        ("FileStart", None),
        ("FileEnd", b""),
    ]


def test_a_form_holds_at_most_one_chunk_of_the_file_between_pieces() -> None:
    form = UploadForm(_FORM, chunk_size=1000)
    body = _form(("file", "a.jsonl", b"x" * 10_000))
    for piece in _pieces(body, 4):
        form.feed(piece)
        assert len(form._data) <= 1000


def test_a_body_that_is_not_a_form_or_stops_early_or_has_a_huge_field_is_a_400() -> None:
    assert _refused(UploadForm, "application/json").status == 400
    truncated = UploadForm(_FORM)
    truncated.feed(_form(("purpose", None, b"batch"))[:-10])
    assert _refused(truncated.close).status == 400
    assert _refused(UploadForm(_FORM).feed, _form(("purpose", None, b"x" * 70_000))).status == 400
    assert _refused(UploadForm(_FORM).feed, b"--wrong\r\n\r\n" * 3).status == 400


# -- batch requests -------------------------------------------------------------------------------

_BATCH: dict[str, Any] = {"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "24h"}


def test_a_batch_request_becomes_batch_create() -> None:
    create = batch_request({**_BATCH, "metadata": {"team": "search"}})
    assert create.input_file_id == "file-1" and create.endpoint == "/v1/chat/completions"
    assert create.completion_window == "24h" and dict(create.metadata) == {"team": "search"}
    assert batch_request({**_BATCH, "completion_window": "10m", "metadata": None}).completion_window == "10m"


@pytest.mark.parametrize(("window", "seconds"), [("24h", 86_400), ("1d", 86_400), ("10m", 600), ("90s", 90)])
def test_edge_and_worker_take_the_same_windows(window: str, seconds: int) -> None:
    """One rule (iop_wire.openai.batches): the edge refused ``1d`` while the worker took it."""
    assert batch_request({**_BATCH, "completion_window": window}).completion_window == window
    assert rules.window_seconds(window) == seconds


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"endpoint": "/v1/responses"}, "endpoint"),
        ({"endpoint": 3}, "endpoint"),
        ({"completion_window": "1w"}, "completion_window"),
        ({"completion_window": "0d"}, "completion_window"),
        ({"completion_window": "9" * 5000 + "h"}, "completion_window"),
        ({"completion_window": "0h"}, "completion_window"),
        ({"input_file_id": None}, "input_file_id"),
        ({"input_file_id": ["file-1"]}, "input_file_id"),
        ({"metadata": ["a"]}, "metadata"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"n": 1}}, "metadata.n"),
        ({"metadata": {"long": "v" * 513}}, "metadata.long"),
    ],
)
def test_a_bad_batch_request_is_a_400_naming_the_field(change: dict[str, Any], param: str) -> None:
    error = _refused(batch_request, {**_BATCH, **change})
    assert (error.status, error.param) == (400, param)


def test_an_unknown_batch_field_is_a_400() -> None:
    error = _refused(batch_request, {**_BATCH, "priority": 1})
    assert error.status == 400 and "priority" in error.message


# -- shapes ---------------------------------------------------------------------------------------


def _file_info(file_id: str = "file-abc", *, expires: bool = True) -> pb.FileInfo:
    info = pb.FileInfo(id=file_id, filename="in.jsonl", purpose="batch", bytes=1234)
    info.created_at.FromSeconds(1_700_000_000)
    if expires:
        info.expires_at.FromSeconds(1_702_592_000)
    return info


def _batch_info(status: pb.BatchStatus.ValueType = pb.BATCH_STATUS_COMPLETED) -> pb.BatchInfo:
    info = pb.BatchInfo(
        id="batch_abc",
        endpoint="/v1/chat/completions",
        input_file_id="file-abc",
        completion_window="24h",
        status=status,
        output_file_id="file-out",
        request_counts=pb.BatchRequestCounts(total=3, completed=2, failed=1),
        usage=pb.Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=2),
    )
    for name in ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at"):
        getattr(info, name).FromSeconds(1_700_000_000)
    info.metadata["team"] = "search"
    return info


def test_a_file_is_an_openai_file_object() -> None:
    body = file_object(_file_info())
    assert body["object"] == "file" and body["status"] == "processed" and body["expires_at"] == 1_702_592_000
    validate("OpenAIFile", (body))
    FileObject.model_validate(body)
    assert "expires_at" not in file_object(_file_info(expires=False))
    validate("ListFilesResponse", (list_object([body], has_more=False)))
    validate("DeleteFileResponse", {"id": "file-abc", "object": "file", "deleted": True})
    FileDeleted.model_validate({"id": "file-abc", "object": "file", "deleted": True})


def test_a_batch_is_an_openai_batch_object() -> None:
    body = batch_object(_batch_info())
    assert body["status"] == "completed" and body["output_file_id"] == "file-out"
    assert not {"error_file_id", "failed_at", "errors"} & body.keys()  # unset: left out, the spec has no null
    assert body["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert body["usage"]["total_tokens"] == 15 and body["usage"]["input_tokens_details"]["cached_tokens"] == 2
    assert body["metadata"] == {"team": "search"}
    validate("Batch", (body))
    Batch.model_validate(body)
    validate("ListBatchesResponse", (list_object([body], has_more=True)))


def test_a_failed_batch_lists_its_errors() -> None:
    info = _batch_info(pb.BATCH_STATUS_FAILED)
    info.errors.append(pb.BatchError(code="invalid_json_line", message="line 2 is not JSON", line=2))
    info.errors.append(pb.BatchError(code="empty_file", message="no lines", param="input_file_id"))
    body = batch_object(info)
    assert body["errors"] == {
        "object": "list",
        "data": [
            {"code": "invalid_json_line", "message": "line 2 is not JSON", "param": None, "line": 2},
            {"code": "empty_file", "message": "no lines", "param": "input_file_id", "line": None},
        ],
    }
    validate("Batch", (body))
    Batch.model_validate(body)


@pytest.mark.parametrize(
    ("status", "name"),
    [
        (getattr(pb, f"BATCH_STATUS_{name.upper()}"), name)
        for name in typing.get_args(Batch.model_fields["status"].annotation)
    ],
)
def test_every_batch_status_has_its_openai_name(status: pb.BatchStatus.ValueType, name: str) -> None:
    assert batch_object(_batch_info(status))["status"] == name


def test_an_unknown_id_from_the_worker_is_a_404() -> None:
    unknown = IopError(pb.ERROR_CODE_NOT_FOUND, "no such file", param="file_id")
    error = from_worker(unknown, "file-zz")
    assert (error.status, error.message, error.type) == (404, "No such File object: file-zz", "invalid_request_error")
    batch = from_worker(IopError(pb.ERROR_CODE_NOT_FOUND, "no", param="batch_id"), "batch_1")
    assert (batch.status, batch.message) == (404, "No such Batch object: batch_1")
    assert len(from_worker(IopError(pb.ERROR_CODE_NOT_FOUND, "no", param="file_id"), "f" * 10**6).message) < 200
    assert from_worker(IopError(pb.ERROR_CODE_INVALID_ARGUMENT, "bad", param="file_id"), "x").status == 400
    assert from_worker(IopError(pb.ERROR_CODE_FRAME_TOO_LARGE, "big"), "x").status == 413


# -- the routes, over ASGI, against a scripted worker connection ----------------------------------


@dataclass
class _Worker:
    """Stands in for a connection to the worker: records each request and answers as the worker would."""

    files: dict[str, bytes] = field(default_factory=dict)
    sent: list[pb.Envelope] = field(default_factory=list)
    address: str = "127.0.0.1:7500"
    upload: bytearray = field(default_factory=bytearray)

    def connection(self) -> _Worker:
        return self

    async def request(self, envelope: pb.Envelope, timeout: float = 10.0) -> pb.Envelope:
        self.sent.append(envelope)
        kind = envelope.WhichOneof("body")
        if kind == "file_create":
            return pb.Envelope(file_upload_progress=pb.FileUploadProgress(upload_id="up-1"))
        if kind == "file_chunk":
            self.upload += envelope.file_chunk.data
            if not envelope.file_chunk.last:
                return pb.Envelope(
                    file_upload_progress=pb.FileUploadProgress(upload_id="up-1", received=len(self.upload))
                )
            self.files["file-new"] = bytes(self.upload)
            info = _file_info("file-new")
            info.bytes = len(self.upload)
            return pb.Envelope(file_info=info)
        if kind == "file_read":
            read = envelope.file_read
            content = self.files.get(read.file_id)
            if content is None:
                raise IopError(pb.ERROR_CODE_NOT_FOUND, "unknown file", param="file_id")
            data = content[read.offset : read.offset + read.length]
            return pb.Envelope(file_data=pb.FileData(data=data, eof=read.offset + len(data) >= len(content)))
        if kind == "batch_create":
            return pb.Envelope(batch_info=_batch_info(pb.BATCH_STATUS_VALIDATING))
        raise IopError(pb.ERROR_CODE_NOT_FOUND, "unknown batch", param="batch_id")


def _edge(worker: _Worker | None, **http: Any) -> Edge:
    settings = Settings(auth="none", http=http)
    return Edge(settings=settings, upstream=Upstream(settings), metrics=EdgeMetrics(), worker=worker)  # type: ignore[arg-type]  # a scripted pool


async def _call(
    edge: Edge, method: str, path: str, pieces: tuple[bytes, ...] = (), headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request through the ASGI app: the body in ``pieces``, the answer gathered."""
    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()],
        "server": ("edge", 80),
        "client": ("client", 1),
    }
    messages = [{"type": "http.request", "body": piece, "more_body": True} for piece in pieces]
    messages.append({"type": "http.request", "body": b"", "more_body": False})
    sent: list[dict[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    await build_app(edge)(scope, receive, send)
    start = sent[0]
    answer_headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], answer_headers, b"".join(m.get("body", b"") for m in sent[1:])


async def _upload(edge: Edge, body: bytes) -> tuple[int, dict[str, Any]]:
    status, _, answer = await _call(edge, "POST", "/v1/files", tuple(_pieces(body)), {"content-type": _FORM})
    return status, json.loads(answer)


async def test_an_upload_streams_to_the_worker_in_bounded_chunks_and_answers_the_file() -> None:
    worker = _Worker()
    content = random.Random(5).randbytes(2 * CHUNK_SIZE + 17)
    status, body = await _upload(_edge(worker), _form(("purpose", None, b"batch"), ("file", "in.jsonl", content)))
    assert status == 200, body
    assert body["id"] == "file-new" and body["bytes"] == len(content) and body["object"] == "file"
    kinds = [envelope.WhichOneof("body") for envelope in worker.sent]
    assert kinds == ["file_create", "file_chunk", "file_chunk", "file_chunk"]
    assert worker.sent[0].file_create.filename == "in.jsonl" and worker.sent[0].file_create.purpose == "batch"
    chunks = [envelope.file_chunk for envelope in worker.sent[1:]]
    assert [len(chunk.data) for chunk in chunks] == [CHUNK_SIZE, CHUNK_SIZE, 17]
    assert [chunk.last for chunk in chunks] == [False, False, True]
    assert {chunk.upload_id for chunk in chunks} == {"up-1"} and bytes(worker.upload) == content


@pytest.mark.parametrize(
    ("parts", "param"),
    [
        ((("file", "in.jsonl", b"{}"), ("purpose", None, b"batch")), "purpose"),
        ((("purpose", None, b"fine-tune"), ("file", "in.jsonl", b"{}")), "purpose"),
        ((("purpose", None, b"batch"),), "file"),
        ((("purpose", None, b"batch"), ("file", None, b"{}")), "file"),
    ],
)
async def test_a_bad_upload_is_a_400_naming_the_field(
    parts: tuple[tuple[str, str | None, bytes], ...], param: str
) -> None:
    worker = _Worker()
    status, body = await _upload(_edge(worker), _form(*parts))
    assert (status, body["error"]["param"]) == (400, param)
    assert not any(envelope.file_chunk.last for envelope in worker.sent)


async def test_a_file_over_the_limit_is_a_413_and_the_upload_is_never_finished() -> None:
    worker = _Worker()
    edge = _edge(worker, max_file_bytes=CHUNK_SIZE + 10)
    status, body = await _upload(edge, _form(("purpose", None, b"batch"), ("file", "in.jsonl", b"x" * 2 * CHUNK_SIZE)))
    assert status == 413, body
    assert not any(envelope.file_chunk.last for envelope in worker.sent)


async def test_without_a_worker_files_and_batches_are_a_503_naming_the_setting() -> None:
    edge = _edge(None)
    status, _, answer = await _call(edge, "GET", "/v1/files")
    assert status == 503 and "worker.address" in json.loads(answer)["error"]["message"]
    status, _, _ = await _call(edge, "GET", "/v1/batches/batch_1")
    assert status == 503


async def test_a_file_content_is_read_in_pieces_and_an_unknown_file_is_a_404() -> None:
    content = random.Random(6).randbytes(CHUNK_SIZE + 5)
    worker = _Worker(files={"file-a": content})
    status, headers, answer = await _call(_edge(worker), "GET", "/v1/files/file-a/content")
    assert status == 200 and answer == content and headers["content-type"] == "application/octet-stream"
    assert [envelope.file_read.offset for envelope in worker.sent] == [0, CHUNK_SIZE]
    status, _, answer = await _call(_edge(worker), "GET", "/v1/files/file-zz/content")
    assert status == 404 and json.loads(answer)["error"]["message"] == "No such File object: file-zz"


async def test_a_batch_is_created_checked_and_an_unknown_one_is_a_404() -> None:
    worker = _Worker()
    edge = _edge(worker)
    status, _, answer = await _call(edge, "POST", "/v1/batches", (json.dumps(_BATCH).encode(),))
    assert status == 200 and json.loads(answer)["status"] == "validating"
    assert worker.sent[-1].batch_create.input_file_id == "file-1"
    status, _, answer = await _call(
        edge, "POST", "/v1/batches", (json.dumps({**_BATCH, "endpoint": "/v1/x"}).encode(),)
    )
    assert (status, json.loads(answer)["error"]["param"]) == (400, "endpoint")
    status, _, answer = await _call(edge, "POST", "/v1/batches/batch_zz/cancel")
    assert status == 404 and json.loads(answer)["error"]["message"] == "No such Batch object: batch_zz"
    status, _, answer = await _call(edge, "GET", "/v1/batches?limit=101")
    assert (status, json.loads(answer)["error"]["param"]) == (400, "limit")


async def test_openai_fields_the_worker_does_not_use_are_accepted_and_unknown_ones_refused() -> None:
    parts: list[tuple[str, str | None, bytes]] = [("purpose", None, b"batch"), ("expires_after[anchor]", None, b"x")]
    parts += [("expires_after[seconds]", None, b"3600"), ("file", "in.jsonl", b"{}\n")]
    status, body = await _upload(_edge(_Worker()), _form(*parts))
    assert status == 200 and body["bytes"] == 3
    status, body = await _upload(_edge(_Worker()), _form(("purpose", None, b"batch"), ("colour", None, b"red")))
    assert status == 400 and "colour" in body["error"]["message"]


# -- hostile requests: OpenAI's error shape and the right status, never a 500 ---------------------


@pytest.mark.parametrize(
    "limit",
    ["%C2%B2", "9" * 4300, "0", "-1", "1.5", "%EF%BC%91"],  # ², a 4,300-digit number, 0, -1, 1.5, a fullwidth 1
)
@pytest.mark.parametrize("path", ["/v1/files", "/v1/batches"])
async def test_a_bad_list_limit_is_a_400_naming_limit(path: str, limit: str) -> None:
    status, _, answer = await _call(_edge(_Worker()), "GET", f"{path}?limit={limit}")
    error = json.loads(answer)["error"]
    assert (status, error["param"], error["type"]) == (400, "limit", "invalid_request_error")
    assert len(error["message"]) < 200  # the 4,300 digits are not said back


async def test_a_multipart_boundary_over_256_characters_is_a_400() -> None:
    worker = _Worker()
    headers = {"content-type": "multipart/form-data; boundary=" + "b" * 300}
    status, _, answer = await _call(_edge(worker), "POST", "/v1/files", (b"--" + b"b" * 300 + b"\r\n",), headers)
    assert status == 400 and "boundary" in json.loads(answer)["error"]["message"]
    assert worker.sent == []


async def _upload_then(edge: Edge, after: Callable[[], Any], first: int = 2 * CHUNK_SIZE) -> tuple[int, dict[str, Any]]:
    """An upload whose body stops after its ``first`` bytes: ``after()`` is what the client does then."""
    body = _form(("purpose", None, b"batch"), ("file", "in.jsonl", b"x" * 3 * CHUNK_SIZE))
    pieces = [body[:first]]
    sent: list[dict[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        if pieces:
            return {"type": "http.request", "body": pieces.pop(), "more_body": True}
        return await after()  # type: ignore[no-any-return]

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/files",
        "raw_path": b"/v1/files",
        "query_string": b"",
        "headers": [(b"content-type", _FORM.encode())],
        "server": ("edge", 80),
        "client": ("client", 1),
    }
    await build_app(edge)(scope, receive, send)
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


async def test_a_client_gone_mid_upload_is_a_499_and_the_upload_is_never_finished() -> None:
    async def gone() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    worker = _Worker()
    status, body = await _upload_then(_edge(worker), gone)
    assert status == 499 and body["error"]["code"] == "cancelled"
    assert [envelope.WhichOneof("body") for envelope in worker.sent][:2] == ["file_create", "file_chunk"]
    assert not any(envelope.file_chunk.last for envelope in worker.sent)


async def test_an_upload_that_stops_sending_is_a_408_after_the_body_timeout() -> None:
    async def silent() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    worker = _Worker()
    status, body = await asyncio.wait_for(_upload_then(_edge(worker, body_timeout=0.2), silent), 30)
    assert status == 408 and body["error"]["code"] == "timeout"
    assert "http.body_timeout" in body["error"]["message"]
    assert not any(envelope.file_chunk.last for envelope in worker.sent)


async def test_an_upload_trickling_under_the_minimum_rate_is_a_408() -> None:
    """A byte every 50 ms never leaves the idle bound, but its average is far under 16 KiB/s."""

    async def trickle() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}

    worker = _Worker()
    status, body = await asyncio.wait_for(_upload_then(_edge(worker, body_timeout=0.5), trickle, first=1024), 30)
    assert status == 408 and "KiB/s" in body["error"]["message"]
