"""OpenAI's completions usage API (``GET /v1/organization/usage/completions``), from the control-plane's ledger.

Admin keys only (403 otherwise). OpenAI's shape (``UsageResponse`` of ``UsageTimeBucket`` of
``UsageCompletionsResult``): every bucket of the range, empty ones too, ``limit`` buckets a page,
``next_page`` the cursor of the next (the next bucket's start). ``api_key_id`` is the key's name.
The platform keeps hours and days: ``bucket_width=1m`` is refused (400 naming it), as are group
fields it does not have (projects, users, batch, service tier).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from iop_edge.access import JSON, error_response
from iop_edge.console import Who, ask_control_plane, who
from iop_edge.views import seconds
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import IopError
from iop_wire.openai.errors import ApiError, from_iop
from iop_wire.openai.responses import json_bytes

if TYPE_CHECKING:
    from starlette.datastructures import QueryParams

    from iop_edge.edge import Edge

__all__ = ["UsageRoutes"]

_WIDTHS = {
    "1h": (3600, pb.USAGE_BUCKET_HOUR, 24, 168),
    "1d": (86_400, pb.USAGE_BUCKET_DAY, 7, 31),
}
"""bucket_width -> seconds, usage.list's bucket, default and largest ``limit`` (OpenAI's)."""
_UNSUPPORTED = ("project_ids", "user_ids", "batch")
"""OpenAI's filters this platform has nothing for (no projects, users, or batch flag on runs)."""
_GROUPS = ("api_key_id", "model")
_LATEST = 1e11
"""Past any plausible unix time: a larger start_time or end_time is refused."""
_DIGITS = 20
"""Longest integer parameter read (``int`` refuses 4,300 digits)."""


def _integer(query: QueryParams, name: str, *, required: bool = False) -> int | None:
    value = query.get(name)
    if value is None or value == "":
        if required:
            raise ApiError(400, f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= _DIGITS) or int(value) >= _LATEST:
        message = f"Invalid '{name}': expected an integer (unix seconds or a count), got {value[:40]!r}."
        raise ApiError(400, message, param=name, code="invalid_value")
    return int(value)


class _Question:
    """The request's parameters, checked (400 naming the first bad one)."""

    def __init__(self, query: QueryParams, now: float) -> None:
        width_name = query.get("bucket_width") or "1d"
        if width_name not in _WIDTHS:
            message = (
                f"Invalid 'bucket_width': {width_name[:40]!r}. This platform keeps usage by hour and day: "
                "use '1h' or '1d'."
            )
            raise ApiError(400, message, param="bucket_width", code="invalid_value")
        # Any range: a page asks the control-plane for `limit` buckets at most (within its longest read).
        self.width, self.bucket, default_limit, most = _WIDTHS[width_name]
        for name in _UNSUPPORTED:
            if query.getlist(name) or query.getlist(name + "[]"):
                message = f"Invalid '{name}': this platform has no {name.removesuffix('_ids')} to filter usage by."
                raise ApiError(400, message, param=name, code="invalid_value")
        start = _integer(query, "start_time", required=True)
        assert start is not None
        end = _integer(query, "end_time")
        self.end = end if end is not None else int(now)
        if self.end <= start:
            message = "Invalid 'end_time': it must be after start_time."
            raise ApiError(400, message, param="end_time", code="invalid_value")
        limit = _integer(query, "limit")
        if limit is not None and not 1 <= limit <= most:
            message = f"Invalid 'limit': with bucket_width={width_name} it must be from 1 to {most}."
            raise ApiError(400, message, param="limit", code="invalid_value")
        self.limit = limit or default_limit
        self.first = start - start % self.width
        page = query.get("page")
        if page:
            if (
                not (page.isascii() and page.isdigit() and len(page) <= _DIGITS)
                or int(page) % self.width
                or not self.first <= int(page) < self.end
            ):
                raise ApiError(400, f"Invalid 'page': {page[:40]!r} is not a cursor of this query.", param="page")
            self.first = int(page)
        groups = [*query.getlist("group_by"), *query.getlist("group_by[]")]
        for group in groups:
            if group not in _GROUPS:
                message = f"Invalid 'group_by': {group[:40]!r}. This platform groups by {' and '.join(_GROUPS)}."
                raise ApiError(400, message, param="group_by", code="invalid_value")
        self.by_key, self.by_model = "api_key_id" in groups, "model" in groups
        self.keys, self.models = _filter(query, "api_key_ids"), _filter(query, "models")

    def buckets(self) -> list[int]:
        """The starts of this page's buckets."""
        last = min(self.end, self.first + self.limit * self.width)
        return list(range(self.first, last, self.width))

    def envelope(self, starts: list[int]) -> pb.Envelope:
        """usage.list for the page: one key or model filtered by the control-plane; several are
        filtered here, so their rows are asked for one by one (grouped) and summed here."""
        listing = pb.UsageList(
            bucket=self.bucket,
            caller=_single(self.keys),
            model=_single(self.models),
            by_caller=self.by_key or _several(self.keys),
            by_model=self.by_model or _several(self.models),
        )
        listing.start.FromSeconds(starts[0])
        listing.end.FromSeconds(starts[-1] + self.width)
        return pb.Envelope(usage_list=listing)


