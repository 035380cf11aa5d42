"""The web console: its pages (``/console``) and its API (``/console/api/*``), served by the edge.

Pages and assets (the files of the ``console`` folder beside this module) need no key and hold
no data; they are sent with a Content-Security-Policy that allows nothing but this origin, so the
pages carry no inline script or style. Every API call needs an API key (``Authorization: Bearer``)
and is scoped here, server side: an admin key (``iop keys create NAME --admin``; with ``auth:
none`` the anonymous caller) sees the platform and every caller's runs, usage, batches and files;
any other key sees only its own, and gets 403 for admin routes or another caller's records.

Runs, usage, the overview and the nodes are asked of the control-plane over the edge's pooled
connections (its certificate may read them); batches and files of the worker, for the key's
caller. What the edge's certificate may not do (drain, undrain and remove nodes; every caller's
batches and files for an admin key) goes over the admin connections of :mod:`iop_edge.admin`.
The live stream is :mod:`iop_edge.live`'s; the JSON shapes are :mod:`iop_edge.views`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from google.protobuf.timestamp_pb2 import Timestamp

from iop_edge.access import ANONYMOUS, JSON, authenticate, error_response, read_body
from iop_edge.admin import AdminLinks
from iop_edge.batches import batch_object
from iop_edge.files import file_chunks, page_limit, read_file
from iop_edge.key_storage import STORE_ERRORS
from iop_edge.keys import ApiKey, check_limits, check_name, digest, new_secret
from iop_edge.live import LiveHub, LiveStream, Snapshot, sse_event
from iop_edge.views import grouped, nodes_view, overview_view, run_view, summed_overview, usage_csv
from iop_edge.worker import Worker
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import ConnectionClosed, IopError
from iop_wire.connection import Connection
from iop_wire.openai import batches as rules
from iop_wire.openai import requests as parse
from iop_wire.openai.errors import ApiError, from_iop
from iop_wire.openai.responses import json_bytes

if TYPE_CHECKING:
    from iop_edge.edge import Edge

__all__ = ["CSP", "PAGES", "USAGE_SPANS", "Console", "UsageQuery", "Who", "ask_control_plane", "usage_query", "who"]

PAGES = Path(__file__).with_name("console")
"""The console's files: ``index.html`` and its assets."""
CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'"
)
_ASSET_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
    ".woff2": "font/woff2",
}
ASK_TIMEOUT = 10.0
"""Seconds the control-plane has to answer one console request."""
_RUNS_PAGE, _RUNS_MAX = 50, 500
_NUMBER_CHARS = 40
"""Longest number a query parameter may hold (``int`` refuses 4,300 digits; a time needs 20)."""
_NANOS_FROM = 10**11
"""A whole ``before`` this large is nanoseconds (as seconds it would be past the year 5000)."""
_NANOS_TO = 10**20
"""Nanoseconds past the last time ``_time`` takes (1e11 s): a Timestamp refuses far larger."""
_INT32_MAX = 2**31 - 1
"""The largest key limit (the stores' integer columns)."""
_DAY = 86_400
_MAX_REASON_CHARS = 500
"""Longest reason a node action may give here: with " (console, key NAME)" added, still under the
control-plane's own bound (1,000 characters), which refuses longer ones from any admin."""
USAGE_SPANS = {"hour": 31 * _DAY + 3600, "day": 400 * _DAY}
"""The longest range of one usage question, by bucket (a month of hours, a bit more than a year of days)."""
_STATUSES = ("completed", "failed", "cancelled")
_KEY_FIELDS = frozenset({"name", "admin", "rpm", "tpm", "max_concurrent"})


@dataclass(frozen=True, slots=True)
class Who:
    """The caller of a console request: its key's name and whether it is an admin."""

    name: str
    admin: bool

    def own(self, asked: str | None, param: str) -> str:
        """The caller whose records are asked: ``asked`` for an admin (empty: everyone's), else the
        key's own (another caller: 403 naming ``param``)."""
        if self.admin:
            return asked or ""
        if asked and asked != self.name:
            raise ApiError(403, f"this key may see only its own records ({param}={self.name})", param=param)
        return self.name

    def require_admin(self) -> None:
        """403 unless an admin key asks."""
        if not self.admin:
            raise ApiError(403, "this needs an admin key (iop keys create NAME --admin)", code="permission_denied")


