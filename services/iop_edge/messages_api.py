"""Anthropic's Messages API: ``POST /v1/messages`` (whole or streamed) and ``POST /v1/messages/count_tokens``.

The routes take the chat completions' steps (:class:`iop_edge.app.Api`: limits, key, body, one run,
cancellation when the client goes away) with Anthropic's shapes (:mod:`iop_wire.openai.messages_api`):
the key may come as ``x-api-key`` (Anthropic's SDKs send it there) or as a Bearer token, and errors
are Anthropic's ``{"type": "error", ...}`` with its statuses (529 for IOP's 503). ``anthropic-version``
is accepted whatever it says, and may be missing: there is one version of these shapes. Every answer
carries ``request-id`` (where Anthropic's SDKs read it), the run's id, as ``x-request-id`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import Response

from iop_edge.access import JSON
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.openai import messages_api as anthropic
from iop_wire.openai.errors import ApiError
from iop_wire.openai.responses import Outcome, json_bytes

if TYPE_CHECKING:  # app.build_app registers these routes: a runtime import would be a cycle
    from iop_edge.app import Api, Call, Chunks

__all__ = ["MessagesRoutes"]

_log = structlog.get_logger("iop.edge")


class MessagesRoutes:
    """The Messages API's routes over the edge's :class:`Api`."""

    def __init__(self, api: Api) -> None:
        self.api = api

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/v1/messages", self.create, methods=["POST"])
        app.add_api_route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])

    async def create(self, request: Request) -> Response:
        """POST /v1/messages."""
        return _identified(await self.api.serve(request, "messages", self._create, errors=_error, x_api_key=True))

    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens: the prompt's tokens as the model's backend counts them (a 400
        naming the model when its backend cannot count)."""
        served = await self.api.serve(request, "messages.count_tokens", self._count, errors=_error, x_api_key=True)
        return _identified(served)

    async def _create(self, request: Request, call: Call, data: dict[str, Any]) -> Response:
        api = self.api
        parsed = anthropic.messages_request(data, call.run_id)
        run = api.prepared(call, parsed.request)
        stream = await api.open(call, run)
        if parsed.stream:

            def chunks(start: pb.RunStart) -> Chunks:
                return anthropic.MessageStream(call.run_id, start.model or call.model)

            return await api.stream(request, call, stream, chunks)
        outcome = Outcome()
        start, complete = await api.collect(request, call, stream, outcome)
        return api.json(
            call, anthropic.message_body(call.run_id, start.model or run.model, outcome, complete), complete
        )

    async def _count(self, request: Request, call: Call, data: dict[str, Any]) -> Response:
        api = self.api
        run = api.prepared(call, anthropic.count_request(data, call.run_id))
        _, complete = await api.collect(request, call, await api.open(call, run), Outcome())
        return api.json(call, {"input_tokens": complete.counted_tokens}, complete)


def _identified(response: Response) -> Response:
    response.headers["request-id"] = response.headers.get("x-request-id", "")
    return response


def _error(error: ApiError, request_id: str) -> Response:
    """Anthropic's error body and status for ``error``; server-side ones (and 429) are logged."""
    status = anthropic.error_status(error)
    if status >= 500 or status == 429:
        _log.info("request failed", run_id=request_id, status=status, reason=error.message)
    body = json_bytes(anthropic.error_body(error, request_id))
    return Response(body, status_code=status, media_type=JSON, headers=error.headers())