def _filter(query: QueryParams, name: str) -> frozenset[str] | None:
    """The values of the filter ``name`` (None: not given); 400 for an empty one, which the
    control-plane would read as no filter at all."""
    values = query.getlist(name) + query.getlist(name + "[]")
    if any(not value for value in values):
        raise ApiError(400, f"Invalid '{name}': an empty value names nothing.", param=name, code="invalid_value")
    return frozenset(values) or None


def _single(values: frozenset[str] | None) -> str:
    """The one value of a filter with one (the control-plane applies it), else empty."""
    return next(iter(values)) if values is not None and len(values) == 1 else ""


def _several(values: frozenset[str] | None) -> bool:
    """Whether a filter has several values (the edge applies it)."""
    return values is not None and len(values) > 1


def _result(key: str | None, model: str | None) -> dict[str, Any]:
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": 0,
        "input_cached_tokens": 0,
        "output_tokens": 0,
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        "num_model_requests": 0,
        "project_id": None,
        "user_id": None,
        "api_key_id": key,
        "model": model,
        "batch": None,
    }


def _order(group: tuple[str | None, str | None]) -> tuple[str, str]:
    return (group[0] or "", group[1] or "")


def usage_page(question: _Question, entries: list[pb.UsageEntry]) -> dict[str, Any]:
    """The ``UsageResponse`` of one page: each bucket's results, grouped as asked."""
    starts = question.buckets()
    results: dict[int, dict[tuple[str | None, str | None], dict[str, Any]]] = {start: {} for start in starts}
    for entry in entries:
        start = int(seconds(entry.start) or 0)
        if start not in results:
            continue
        keys, models = question.keys, question.models
        if (keys is not None and len(keys) > 1 and entry.caller not in keys) or (
            models is not None and len(models) > 1 and entry.model not in models
        ):
            continue
        group = (entry.caller if question.by_key else None, entry.model if question.by_model else None)
        result = results[start].setdefault(group, _result(*group))
        result["input_tokens"] += entry.prompt_tokens
        result["input_cached_tokens"] += entry.cached_tokens
        result["output_tokens"] += entry.completion_tokens
        result["num_model_requests"] += entry.requests
    data = [
        {
            "object": "bucket",
            "start_time": start,
            "end_time": start + question.width,
            "results": [results[start][group] for group in sorted(results[start], key=_order)],
        }
        for start in starts
    ]
    following = starts[-1] + question.width
    more = following < question.end
    return {"object": "page", "data": data, "has_more": more, "next_page": str(following) if more else None}


class UsageRoutes:
    """``GET /v1/organization/usage/completions``."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge

    def register(self, app: FastAPI) -> None:
        """Add the route to ``app``."""
        app.add_api_route("/v1/organization/usage/completions", self.completions, methods=["GET"])

    async def completions(self, request: Request) -> Response:
        """Completions usage by bucket (admin keys)."""
        try:
            caller: Who = who(self.edge, request)
            caller.require_admin()
            question = _Question(request.query_params, time.time())
            starts = question.buckets()
            try:
                connection = self.edge.upstream.connection()
            except IopError as exc:
                raise from_iop(exc) from None
            reply = await ask_control_plane(connection, question.envelope(starts), "usage_listed")
            page = usage_page(question, list(reply.usage_listed.entries))
            response = Response(json_bytes(page), media_type=JSON)
        except ApiError as error:
            response = error_response(error)
        self.edge.metrics.requests.labels("usage.completions", "", str(response.status_code)).inc()
        return response