def who(edge: Edge, request: Request) -> Who:
    """The request's caller; 401 without a valid key. With ``auth: none``, ``anonymous``, an admin."""
    key: ApiKey | None = authenticate(edge.keys, request)
    return Who(ANONYMOUS, admin=True) if key is None else Who(key.name, key.admin)


async def ask_control_plane(connection: Connection, envelope: pb.Envelope, answer: str) -> pb.Envelope:
    """``envelope`` asked of the control-plane on ``connection``; its ``answer``, or the HTTP error."""
    try:
        reply = await connection.request(envelope, ASK_TIMEOUT)
    except IopError as exc:
        raise from_iop(exc) from None
    except ConnectionClosed:
        raise ApiError(503, "the connection to the control-plane closed; retry", retry_after=1.0) from None
    except TimeoutError:
        raise ApiError(504, f"the control-plane did not answer within {ASK_TIMEOUT:g} s", code="timeout") from None
    if reply.WhichOneof("body") != answer:
        message = f"the control-plane answered {envelope.WhichOneof('body')} with {reply.WhichOneof('body')}"
        raise ApiError(502, message, code="backend_error")
    return reply


def _time(value: str | None, param: str) -> float | None:
    """A unix-seconds query parameter; 400 naming it when it is not a number (ASCII only: ``float``
    also reads other scripts' digits)."""
    if value is None or value == "":
        return None
    try:
        seconds = float(value) if value.isascii() and len(value) <= _NUMBER_CHARS else float("nan")
    except ValueError:
        seconds = float("nan")
    if not 0 <= seconds < 1e11:  # also NaN
        raise ApiError(400, f"{param} must be a time in unix seconds, not {value[:40]!r}", param=param)
    return seconds


