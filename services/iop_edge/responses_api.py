"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``.

A create is served by :class:`iop_edge.app.Api` as a chat completion is (the key's limits, the
body, one run whose caller is the key, its deadline, cancellation when the client goes away;
route label ``responses``); :mod:`iop_wire.openai.responses_api` maps the body onto a chat run
with its own builder (input items to chat messages; tools, tool_choice and the text format in chat
completions' shape, through the helpers of :mod:`iop_wire.openai.requests` they share with chat
and Messages), and :mod:`iop_wire.openai.responses_output` the run's events onto the Response or
its event stream. With ``store`` (the default) the
Response is kept in the edge's store (:mod:`iop_edge.stored_responses`) under the key's name:
another key's id is a 404, as a missing one; ``previous_response_id`` replays its conversation.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from iop_edge.access import JSON, authenticate, caller_of, error_response
from iop_edge.edge import Edge
from iop_edge.key_storage import STORE_ERRORS, KeyStorage, SchemaTooNew
from iop_edge.keyring import storage_of
from iop_edge.stored_responses import Column, ResponseStore, StoredResponse, storage_for
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.openai import responses_api as shape
from iop_wire.openai import responses_output
from iop_wire.openai.errors import ApiError
from iop_wire.openai.responses import Outcome, json_bytes

if TYPE_CHECKING:  # app.py registers these routes: importing it here at run time would be a cycle
    from iop_edge.app import Api, Call, Chunks

__all__ = ["ResponsesRoutes"]

_MAX_LIMIT = 100
_DIGITS = re.compile(r"[0-9]{1,3}")
_OPEN_ERRORS: tuple[type[Exception], ...] = (*STORE_ERRORS, SchemaTooNew)


