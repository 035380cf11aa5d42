"""OpenAI's Batch API, run by the worker: create, describe, list, cancel.

``POST /v1/batches`` is checked here as OpenAI checks it (each problem a 400 naming the field)
and sent as batch.create; every answer is a batch.info, shaped as OpenAI's batch object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from iop_edge.access import caller_of, read_body, serve_json
from iop_edge.files import list_object, page_limit, seconds
from iop_edge.keys import ApiKey
from iop_edge.worker import Worker
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.messages import BATCH_TIMES
from iop_wire.openai import batches as rules
from iop_wire.openai import requests as parse
from iop_wire.openai.errors import ApiError

if TYPE_CHECKING:
    from iop_edge.edge import Edge

__all__ = ["BatchRoutes", "batch_object", "batch_request"]

_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"})
_METADATA_PAIRS, _METADATA_KEY, _METADATA_VALUE = 16, 64, 512


def batch_request(data: Mapping[str, Any]) -> pb.BatchCreate:
    """A POST /v1/batches body, checked: 400 naming the first field that is wrong."""
    parse.known_fields(data, _FIELDS)
    input_file_id = parse.required(data, "input_file_id", str, "string")
    endpoint = parse.required(data, "endpoint", str, "string")
    if endpoint not in rules.ENDPOINTS:
        supported = ", ".join(f"'{name}'" for name in rules.ENDPOINTS)
        message = f"Invalid value: '{endpoint}'. Supported values are: {supported}."
        raise ApiError(400, message, param="endpoint", code="invalid_value")
    window = parse.required(data, "completion_window", str, "string")
    try:
        rules.window_seconds(window)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="completion_window", code="invalid_value") from None
    create = pb.BatchCreate(input_file_id=input_file_id, endpoint=endpoint, completion_window=window)
    create.metadata.update(_metadata(data.get("metadata")))
    return create


def _metadata(metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise ApiError(400, "Invalid type for 'metadata': expected an object.", param="metadata", code="invalid_type")
    if len(metadata) > _METADATA_PAIRS:
        message = f"Invalid 'metadata': too many properties. Expected at most {_METADATA_PAIRS}, got {len(metadata)}."
        raise ApiError(400, message, param="metadata", code="object_above_max_length")
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY:
            message = f"Invalid 'metadata': key '{key[:80]}' is longer than {_METADATA_KEY} characters."
            raise ApiError(400, message, param="metadata", code="string_above_max_length")
        where = f"metadata.{key}"
        if not isinstance(value, str):
            message = f"Invalid type for '{where}': expected a string, but got {parse.kind_of(value)} instead."
            raise ApiError(400, message, param=where, code="invalid_type")
        if len(value) > _METADATA_VALUE:
            message = f"Invalid '{where}': string too long. Expected at most {_METADATA_VALUE} characters."
            raise ApiError(400, message, param=where, code="string_above_max_length")
    return metadata


def batch_object(info: pb.BatchInfo) -> dict[str, Any]:
    """OpenAI's batch object (``Batch``).

    Unset times, files, errors and metadata are left out: OpenAI's API sends them as null, but its
    OpenAPI document types them as plain integers and strings, and its SDKs take either.
    """
    body: dict[str, Any] = {
        "id": info.id,
        "object": "batch",
        "endpoint": info.endpoint,
        "errors": _errors(info),
        "input_file_id": info.input_file_id,
        "completion_window": info.completion_window,
        "status": rules.STATUS_NAMES.get(info.status, "validating"),
        "output_file_id": info.output_file_id or None,
        "error_file_id": info.error_file_id or None,
    }
    body |= {name: seconds(getattr(info, name)) for name in BATCH_TIMES}  # unix seconds, or null
    body["created_at"] = body["created_at"] or 0  # the one OpenAI requires
    counts = info.request_counts
    body["request_counts"] = {"total": counts.total, "completed": counts.completed, "failed": counts.failed}
    body["metadata"] = dict(info.metadata) or None
    usage = info.usage
    body["usage"] = {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    return {name: value for name, value in body.items() if value is not None}


def _errors(info: pb.BatchInfo) -> dict[str, Any] | None:
    if not info.errors:
        return None
    data = [
        {
            "code": error.code,
            "message": error.message,
            "param": error.param or None,
            "line": error.line if error.HasField("line") else None,
        }
        for error in info.errors
    ]
    return {"object": "list", "data": data}


class BatchRoutes:
    """The /v1/batches routes."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.worker = Worker(edge.worker)

    def register(self, app: FastAPI) -> None:
        """Add the routes to ``app``."""
        app.add_api_route("/v1/batches", self.create, methods=["POST"])
        app.add_api_route("/v1/batches", self.list_batches, methods=["GET"])
        app.add_api_route("/v1/batches/{batch_id}", self.retrieve, methods=["GET"])
        app.add_api_route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"])

    async def create(self, request: Request) -> Response:
        """POST /v1/batches."""

        async def create(key: ApiKey | None) -> dict[str, Any]:
            http = self.edge.settings.http
            body = await read_body(request, http.max_body_bytes, http.body_timeout)
            batch = batch_request(parse.parse_body(body))
            ask = pb.Envelope(batch_create=batch)
            reply = await self.worker.ask(
                ask, "batch_info", caller=caller_of(key), about=batch.input_file_id, param="input_file_id"
            )
            return batch_object(reply.batch_info)

        return await serve_json(self.edge, "batches.create", request, create)

    async def list_batches(self, request: Request) -> Response:
        """GET /v1/batches: newest first."""

        async def page(key: ApiKey | None) -> dict[str, Any]:
            query = request.query_params
            listing = pb.BatchesList(after=query.get("after", ""))
            listing.limit = page_limit(query.get("limit"), rules.BATCHES_PAGE)
            reply = await self.worker.ask(pb.Envelope(batches_list=listing), "batches_listed", caller=caller_of(key))
            batches = [batch_object(info) for info in reply.batches_listed.batches]
            return list_object(batches, has_more=reply.batches_listed.has_more)

        return await serve_json(self.edge, "batches.list", request, page)

    async def retrieve(self, request: Request, batch_id: str) -> Response:
        """GET /v1/batches/{batch_id}."""

        async def describe(key: ApiKey | None) -> dict[str, Any]:
            get = pb.Envelope(batch_get=pb.BatchGet(batch_id=batch_id))
            return batch_object(
                (await self.worker.ask(get, "batch_info", caller=caller_of(key), about=batch_id)).batch_info
            )

        return await serve_json(self.edge, "batches.retrieve", request, describe)

    async def cancel(self, request: Request, batch_id: str) -> Response:
        """POST /v1/batches/{batch_id}/cancel."""

        async def cancel(key: ApiKey | None) -> dict[str, Any]:
            ask = pb.Envelope(batch_cancel=pb.BatchCancel(batch_id=batch_id))
            return batch_object(
                (await self.worker.ask(ask, "batch_info", caller=caller_of(key), about=batch_id)).batch_info
            )

        return await serve_json(self.edge, "batches.cancel", request, cancel)