def _before(value: str | None) -> Timestamp | None:
    """``runs?before=``: the ``next_before`` of a page (a string of integer nanoseconds, exact, so the
    next page starts right after its last run), or unix seconds written by hand."""
    if value and value.isascii() and value.isdigit() and len(value) <= _NUMBER_CHARS and int(value) >= _NANOS_FROM:
        if int(value) >= _NANOS_TO:
            raise ApiError(400, f"before must be a time in nanoseconds, not {value[:40]!r}", param="before")
        stamp = Timestamp()
        stamp.FromNanoseconds(int(value))
        return stamp
    seconds = _time(value, "before")
    return None if seconds is None else _timestamp(seconds)


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _floor(seconds: float, width: int) -> float:
    return float(int(seconds // width) * width)


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """A usage question, checked: its bucket, range, filters and grouping."""

    bucket: str
    start: float
    end: float
    key: str
    model: str
    by_key: bool
    by_model: bool

    def envelope(self) -> pb.Envelope:
        """usage.list for this question: the control-plane filters and groups (the edge only shapes)."""
        listing = pb.UsageList(
            bucket=pb.USAGE_BUCKET_DAY if self.bucket == "day" else pb.USAGE_BUCKET_HOUR,
            caller=self.key,
            model=self.model,
            by_caller=self.by_key,
            by_model=self.by_model,
        )
        listing.start.CopyFrom(_timestamp(self.start))
        listing.end.CopyFrom(_timestamp(self.end))
        return pb.Envelope(usage_list=listing)


def usage_query(query: Any, caller: Who, now: float) -> UsageQuery:
    """``GET /console/api/usage``'s parameters checked (400 naming the first bad one, 403 another key's)."""
    bucket = query.get("bucket") or "hour"
    if bucket not in ("hour", "day"):
        raise ApiError(400, f"bucket must be hour or day, not {bucket[:40]!r}", param="bucket")
    end = _time(query.get("end"), "end")
    end = now if end is None else end  # 0 is a time (the epoch), not "now"
    start = _time(query.get("start"), "start")
    if start is None:
        start = end - (_DAY if bucket == "hour" else 7 * _DAY)
    if start >= end:
        raise ApiError(400, "start must be before end", param="start")
    longest = USAGE_SPANS[bucket]
    if end - start > longest:
        message = f"by {bucket}, a range is at most {longest / _DAY:g} days: start must be later"
        raise ApiError(400, message, param="start")
    groups = [part.strip() for part in (query.get("group") or "key,model").split(",") if part.strip()]
    if any(part not in ("key", "model") for part in groups):
        raise ApiError(400, f"group takes key and model (comma-separated), not {query.get('group')!r}", param="group")
    key = caller.own(query.get("key"), "key")
    return UsageQuery(bucket, start, end, key, query.get("model") or "", "key" in groups, "model" in groups)


class Console:
    """The console's routes over one edge."""

    def __init__(self, edge: Edge, admin: AdminLinks) -> None:
        self.edge, self.admin = edge, admin
        self.worker = Worker(edge.worker)
        console = edge.settings.console
        self.hub = LiveHub(
            self._poll,
            interval=console.push_interval,
            max_watchers=console.max_watchers,
            max_per_key=console.max_watchers_per_key,
            metrics=edge.metrics,
        )
        self._etags: dict[Path, tuple[float, str]] = {}

    def register(self, app: FastAPI) -> None:
        """Add the pages' and the API's routes to ``app``."""
        for path in ("/console", "/console/"):
            app.add_api_route(path, self.index, methods=["GET"])
        app.add_api_route("/console/assets/{name:path}", self.asset, methods=["GET"])
        api = "/console/api"
        routes: list[tuple[str, Callable[..., Awaitable[Response]], str]] = [
            ("/me", self.me, "GET"),
            ("/live", self.live, "GET"),
            ("/overview", self.overview, "GET"),
            ("/nodes", self.nodes, "GET"),
            ("/nodes/{node_id}/{action}", self.node_action, "POST"),
            ("/runs", self.runs, "GET"),
            ("/usage", self.usage, "GET"),
            ("/usage.csv", self.usage_csv, "GET"),
            ("/keys", self.keys, "GET"),
            ("/keys", self.create_key, "POST"),
            ("/keys/{name}", self.revoke_key, "DELETE"),
            ("/batches", self.batches, "GET"),
            ("/batches/{batch_id}/cancel", self.cancel_batch, "POST"),
            ("/files/{file_id}/content", self.file_content, "GET"),
        ]
        for path, handler, method in routes:
            app.add_api_route(api + path, handler, methods=[method])

    async def aclose(self) -> None:
        """Stop the live poller and close the admin connections."""
        await self.hub.aclose()
        await self.admin.aclose()

    # -- pages --------------------------------------------------------------------------------

    async def index(self) -> Response:
        """GET /console: the page (its routing is client-side, by hash)."""
        return self._file(PAGES / "index.html", "text/html; charset=utf-8", None)

    async def asset(self, request: Request, name: str) -> Response:
        """GET /console/assets/NAME: a file of the console folder (ETag: sent again only when changed)."""
        kind = _ASSET_TYPES.get(Path(name).suffix)
        path = PAGES / name
        if kind is None or "/" in name or name.startswith(".") or not path.is_file():
            error = ApiError(404, f"no console asset {name[:100]!r}", code="unknown_url")
            return Response(error.content(), status_code=404, media_type=JSON, headers=_page_headers())
        return self._file(path, kind, request.headers.get("if-none-match"))

    def _file(self, path: Path, kind: str, if_none_match: str | None) -> Response:
        headers = _page_headers()
        try:
            content = path.read_bytes()
        except OSError:
            error = ApiError(404, "the console's pages are not installed with this edge", code="unknown_url")
            return Response(error.content(), status_code=404, media_type=JSON, headers=headers)
        headers["etag"] = etag = '"' + hashlib.sha256(content).hexdigest()[:32] + '"'
        if if_none_match == etag:
            return Response(status_code=304, headers=headers)
        return Response(content, media_type=kind, headers=headers)

    # -- the API ------------------------------------------------------------------------------

    async def _serve(
        self, route: str, request: Request, produce: Callable[[Who], Awaitable[dict[str, Any] | Response]]
    ) -> Response:
        """The caller found (401 without a key), then ``produce``'s JSON or response, or its error; counted."""
        try:
            made = await produce(who(self.edge, request))
            response = made if isinstance(made, Response) else Response(json_bytes(made), media_type=JSON)
        except ApiError as error:
            response = error_response(error)
        self.edge.metrics.requests.labels(f"console.{route}", "", str(response.status_code)).inc()
        return response

    async def _ask(self, envelope: pb.Envelope, answer: str) -> pb.Envelope:
        try:
            connection = self.edge.upstream.connection()
        except IopError as exc:
            raise from_iop(exc) from None
        return await ask_control_plane(connection, envelope, answer)

    async def me(self, request: Request) -> Response:
        """GET /console/api/me: who the key is (the sign-in form's check)."""

        async def me(caller: Who) -> dict[str, Any]:
            edge = self.edge
            return {"key": caller.name, "admin": caller.admin, "auth": edge.settings.auth, "edge": socket.gethostname()}

        return await self._serve("me", request, me)

    async def overview(self, request: Request) -> Response:
        """GET /console/api/overview (admin)."""

        async def overview(caller: Who) -> dict[str, Any]:
            caller.require_admin()
            return await self._overview()

        return await self._serve("overview", request, overview)

    async def _overview(self) -> dict[str, Any]:
        shown, answered = await self._overview_shown()
        nodes = await self._nodes()
        return overview_view(shown, nodes, time.time(), answered)

    async def _overview_shown(self) -> tuple[pb.OverviewShown, list[str]]:
        """Every control-plane connected asked for its overview at once, the answers summed; and the
        control-planes that answered (none: the first one's error)."""
        try:
            peers = self.edge.upstream.per_peer()
            if not peers:
                self.edge.upstream.connection()  # the pool's error: none configured, or none up
        except IopError as exc:
            raise from_iop(exc) from None
        envelope = pb.Envelope(overview_show=pb.OverviewShow())
        asked = [ask_control_plane(connection, envelope, "overview_shown") for connection in peers.values()]
        replies = await asyncio.gather(*asked, return_exceptions=True)
        answers = [reply.overview_shown for reply in replies if isinstance(reply, pb.Envelope)]
        if not answers:
            failure = replies[0]
            if isinstance(failure, ApiError):
                raise failure
            raise ApiError(502, f"the control-plane failed: {failure}", code="backend_error")
        answered = [
            reply.overview_shown.control_plane or address
            for address, reply in zip(peers, replies, strict=True)
            if isinstance(reply, pb.Envelope)
        ]
        return summed_overview(answers), answered

    async def _nodes(self) -> list[pb.NodeInfo]:
        return list((await self._ask(pb.Envelope(nodes_list=pb.NodesList()), "nodes_listed")).nodes_listed.nodes)

    async def nodes(self, request: Request) -> Response:
        """GET /console/api/nodes (admin)."""

        async def nodes(caller: Who) -> dict[str, Any]:
            caller.require_admin()
            return nodes_view(await self._nodes(), time.time())

        return await self._serve("nodes", request, nodes)

    async def node_action(self, request: Request, node_id: str, action: str) -> Response:
        """POST /console/api/nodes/{id}/drain|undrain|remove (admin; over the admin certificate)."""

        async def act(caller: Who) -> dict[str, Any]:
            caller.require_admin()
            http = self.edge.settings.http
            body = await read_body(request, http.max_body_bytes, http.body_timeout)
            data = parse.parse_body(body) if body.strip() else {}
            reason = data.get("reason", "") or ""
            if not isinstance(reason, str):
                raise ApiError(400, "reason must be a string", param="reason")
            if len(reason) > _MAX_REASON_CHARS:
                message = f"reason is {len(reason)} characters, over {_MAX_REASON_CHARS}: say it shorter"
                raise ApiError(400, message, param="reason", code="invalid_value")
            reason = f"{reason} (console, key {caller.name})" if reason else f"(console, key {caller.name})"
            if action == "drain":
                envelope = pb.Envelope(nodes_drain=pb.NodesDrain(node_id=node_id, reason=reason))
            elif action == "undrain":
                envelope = pb.Envelope(nodes_undrain=pb.NodesUndrain(node_id=node_id, reason=reason))
            elif action == "remove":
                envelope = pb.Envelope(nodes_remove=pb.NodesRemove(node_id=node_id, reason=reason))
            else:
                raise ApiError(404, f"no node action {action[:40]!r}: drain, undrain or remove", code="unknown_url")
            connection = await self.admin.control_plane()
            try:
                done = await ask_control_plane(connection, envelope, "operation_done")
            except ApiError as error:
                if error.status == 404:  # the control-plane's NOT_FOUND: no such node (drain, undrain, remove)
                    raise ApiError(404, error.message, param="node_id", code="node_not_found") from None
                raise
            return {"message": done.operation_done.message}

        return await self._serve("nodes.action", request, act)

    async def runs(self, request: Request) -> Response:
        """GET /console/api/runs: the ledger, newest first, a page at a time (``before``)."""

        async def runs(caller: Who) -> dict[str, Any]:
            query = request.query_params
            status = query.get("status") or ""
            if status and status not in _STATUSES:
                message = f"status must be one of {', '.join(_STATUSES)}, not {status[:40]!r}"
                raise ApiError(400, message, param="status")
            limit = _limit(query.get("limit"))
            listing = pb.RunsList(
                status=status,
                model=query.get("model") or "",
                node_id=query.get("node") or "",
                caller=caller.own(query.get("caller"), "caller"),
                limit=limit,
            )
            if (since := _time(query.get("since"), "since")) is not None:
                listing.since.CopyFrom(_timestamp(since))
            if (before := _before(query.get("before"))) is not None:
                listing.before.CopyFrom(before)
            listed = (await self._ask(pb.Envelope(runs_list=listing), "runs_listed")).runs_listed
            shown = [run_view(run) for run in listed.runs]
            # A string: nanoseconds since 1970 are past 2**53, where a JavaScript number loses digits.
            oldest = str(listed.runs[-1].received_at.ToNanoseconds()) if shown and listed.more else None
            return {"runs": shown, "more": listed.more, "next_before": oldest}

        return await self._serve("runs", request, runs)

    async def _usage(self, request: Request, caller: Who) -> dict[str, Any]:
        question = usage_query(request.query_params, caller, time.time())
        entries = (await self._ask(question.envelope(), "usage_listed")).usage_listed.entries  # a plain key's own
        rows, totals = grouped(entries, by_key=question.by_key, by_model=question.by_model)
        return {"bucket": question.bucket, "start": question.start, "end": question.end, "rows": rows, "totals": totals}

    async def usage(self, request: Request) -> Response:
        """GET /console/api/usage: tokens by hour or day, key and model (a non-admin key: its own)."""
        return await self._serve("usage", request, lambda caller: self._usage(request, caller))

    async def usage_csv(self, request: Request) -> Response:
        """GET /console/api/usage.csv: the same rows as a CSV download."""

        async def csv(caller: Who) -> Response:
            usage = await self._usage(request, caller)
            name = f"iop-usage-{usage['bucket']}-{int(usage['start'])}-{int(usage['end'])}.csv"
            headers = {"content-disposition": f'attachment; filename="{name}"'}
            return Response(usage_csv(usage["rows"]), media_type="text/csv; charset=utf-8", headers=headers)

        return await self._serve("usage.csv", request, csv)

    # -- live ---------------------------------------------------------------------------------

    async def live(self, request: Request) -> Response:
        """GET /console/api/live: the server-sent events of :mod:`iop_edge.live`."""
        try:
            caller = who(self.edge, request)
            watcher = self.hub.join(caller.name, admin=caller.admin, recheck=self._recheck(request))
        except ApiError as error:
            response = error_response(error)
            self.edge.metrics.requests.labels("console.live", "", str(response.status_code)).inc()
            return response
        self.edge.metrics.requests.labels("console.live", "", "200").inc()
        return LiveStream(self.hub, watcher)

    def _recheck(self, request: Request) -> Callable[[], bool | None] | None:
        """The live stream's key looked up again (admin now, or None once revoked); None with keys off."""
        keys = self.edge.keys
        if keys is None:
            return None
        token = request.headers.get("authorization", "").partition(" ")[2].strip()

        def recheck() -> bool | None:
            key = keys.authenticate(token)
            return None if key is None else key.admin

        return recheck

    async def _poll(self, admins: bool, others: bool) -> Snapshot:
        """One poll for the live stream: overview and nodes for admins, today's usage for the others."""
        snapshot, now = Snapshot(), time.time()
        try:
            if admins:
                shown, answered = await self._overview_shown()
                nodes = await self._nodes()
                overview = sse_event("overview", overview_view(shown, nodes, now, answered))
                snapshot.admin = overview + sse_event("nodes", nodes_view(nodes, now))
            if others:
                start = _floor(now, _DAY)
                question = UsageQuery("day", start, now, "", "", by_key=True, by_model=True)
                entries = list((await self._ask(question.envelope(), "usage_listed")).usage_listed.entries)

                def usage(caller: str) -> bytes:
                    rows, totals = grouped(entries, by_key=True, by_model=True, keys=frozenset({caller}))
                    body = {"bucket": "day", "start": start, "end": now, "rows": rows, "totals": totals}
                    return sse_event("usage", body)

                snapshot.usage = usage
        except ApiError as error:
            snapshot.trouble = f"control-plane: {error.message}"
        return snapshot

    # -- keys ---------------------------------------------------------------------------------

    def _storage(self) -> Any:
        keys = self.edge.keys
        if keys is None:
            raise ApiError(503, "this edge has no keys (auth: none)", param="auth", code="service_unavailable")
        return keys.storage

    async def _keys_changed(self) -> None:
        """This edge's keys re-read after it changed them (else within the store's ``refresh``); a
        failed read is left to that next poll: the change itself is made."""
        if self.edge.keys is not None:
            with contextlib.suppress(*STORE_ERRORS):
                await self.edge.keys.reload()

    async def keys(self, request: Request) -> Response:
        """GET /console/api/keys (admin): every key, revoked ones included, never a secret."""

        async def keys(caller: Who) -> dict[str, Any]:
            caller.require_admin()
            with _store_away():
                return {"keys": [_key_view(info) for info in await self._storage().list_keys()]}

        return await self._serve("keys.list", request, keys)

    async def create_key(self, request: Request) -> Response:
        """POST /console/api/keys (admin): 201 with the secret, shown this once."""

        async def create(caller: Who) -> Response:
            caller.require_admin()
            http = self.edge.settings.http
            data = parse.parse_body(await read_body(request, http.max_body_bytes, http.body_timeout))
            for unknown in data.keys() - _KEY_FIELDS:
                raise ApiError(400, f"unknown field {unknown[:40]!r}", param=unknown[:40], code="unknown_parameter")
            name = parse.required(data, "name", str, "string")
            try:
                check_name(name)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="name", code="invalid_value") from None
            admin = data.get("admin", False)
            if not isinstance(admin, bool):
                raise ApiError(400, "admin must be true or false", param="admin", code="invalid_type")
            limits = {field: _key_limit(data, field) for field in ("rpm", "tpm", "max_concurrent")}
            check_limits(**limits)  # each is checked above; this is the store's own rule
            secret = new_secret()
            storage = self._storage()
            with _store_away():
                try:
                    await storage.create(name, digest(secret), **limits, admin=admin)
                except ValueError as exc:
                    raise ApiError(409, str(exc), param="name", code="key_exists") from None
                info = next(info for info in await storage.list_keys() if info.name == name)
            await self._keys_changed()  # the new key works on this edge at once
            body = json_bytes({**_key_view(info), "key": secret})
            return Response(body, status_code=201, media_type=JSON)

        return await self._serve("keys.create", request, create)

    async def revoke_key(self, request: Request, name: str) -> Response:
        """DELETE /console/api/keys/{name} (admin)."""

        async def revoke(caller: Who) -> dict[str, Any]:
            caller.require_admin()
            with _store_away():
                revoked = await self._storage().revoke(name)
            if not revoked:
                raise ApiError(404, f"no active key {name[:100]!r}", param="name", code="key_not_found")
            await self._keys_changed()  # and stops working on this edge at once
            return {"name": name, "revoked": True}

        return await self._serve("keys.revoke", request, revoke)

    # -- batches and files --------------------------------------------------------------------

    async def _worker_scope(self, caller: Who) -> tuple[Connection | None, str]:
        """Where a caller's batch or file request goes, and the caller it names: an admin's over the
        admin connection naming none (every caller's), any other key's over the edge's, naming itself."""
        if caller.admin:
            return await self.admin.worker(), ""
        return None, caller.name

    async def batches(self, request: Request) -> Response:
        """GET /console/api/batches: an admin's every caller's, another key's its own."""

        async def page(caller: Who) -> dict[str, Any]:
            query = request.query_params
            limit = page_limit(query.get("limit"), rules.BATCHES_PAGE)
            listing = pb.BatchesList(after=query.get("after", ""), limit=limit)
            connection, scope = await self._worker_scope(caller)
            ask = pb.Envelope(batches_list=listing)
            reply = await self.worker.ask(ask, "batches_listed", caller=scope, connection=connection)
            data = [{**batch_object(info), "owner": info.caller or None} for info in reply.batches_listed.batches]
            return {"object": "list", "data": data, "has_more": reply.batches_listed.has_more}

        return await self._serve("batches.list", request, page)

    async def cancel_batch(self, request: Request, batch_id: str) -> Response:
        """POST /console/api/batches/{id}/cancel: an admin's any caller's, another key's its own (else 404)."""

        async def cancel(caller: Who) -> dict[str, Any]:
            connection, scope = await self._worker_scope(caller)
            ask = pb.Envelope(batch_cancel=pb.BatchCancel(batch_id=batch_id))
            reply = await self.worker.ask(ask, "batch_info", caller=scope, about=batch_id, connection=connection)
            return batch_object(reply.batch_info)

        return await self._serve("batches.cancel", request, cancel)

    async def file_content(self, request: Request, file_id: str) -> Response:
        """GET /console/api/files/{id}/content: an output or error file, streamed from the worker."""

        async def content(caller: Who) -> Response:
            connection, scope = await self._worker_scope(caller)
            first = await read_file(self.worker, file_id, 0, scope, connection)  # unknown: 404 before any header
            chunks = file_chunks(self.worker, file_id, first, scope, connection)
            headers = {"content-disposition": f'attachment; filename="{file_id}.jsonl"'}
            return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)

        return await self._serve("files.content", request, content)