class ResponsesRoutes:
    """The Responses API's routes over :class:`Api`."""

    def __init__(self, api: Api, edge: Edge) -> None:
        self.api = api
        self.edge = edge
        self._store: ResponseStore | None = None
        self._opening = asyncio.Lock()
        self._opened: KeyStorage | None = None
        """The store opened here (``auth: none``), which :meth:`aclose` closes; the key store's is the keyring's."""

    def register(self, app: FastAPI) -> None:
        """Add the routes to ``app``."""
        app.add_api_route("/v1/responses", self.create, methods=["POST"])
        app.add_api_route("/v1/responses/{response_id}", self.retrieve, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])
        app.add_api_route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"])

    async def store(self) -> ResponseStore:
        """The stored responses: the key store's table, or (``auth: none``) the store the settings name,
        opened once (503 while it cannot be)."""
        async with self._opening:
            if self._store is None:
                self._store = ResponseStore(
                    storage_for(await self._storage()), self.edge.settings.responses, self.edge.metrics.registry
                )
        return self._store

    async def _storage(self) -> KeyStorage:
        if self.edge.keys is not None:
            return self.edge.keys.storage
        storage = storage_of(self.edge.settings)
        try:
            await storage.open()
        except _OPEN_ERRORS as exc:
            await storage.aclose()
            message = f"stored responses are unavailable: the store {storage.name} cannot be opened ({exc})"
            raise ApiError(503, message, code="service_unavailable", retry_after=1.0) from None
        self._opened = storage
        return storage

    # -- create -------------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        """POST /v1/responses."""
        return await self.api.serve(request, "responses", self._create)

    async def _create(self, request: Request, call: Call, data: dict[str, Any]) -> Response:
        parsed = shape.parse_create(data)
        owner = caller_of(call.key)
        history: list[dict[str, Any]] = []
        store = await self.store() if parsed.store or parsed.previous_response_id is not None else None
        keep = store if parsed.store else None
        if store is not None and parsed.previous_response_id is not None:
            previous = await store.get(owner, parsed.previous_response_id, "conversation")
            if previous is None:
                message = f"Previous response with id '{parsed.previous_response_id}' not found."
                raise ApiError(400, message, param="previous_response_id", code="previous_response_not_found")
            history = json.loads(previous)
            if history is None:  # a failed or cancelled response: its output may be cut mid-item
                raise await _not_continued(store, owner, parsed.previous_response_id)
        run = self.api.prepared(call, shape.run_request(parsed, call.run_id, history))
        response_id = f"resp_{call.run_id}{secrets.token_hex(12)}"  # the run's id in it: one to look for in logs
        stream = await self.api.open(call, run)
        if parsed.stream:

            def events(start: pb.RunStart) -> Chunks:
                base = responses_output.skeleton(response_id, start.model or parsed.model, parsed)
                ended = None if keep is None else lambda body: keep.put_soon(_row(owner, parsed, history, body))
                return responses_output.ResponseEvents(base, ended)  # a stream cut short ends it too: cancelled

            return await self.api.stream(request, call, stream, events)
        outcome = Outcome()
        start, complete = await self.api.collect(request, call, stream, outcome)
        body = responses_output.response_body(
            responses_output.skeleton(response_id, start.model or parsed.model, parsed), outcome, complete
        )
        if keep is not None:
            await keep.put(_row(owner, parsed, history, body))
        return self.api.json(call, body, complete)

    # -- stored responses ---------------------------------------------------------------------

    async def retrieve(self, request: Request, response_id: str) -> Response:
        """GET /v1/responses/{id}: a stored response of the caller's."""

        async def body(owner: str) -> bytes:
            return (await self._found(owner, response_id, "body")).encode()  # sent as stored: not parsed

        return await self._serve("responses.retrieve", request, body)

    async def delete(self, request: Request, response_id: str) -> Response:
        """DELETE /v1/responses/{id}."""

        async def deleted(owner: str) -> bytes:
            if not await (await self.store()).delete(owner, response_id):
                raise _not_found(response_id)
            return json_bytes({"id": response_id, "object": "response", "deleted": True})

        return await self._serve("responses.delete", request, deleted)

    async def input_items(self, request: Request, response_id: str) -> Response:
        """GET /v1/responses/{id}/input_items: ``after``, ``limit`` (1-100, 20) and ``order`` (desc) paging."""

        async def listed(owner: str) -> bytes:
            query = request.query_params
            limit = _limit(query.get("limit"))
            order = query.get("order") or "desc"
            if order not in ("asc", "desc"):
                message = f"Invalid value: {order[:40]!r}. Supported values are: 'asc' and 'desc'."
                raise ApiError(400, message, param="order", code="invalid_value")
            items: list[dict[str, Any]] = json.loads(await self._found(owner, response_id, "input_items"))
            if order == "desc":
                items.reverse()
            if (after := query.get("after")) is not None:
                ids = [item["id"] for item in items]
                if after not in ids:
                    message = f"No item with id {after[:80]!r} in this response's input."
                    raise ApiError(400, message, param="after", code="invalid_value")
                items = items[ids.index(after) + 1 :]
            page = items[:limit]
            return json_bytes(
                {
                    "object": "list",
                    "data": page,
                    "first_id": page[0]["id"] if page else None,
                    "last_id": page[-1]["id"] if page else None,
                    "has_more": len(items) > limit,
                }
            )

        return await self._serve("responses.input_items", request, listed)

    async def _found(self, owner: str, response_id: str, column: Column) -> str:
        stored = await (await self.store()).get(owner, response_id, column)
        if stored is None:
            raise _not_found(response_id)
        return stored

    async def _serve(self, route: str, request: Request, produce: Callable[[str], Awaitable[bytes]]) -> Response:
        """The request authenticated and admitted as an inference request is (one of the key's rpm, a
        concurrency slot while it runs: reading a stored response costs the edge's loop too), then
        ``produce(owner)``'s JSON, or its ApiError; counted."""
        from iop_edge.app import Call  # noqa: PLC0415 - app.py imports this module: a cycle at import time

        call = Call(route, time.perf_counter(), secrets.token_hex(12), None)
        try:
            call.key = authenticate(self.edge.keys, request)
            await self.api.admit(call)
            response = Response(await produce(caller_of(call.key)), media_type=JSON)
        except ApiError as error:
            response = error_response(error, call.run_id)
        finally:
            if call.lease is not None:
                call.lease.release(0)
        self.edge.metrics.requests.labels(route, "", str(response.status_code)).inc()
        response.headers["x-request-id"] = call.run_id  # as every route's: one id to quote in a report
        return response

    async def aclose(self) -> None:
        """At the edge's shutdown: the writes under way finished; a store opened here (``auth: none``) closed."""
        store, self._store = self._store, None
        if store is None:
            return
        await store.aclose()
        if self._opened is not None:
            await self._opened.aclose()


def _row(
    owner: str, parsed: shape.ResponsesRequest, history: list[dict[str, Any]], body: dict[str, Any]
) -> StoredResponse:
    ended = body["status"] in ("failed", "cancelled")  # not continued: see _not_continued
    conversation = None if ended else shape.conversation(history, parsed, body)
    return StoredResponse(body["id"], owner, time.time(), body, parsed.input_items, conversation)


async def _not_continued(store: ResponseStore, owner: str, response_id: str) -> ApiError:
    """The 400 for a ``previous_response_id`` naming a response that failed or was cancelled."""
    body = await store.get(owner, response_id, "body")
    status = "failed or cancelled" if body is None else json.loads(body).get("status", "failed")
    message = (
        f"Previous response with id '{response_id}' cannot be continued: its status is {status}, and its output"
        " may be cut short. Continue from an earlier response, or send the conversation as input."
    )
    return ApiError(400, message, param="previous_response_id", code="invalid_value")


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


def _limit(given: str | None) -> int:
    """``limit``: ASCII digits only (``str.isdigit`` takes "²", which ``int`` refuses), three at most."""
    if given is None:
        return 20
    if not _DIGITS.fullmatch(given) or not 1 <= int(given) <= _MAX_LIMIT:
        message = f"Invalid 'limit': {given[:20]!r}; it must be an integer from 1 to {_MAX_LIMIT}."
        raise ApiError(400, message, param="limit", code="invalid_value")
    return int(given)