@contextlib.contextmanager
def _store_away() -> Iterator[None]:
    """A key store that cannot be read or written (its file locked, its server away): 503, not 500."""
    try:
        yield
    except STORE_ERRORS as exc:
        message = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ApiError(503, f"the key store cannot be used: {message}; retry", retry_after=1.0) from None


def _page_headers() -> dict[str, str]:
    return {"content-security-policy": CSP, "x-content-type-options": "nosniff", "cache-control": "no-cache"}


def _limit(value: str | None) -> int:
    if value is None or value == "":
        return _RUNS_PAGE
    if not (value.isascii() and value.isdigit() and len(value) <= 3 and 1 <= int(value) <= _RUNS_MAX):
        raise ApiError(400, f"limit must be a whole number from 1 to {_RUNS_MAX}, not {value[:40]!r}", param="limit")
    return int(value)


def _key_limit(data: dict[str, Any], field: str) -> int | None:
    value = data.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _INT32_MAX:
        message = f"{field} must be a whole number from 1 to {_INT32_MAX}, or null"
        raise ApiError(400, message, param=field, code="invalid_value")
    return value


def _key_view(info: Any) -> dict[str, Any]:
    return {
        "name": info.name,
        "key_id": info.key_id,
        "admin": info.admin,
        "created_at": info.created_at,
        "revoked_at": info.revoked_at,
        "rpm": info.rpm,
        "tpm": info.tpm,
        "max_concurrent": info.max_concurrent,
    }
