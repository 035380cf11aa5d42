"""The console's HTTP API (``/console/api/*``) and OpenAI's usage API, through a real platform.

One stack for the module (control-plane, a node with the mock models, a worker and an edge whose
``console`` section names the admin certificate), three keys: ``e2e`` and ``team-b`` (plain) and
``ops`` (admin). Every route is asked by an admin and by a plain key; usage and runs are checked
against real chat completions sent through the edge; the live stream is read as the page reads it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx
import pytest
import yaml

from iop_edge.keys import create_key, revoke_key
from iop_wire.certs import tls_section

from .conftest import MOCK_ROUTES, Stack, _spawn, running_stack, wait_for
from .openai_schema import validate

CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'"
)
MAX_WATCHERS = 10
PER_KEY = 4


@dataclass
class Console:
    """The stack and its keys, with a client per key."""

    stack: Stack
    admin: str
    other: str
    """team-b's key (plain, like the stack's own e2e key)."""

    @property
    def url(self) -> str:
        return self.stack.base_url.removesuffix("/v1")

    def get(self, path: str, auth: str | None = None, /, **params: Any) -> httpx.Response:
        """GET ``path`` with the key ``auth`` (default: the stack's e2e key) and the query ``params``."""
        return httpx.get(self.url + path, params=params, headers=_auth(auth or self.stack.key), timeout=30)

    def post(self, path: str, auth: str | None = None, body: Any = None) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=_auth(auth or self.stack.key), timeout=30)

    def delete(self, path: str, auth: str | None = None) -> httpx.Response:
        return httpx.delete(self.url + path, headers=_auth(auth or self.stack.key), timeout=30)

    def chat(self, key: str, content: str = "hi") -> dict[str, Any]:
        body = {"model": "mock-small", "messages": [{"role": "user", "content": content}]}
        response = httpx.post(self.stack.base_url + "/chat/completions", json=body, headers=_auth(key), timeout=30)
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    def watchers(self) -> float:
        return self.stack.edge_metric("iop_edge_console_watchers")


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    root = tmp_path_factory.mktemp("console") / "stack"
    admin_tls = tls_section(root / "certs", "admin")  # minted by running_stack before the edge starts
    settings = {
        "console": {
            "admin_cert": admin_tls["cert"],
            "admin_key": admin_tls["key"],
            "push_interval": 0.2,
            "max_watchers": MAX_WATCHERS,
        }
    }
    with running_stack(root, {"node-a": MOCK_ROUTES}, worker={}, edge_settings=settings) as stack:
        admin = create_key(stack.keys_path, "ops", admin=True)
        other = create_key(stack.keys_path, "team-b")
        started = Console(stack, admin, other)
        wait_for(
            lambda: started.get("/console/api/me", other).status_code == 200, 10, 0.05, "the edge reading new keys"
        )
        yield started


# -- pages ------------------------------------------------------------------------------------


def test_pages_are_served_with_the_csp_and_need_no_key(console: Console) -> None:
    for path in ("/console", "/console/"):
        page = httpx.get(console.url + path, timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == CSP
        assert page.headers["x-content-type-options"] == "nosniff" and page.headers["cache-control"] == "no-cache"
    for name in ("nothing.js", "..%2Fconsole.py", "sub/app.js", "index.html", ".hidden.css"):
        missing = httpx.get(f"{console.url}/console/assets/{name}", timeout=10)
        assert missing.status_code == 404, name
        assert missing.headers["content-security-policy"] == CSP


# -- who am I ---------------------------------------------------------------------------------


def test_me_names_the_key_and_its_scope(console: Console) -> None:
    plain = console.get("/console/api/me").json()
    assert plain == {"key": "e2e", "admin": False, "auth": "keys", "edge": socket.gethostname()}
    assert console.get("/console/api/me", console.admin).json()["admin"] is True
    assert httpx.get(console.url + "/console/api/me", timeout=10).status_code == 401
    wrong = console.get("/console/api/me", "sk-iop-" + "x" * 43)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


def test_a_plain_key_gets_403_for_admin_routes_and_others_records(console: Console) -> None:
    refused = [
        console.get("/console/api/overview"),
        console.get("/console/api/nodes"),
        console.get("/console/api/keys"),
        console.post("/console/api/keys", body={"name": "mine"}),
        console.delete("/console/api/keys/team-b"),
        console.post("/console/api/nodes/node-a/drain"),
        console.post("/console/api/nodes/node-a/undrain"),
        console.post("/console/api/nodes/node-a/remove"),
        console.post("/console/api/nodes/node-a/reboot"),  # refused before the action is looked up
        console.get("/console/api/runs", caller="team-b"),
        console.get("/console/api/usage", key="team-b"),
        console.get("/console/api/usage.csv", key="team-b"),
        console.get("/v1/organization/usage/completions", start_time=0),
    ]
    for response in refused:
        assert response.status_code == 403, (response.request.url, response.text)
        assert response.json()["error"]["type"]


# -- keys -------------------------------------------------------------------------------------


def test_keys_are_created_listed_and_revoked_by_an_admin(console: Console) -> None:
    created = console.post("/console/api/keys", console.admin, {"name": "team-c", "rpm": 60, "max_concurrent": 2})
    assert created.status_code == 201, created.text
    body = created.json()
    secret = body.pop("key")
    assert secret.startswith("sk-iop-") and body["name"] == "team-c" and body["admin"] is False
    assert (body["rpm"], body["tpm"], body["max_concurrent"], body["revoked_at"]) == (60, None, 2, None)
    listed = {key["name"]: key for key in console.get("/console/api/keys", console.admin).json()["keys"]}
    assert listed["ops"]["admin"] is True and listed["team-c"]["key_id"] == body["key_id"]
    assert all("key" not in key and "hash" not in key for key in listed.values())
    me = console.get("/console/api/me", secret)  # at once on the edge that made it, not after its next poll
    assert me.status_code == 200 and me.json()["key"] == "team-c", me.text

    again = console.post("/console/api/keys", console.admin, {"name": "team-c"})
    assert again.status_code == 409 and again.json()["error"]["param"] == "name"
    for bad, param in (
        ({"name": "has space"}, "name"),
        ({}, "name"),
        ({"name": "x", "rpm": 0}, "rpm"),
        ({"name": "x", "tpm": "many"}, "tpm"),
        ({"name": "x", "max_concurrent": 1.5}, "max_concurrent"),
        ({"name": "x", "admin": "yes"}, "admin"),
        ({"name": "x", "colour": "red"}, "colour"),
        ({"name": "x", "rpm": 2**31}, "rpm"),  # past the stores' integer columns
        ({"name": "x", "tpm": 10**30}, "tpm"),
    ):
        refused = console.post("/console/api/keys", console.admin, bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (bad, refused.text)
    huge = console.post("/console/api/keys", console.admin, {"name": "x" * 100_000})
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "name", huge.text[:200]
    assert len(huge.content) < 1000 and "100000 characters" in huge.text  # the name is not sent back whole

    revoked = console.delete("/console/api/keys/team-c", console.admin)
    assert revoked.status_code == 200 and revoked.json() == {"name": "team-c", "revoked": True}
    assert console.delete("/console/api/keys/team-c", console.admin).status_code == 404
    assert console.get("/console/api/me", secret).status_code == 401  # at once, here too
    reused = console.post("/console/api/keys", console.admin, {"name": "team-c"})  # would inherit its records
    assert reused.status_code == 409 and "was used by a revoked key" in reused.json()["error"]["message"]
    reserved = console.post("/console/api/keys", console.admin, {"name": "anonymous"})
    assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "name"


# -- nodes ------------------------------------------------------------------------------------


def test_nodes_are_drained_and_undrained_over_the_admin_certificate(console: Console) -> None:
    drained = console.post("/console/api/nodes/node-a/drain", console.admin, {"reason": "maintenance"})
    try:
        assert drained.status_code == 200, drained.text
        assert "node-a" in drained.json()["message"]
        [node] = console.get("/console/api/nodes", console.admin).json()["nodes"]
        assert node["reason"] == "maintenance (console, key ops)"  # who did it, even with a reason given
    finally:
        undrained = console.post("/console/api/nodes/node-a/undrain", console.admin)
    assert undrained.status_code == 200, undrained.text
    for action in ("drain", "undrain", "remove"):
        unknown = console.post(f"/console/api/nodes/no-such-node/{action}", console.admin)
        assert unknown.status_code == 404, unknown.text
        assert unknown.json()["error"]["code"] == "node_not_found", unknown.text
        assert unknown.json()["error"]["param"] == "node_id", unknown.text
    assert console.post("/console/api/nodes/node-a/reboot", console.admin).status_code == 404
    bad = console.post("/console/api/nodes/node-a/drain", console.admin, {"reason": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reason"
    long = console.post("/console/api/nodes/node-a/drain", console.admin, {"reason": "x" * 501})
    assert long.status_code == 400 and long.json()["error"]["param"] == "reason", long.text
    assert console.get("/console/api/nodes", console.admin).json()["nodes"][0]["state"] == "ready"


def _node_states(console: Console) -> dict[str, str]:
    listed = console.get("/console/api/nodes", console.admin)
    assert listed.status_code == 200, listed.text
    return {node["id"]: node["state"] for node in listed.json()["nodes"]}


def test_an_admin_removes_a_node_a_connected_one_is_cut_off_and_an_offline_one_forgotten(console: Console) -> None:
    """node-b joins with the stack's shared development certificate (as every local node does): removed
    while connected, its connection is closed at once but the certificate is not revoked, so it
    registers again; removed once stopped, it is gone from the list (and a second removal is 404)."""
    stack = console.stack
    config = yaml.safe_load((stack.root / "node-a.yaml").read_text())
    config.update(node_id="node-b", store_path=str(stack.root / "node-b.db"))
    (stack.root / "node-b.yaml").write_text(yaml.safe_dump(config))
    node = _spawn(stack.root, "node-b", "node", stack.root / "node-b.yaml")
    try:
        node.wait_ready()
        wait_for(lambda: _node_states(console).get("node-b") == "ready", 10, 0.05, "node-b registered")

        connected = console.post("/console/api/nodes/node-b/remove", console.admin, {"reason": "retired"})
        assert connected.status_code == 200, connected.text
        said = connected.json()["message"]
        assert said.startswith("node node-b removed; 0 certificate(s) revoked"), said
        assert "shared development certificate, which is not revoked" in said and "can register again" in said
        wait_for(lambda: node.log.read_text().count('"registered"') >= 2, 10, 0.05, "node-b cut off and back")
        assert "node node-b was removed (retired (console, key ops))" in node.log.read_text()
        wait_for(lambda: _node_states(console).get("node-b") == "ready", 10, 0.05, "node-b registered again")

        node.stop()
        wait_for(lambda: _node_states(console).get("node-b") == "unavailable", 10, 0.05, "node-b unavailable")
        offline = console.post("/console/api/nodes/node-b/remove", console.admin)
        assert offline.status_code == 200 and offline.json()["message"].startswith("node node-b removed"), offline.text
        assert _node_states(console) == {"node-a": "ready"}
        again = console.post("/console/api/nodes/node-b/remove", console.admin)
        assert again.status_code == 404 and "no node 'node-b'" in again.json()["error"]["message"], again.text
        assert again.json()["error"]["code"] == "node_not_found", again.text
    finally:
        node.stop()
        if "node-b" in _node_states(console):  # the module's other tests count one node
            console.post("/console/api/nodes/node-b/remove", console.admin)


def test_without_keys_anonymous_is_admin_and_without_the_admin_certificate_node_actions_are_503(
    console: Console,
) -> None:
    stack = console.stack
    config = yaml.safe_load((stack.root / "edge.yaml").read_text())
    config.pop("console")
    config["http"]["port"] = 0
    config["auth"] = "none"
    (stack.root / "edge-plain.yaml").write_text(yaml.safe_dump(config))
    edge = _spawn(stack.root, "edge-plain", "edge", stack.root / "edge-plain.yaml")
    try:
        url = f"http://127.0.0.1:{edge.wait_ready()['port']}/console/api"
        me = httpx.get(url + "/me", timeout=10).json()
        assert (me["key"], me["admin"], me["auth"]) == ("anonymous", True, "none")
        answer = httpx.post(url + "/nodes/node-a/drain", timeout=10)
        assert answer.status_code == 503 and answer.json()["error"]["param"] == "console.admin_cert", answer.text
        assert "console.admin_key" in answer.json()["error"]["message"]
        batches = httpx.get(url + "/batches", timeout=10)  # every caller's: the admin connection too
        assert batches.status_code == 503 and batches.json()["error"]["param"] == "console.admin_cert"
        keys = httpx.get(url + "/keys", timeout=10)
        assert keys.status_code == 503 and keys.json()["error"]["param"] == "auth"
    finally:
        edge.stop()


def test_nodes_and_overview_for_an_admin(console: Console) -> None:
    console.chat(console.stack.key)
    nodes = console.get("/console/api/nodes", console.admin)
    assert nodes.status_code == 200, nodes.text
    [node] = nodes.json()["nodes"]
    assert node["id"] == "node-a" and node["state"] == "ready"
    assert {model["id"] for model in node["models"]} == {route["model"] for route in MOCK_ROUTES}
    assert node["heartbeat_age_s"] is not None and node["heartbeat_age_s"] < 30
    overview = console.get("/console/api/overview", console.admin)
    assert overview.status_code == 200, overview.text
    body = overview.json()
    assert body["nodes"] == {"ready": 1, "draining": 0, "unavailable": 0, "total": 1}
    assert body["window_seconds"] == 60 and body["control_plane"]
    assert body["requests_per_s"] > 0 and body["ttft_p50_ms"] is not None
    assert any(model["id"] == "mock-small" and model["nodes"] == 1 for model in body["models"])


# -- runs and usage ---------------------------------------------------------------------------


def test_runs_are_paged_newest_first_and_scoped_to_the_key(console: Console) -> None:
    key = create_key(console.stack.keys_path, "pager")
    wait_for(lambda: console.get("/console/api/me", key).status_code == 200, 10, 0.05, "the new key")
    ids = [console.chat(key, f"run {n}")["id"] for n in range(5)]
    runs = wait_for(
        lambda: len(got := console.get("/console/api/runs", key).json().get("runs", [])) == 5 and got,
        10,
        0.1,
        "the ledger's five runs",
    )
    assert all(run["caller"] == "pager" and run["status"] == "completed" for run in runs)
    received = [run["received_at"] for run in runs]
    assert received == sorted(received, reverse=True)
    assert runs[0]["attempts"][0]["node"] == "node-a" and runs[0]["finish_reason"] in ("stop", "length")

    seen: list[str] = []
    query: dict[str, Any] = {"caller": "pager", "limit": 2}
    pages = 0
    while True:
        page = console.get("/console/api/runs", console.admin, **query).json()
        seen += [run["id"] for run in page["runs"]]
        pages += 1
        if not page["more"]:
            assert page["next_before"] is None
            break
        query["before"] = page["next_before"]
    assert pages == 3 and seen == [run["id"] for run in runs] and len(set(ids)) == 5

    one_by_one: list[str] = []
    query = {"caller": "pager", "limit": 1}
    while True:  # next_before is exact (nanoseconds, as a string): no page repeats its boundary run
        page = console.get("/console/api/runs", key, **query).json()
        one_by_one += [run["id"] for run in page["runs"]]
        if not page["more"]:
            break
        assert isinstance(page["next_before"], str) and page["next_before"].isdigit()
        query["before"] = page["next_before"]
        assert len(one_by_one) <= 5, one_by_one
    assert one_by_one == seen
    by_hand = console.get("/console/api/runs", key, before=f"{runs[0]['received_at'] + 1:.6f}").json()
    assert [run["id"] for run in by_hand["runs"]] == seen  # unix seconds, written by hand
    for epoch in ("0", "0.0", "1e-10"):  # nothing is that old (once a store thread spun on it for ever)
        empty = console.get("/console/api/runs", key, before=epoch)
        assert empty.status_code == 200 and empty.json()["runs"] == [], (epoch, empty.text)

    for bad, param in (
        ({"limit": 0}, "limit"),
        ({"limit": 501}, "limit"),
        ({"limit": "\u00b2"}, "limit"),  # a digit to str.isdigit, not to int
        ({"limit": "\u0663"}, "limit"),  # ARABIC-INDIC DIGIT THREE
        ({"limit": "9" * 5000}, "limit"),
        ({"before": "\u0661\u0662"}, "before"),
        ({"before": "1" + "0" * 30}, "before"),  # digits a Timestamp cannot hold
        ({"since": "9" * 5000}, "since"),
        ({"status": "odd"}, "status"),
    ):
        refused = console.get("/console/api/runs", key, **bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    refused = console.get("/console/api/runs", key, before="yesterday")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "before"


def _tokens(answers: list[dict[str, Any]]) -> tuple[int, int]:
    return sum(a["usage"]["prompt_tokens"] for a in answers), sum(a["usage"]["completion_tokens"] for a in answers)


def test_usage_by_hour_and_day_matches_the_chat_completions(console: Console) -> None:
    key = create_key(console.stack.keys_path, "counted")
    wait_for(lambda: console.get("/console/api/me", key).status_code == 200, 10, 0.05, "the new key")
    answers = [console.chat(key, "count me " * n) for n in range(1, 4)]
    prompt, completion = _tokens(answers)

    def counted(bucket: str) -> dict[str, Any] | None:
        usage = console.get("/console/api/usage", key, bucket=bucket).json()
        return usage if usage.get("totals", {}).get("requests") == 3 else None

    for bucket in ("hour", "day"):
        usage = wait_for(functools.partial(counted, bucket), 10, 0.1, f"usage by {bucket}")
        assert usage["bucket"] == bucket and usage["start"] < usage["end"]
        assert usage["totals"]["prompt_tokens"] == prompt and usage["totals"]["completion_tokens"] == completion
        [row] = usage["rows"]
        assert (row["key"], row["model"], row["requests"], row["failed"]) == ("counted", "mock-small", 3, 0)
        width = 3600 if bucket == "hour" else 86_400
        assert row["start"] % width == 0

    everyone = console.get("/console/api/usage", console.admin, group="key").json()
    assert {"counted", "e2e"} <= {row["key"] for row in everyone["rows"]}
    assert all(row["model"] is None for row in everyone["rows"])
    mine = console.get("/console/api/usage", console.admin, key="counted", group="model").json()
    assert mine["totals"]["completion_tokens"] == completion
    assert [(row["key"], row["model"], row["requests"]) for row in mine["rows"]] == [(None, "mock-small", 3)]
    month = console.get("/console/api/usage", key, start=str(time.time() - 31 * 86_400)).json()
    assert month["totals"]["requests"] == 3  # the longest range by hour

    csv = console.get("/console/api/usage.csv", key, bucket="day")
    assert csv.status_code == 200 and csv.headers["content-type"].startswith("text/csv")
    assert csv.headers["content-disposition"].startswith('attachment; filename="iop-usage-day-')
    header, *lines = csv.text.splitlines()
    assert header == "start,key,model,requests,prompt_tokens,completion_tokens,cached_tokens,failed"
    [line] = lines
    start, name, model, requests, prompt_csv, completion_csv, _, failed = line.split(",")
    assert start.endswith("T00:00:00Z") and (name, model, requests, failed) == ("counted", "mock-small", "3", "0")
    assert (int(prompt_csv), int(completion_csv)) == (prompt, completion)

    for bad, param in (
        ({"bucket": "week"}, "bucket"),
        ({"start": "soon"}, "start"),
        ({"end": "-1"}, "end"),
        ({"group": "key,colour"}, "group"),
        ({"start": "2000", "end": "1000"}, "start"),
        ({"start": str(time.time() - 32 * 86_400)}, "start"),  # by hour: a month at most
        ({"bucket": "day", "start": str(time.time() - 401 * 86_400)}, "start"),  # by day: 400 days
    ):
        refused = console.get("/console/api/usage", key, **bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, bad
    epoch = console.get("/console/api/usage", key, end="0", bucket="day")  # the epoch, not "now"
    assert epoch.status_code == 200 and epoch.json()["end"] == 0 and epoch.json()["rows"] == [], epoch.text


def test_openai_usage_api_follows_the_spec_and_pages(console: Console) -> None:
    key = create_key(console.stack.keys_path, "openai-usage")
    wait_for(lambda: console.get("/console/api/me", key).status_code == 200, 10, 0.05, "the new key")
    answers = [console.chat(key) for _ in range(2)]
    prompt, completion = _tokens(answers)
    now = int(time.time())
    path = "/v1/organization/usage/completions"
    query = {"start_time": now - 5 * 3600, "bucket_width": "1h", "group_by": ["api_key_id", "model"], "limit": 3}

    def mine(page: dict[str, Any]) -> list[dict[str, Any]]:
        return [r for bucket in page["data"] for r in bucket["results"] if r["api_key_id"] == "openai-usage"]

    pages: list[dict[str, Any]] = []
    while True:
        response = console.get(path, console.admin, **query)
        assert response.status_code == 200, response.text
        page = response.json()
        validate("UsageResponse", page)
        for bucket in page["data"]:
            for result in bucket["results"]:
                validate("UsageCompletionsResult", result)
        pages.append(page)
        if not page["has_more"]:
            break
        query["page"] = page["next_page"]
    assert [len(page["data"]) for page in pages] == [3, 3]  # hours now-5h .. now: six buckets
    starts = [bucket["start_time"] for page in pages for bucket in page["data"]]
    assert starts == list(range(starts[0], starts[0] + 6 * 3600, 3600))

    def counted() -> list[dict[str, Any]] | None:
        page = console.get(path, console.admin, start_time=now - 60, bucket_width="1d", group_by="api_key_id").json()
        results = mine(page)
        return results if sum(r["num_model_requests"] for r in results) == 2 else None

    results = wait_for(counted, 10, 0.1, "the usage API counting the chats")
    assert sum(r["input_tokens"] for r in results) == prompt and sum(r["output_tokens"] for r in results) == completion

    def filtered(**params: Any) -> list[dict[str, Any]]:
        page = console.get(path, console.admin, start_time=now - 60, bucket_width="1d", **params).json()
        return [result for bucket in page["data"] for result in bucket["results"]]

    [one] = filtered(api_key_ids="openai-usage")  # one key: filtered by the control-plane, summed there
    assert (one["api_key_id"], one["num_model_requests"], one["output_tokens"]) == (None, 2, completion)
    several = filtered(api_key_ids=["openai-usage", "nobody"], group_by="api_key_id")
    assert [(r["api_key_id"], r["num_model_requests"]) for r in several] == [("openai-usage", 2)]
    [both] = filtered(api_key_ids=["openai-usage", "nobody"], models="mock-small")
    assert both["num_model_requests"] == 2

    year = console.get(path, console.admin, start_time=now - 365 * 86_400, bucket_width="1h").json()
    assert len(year["data"]) == 24 and year["has_more"]  # any range: a page reads `limit` buckets

    hour_ago = now - 3600  # an end_time (now, by default) after it, however fast the test runs
    for bad, param in (
        ({"start_time": hour_ago, "bucket_width": "1m"}, "bucket_width"),
        ({}, "start_time"),
        ({"start_time": "yesterday"}, "start_time"),
        ({"start_time": hour_ago, "group_by": "project"}, "group_by"),
        ({"start_time": hour_ago, "limit": 500}, "limit"),
        ({"start_time": hour_ago, "page": "elsewhere"}, "page"),
        ({"start_time": "\u0661\u0662"}, "start_time"),  # digits to str.isdigit, not unix seconds
        ({"start_time": hour_ago, "limit": "\u00b2"}, "limit"),
        ({"start_time": "9" * 5000}, "start_time"),
        ({"start_time": hour_ago, "page": "\u00b3"}, "page"),
        ({"start_time": hour_ago, "api_key_ids": ""}, "api_key_ids"),  # empty: not "every key"
        ({"start_time": hour_ago, "project_ids": "proj_1"}, "project_ids"),
        ({"start_time": hour_ago, "user_ids[]": "user_1"}, "user_ids"),
        ({"start_time": hour_ago, "batch": "true"}, "batch"),
    ):
        refused = console.get(path, console.admin, **bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (bad, refused.text)


# -- batches and files ------------------------------------------------------------------------


def _batch(console: Console, key: str) -> tuple[str, str]:
    client = console.stack.client(key)
    body = {"model": "mock-slow", "messages": [{"role": "user", "content": "hi"}]}
    line = {"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    uploaded = client.files.create(file=("in.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    return batch.id, uploaded.id


def test_batches_and_files_are_scoped_and_an_admin_sees_every_callers(console: Console) -> None:
    mine, my_file = _batch(console, console.stack.key)
    theirs, _ = _batch(console, console.other)

    own = console.get("/console/api/batches").json()
    assert mine in {b["id"] for b in own["data"]} and theirs not in {b["id"] for b in own["data"]}
    assert all(batch["owner"] == "e2e" for batch in own["data"])
    every = console.get("/console/api/batches", console.admin, limit=100).json()
    owners = {batch["id"]: batch["owner"] for batch in every["data"]}
    assert owners[mine] == "e2e" and owners[theirs] == "team-b", owners

    assert console.post(f"/console/api/batches/{theirs}/cancel").status_code == 404
    assert console.get(f"/console/api/files/{my_file}/content", console.other).status_code == 404
    content = console.get(f"/console/api/files/{my_file}/content")
    assert content.status_code == 200 and json.loads(content.text)["custom_id"] == "1"
    assert console.get(f"/console/api/files/{my_file}/content", console.admin).text == content.text

    cancelled = console.post(f"/console/api/batches/{theirs}/cancel", console.admin)
    assert cancelled.status_code == 200 and cancelled.json()["status"] in ("cancelling", "cancelled")
    assert console.post(f"/console/api/batches/{mine}/cancel").json()["id"] == mine


# -- live -------------------------------------------------------------------------------------


def _events(console: Console, key: str, wanted: set[str], limit: float = 15.0) -> dict[str, Any]:
    """The first event of each ``wanted`` kind on a live stream read as the page reads it."""
    found: dict[str, Any] = {}
    deadline = time.monotonic() + limit
    with httpx.stream("GET", console.url + "/console/api/live", headers=_auth(key), timeout=limit) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        event = ""
        for line in stream.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event in wanted:
                found.setdefault(event, json.loads(line.removeprefix("data: ")))
            if wanted <= found.keys() or time.monotonic() > deadline:
                break
    assert wanted <= found.keys(), f"got only {sorted(found)}"
    return found


def _watch(console: Console, key: str, enough: Callable[[list[tuple[str, Any]]], bool]) -> list[tuple[str, Any]]:
    """Every event of ``key``'s live stream, read as the page reads it until ``enough`` of them came and
    for a second more (five pushes: what else the stream carries has had its chance), at most 15 s."""
    seen: list[tuple[str, Any]] = []
    deadline, until = time.monotonic() + 15, None
    with _stream(console, key) as stream:
        assert stream.status_code == 200
        event = ""
        for line in stream.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                seen.append((event, json.loads(line.removeprefix("data: "))))
            now = time.monotonic()
            if until is None and enough(seen):
                until = now + 1.0
            if now > (until or deadline):
                break
    assert until is not None, f"not enough within 15 s: {[event for event, _ in seen]}"
    return seen


@contextlib.contextmanager
def _admin_watching(console: Console) -> Iterator[Callable[[], int]]:
    """An admin's live stream read in a thread meanwhile, so each poll fetches the admin events too;
    yields how many ``overview`` events it has had so far."""
    overviews: list[str] = []
    stop = threading.Event()

    def read() -> None:
        with _stream(console, console.admin) as stream:
            for line in stream.iter_lines():
                if line == "event: overview":
                    overviews.append(line)
                if stop.is_set():
                    return

    reader = threading.Thread(target=read, name="admin-live", daemon=True)
    reader.start()
    try:
        wait_for(lambda: overviews, 10, 0.05, "the admin's first overview")
        yield lambda: len(overviews)
    finally:
        stop.set()
        reader.join(10)


def test_live_stream_pushes_overview_and_nodes_to_admins_and_only_its_own_usage_to_others(console: Console) -> None:
    wait_for(lambda: console.watchers() == 0, 10, 0.05, "no live stream left open")
    admin = _events(console, console.admin, {"overview", "nodes"})
    assert admin["overview"]["nodes"]["total"] == 1 and admin["nodes"]["nodes"][0]["id"] == "node-a"
    console.chat(console.stack.key)  # e2e's usage today: rows the poll fetches that team-b must not see
    console.chat(console.other)

    def today() -> set[str]:
        rows = console.get("/console/api/usage", console.admin, bucket="day", group="key").json()["rows"]
        return {row["key"] for row in rows}

    wait_for(lambda: {"e2e", "team-b"} <= today(), 10, 0.1, "the ledger counting both chats")

    def own_usage(seen: list[tuple[str, Any]]) -> bool:
        return any(event == "usage" and data["rows"] for event, data in seen)

    with _admin_watching(console) as overviews:  # the admin events are fetched all along
        before = overviews()
        seen = _watch(console, console.other, own_usage)
        assert overviews() > before
    assert {event for event, _ in seen} == {"usage"}, [event for event, _ in seen]
    assert {row["key"] for _, usage in seen for row in usage["rows"]} == {"team-b"}
    usage = next(usage for _, usage in reversed(seen) if usage["rows"])
    assert usage["bucket"] == "day" and usage["totals"]["requests"] >= 1


def test_a_watcher_that_never_reads_does_not_hold_the_others_and_the_limit_is_429(console: Console) -> None:
    second_admin = create_key(console.stack.keys_path, "ops-2", admin=True)
    wait_for(lambda: console.get("/console/api/me", second_admin).status_code == 200, 10, 0.05, "the new key")
    wait_for(lambda: console.watchers() == 0, 10, 0.05, "no live stream left open")
    port = console.stack.edge_port
    stalled = socket.create_connection(("127.0.0.1", port))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    request = f"GET /console/api/live HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {console.admin}\r\n\r\n"
    stalled.sendall(request.encode())  # and never reads
    try:
        wait_for(lambda: console.watchers() == 1, 10, 0.05, "the stalled watcher counted")
        for _ in range(3):  # the stream of a reader keeps flowing beside it
            assert _events(console, console.admin, {"overview"})["overview"]["nodes"]["total"] == 1
        refused_before = console.stack.edge_metric("iop_edge_console_watchers_refused_total")
        with contextlib.ExitStack() as streams:
            # Plain keys take every slot but the last PER_KEY (the admins'): 1 + 5 of 10.
            for key in (*[console.other] * PER_KEY, console.stack.key):
                assert streams.enter_context(_stream(console, key)).status_code == 200
            over = console.get("/console/api/live", console.stack.key)
            assert over.status_code == 429 and "kept for admin keys" in over.json()["error"]["message"], over.text
            for key in (console.admin, console.admin, console.admin, second_admin):  # the admins still get in
                assert streams.enter_context(_stream(console, key)).status_code == 200
            over = console.get("/console/api/live", second_admin)
            assert over.status_code == 429 and "console.max_watchers)" in over.json()["error"]["message"], over.text
        assert console.stack.edge_metric("iop_edge_console_watchers_refused_total") == refused_before + 2
    finally:
        stalled.close()
    wait_for(lambda: console.watchers() == 0, 10, 0.05, "every live stream closed")


def test_console_requests_are_counted_by_route_and_status(console: Console) -> None:
    console.get("/console/api/me")
    console.get("/console/api/overview")
    assert console.stack.edge_metric('iop_edge_requests_total{model="",route="console.me",status="200"}') >= 1
    assert console.stack.edge_metric('iop_edge_requests_total{model="",route="console.overview",status="403"}') >= 1


def _stream(console: Console, key: str) -> contextlib.AbstractContextManager[httpx.Response]:
    return httpx.stream("GET", console.url + "/console/api/live", headers=_auth(key), timeout=10)


def test_a_key_holds_at_most_max_watchers_per_key_streams(console: Console) -> None:
    wait_for(lambda: console.watchers() == 0, 10, 0.05, "no live stream left open")
    refused_before = console.stack.edge_metric("iop_edge_console_watchers_refused_total")
    with contextlib.ExitStack() as streams:
        for _ in range(PER_KEY):
            assert streams.enter_context(_stream(console, console.other)).status_code == 200
        over = console.get("/console/api/live", console.other)
        assert over.status_code == 429 and "console.max_watchers_per_key" in over.json()["error"]["message"]
        assert streams.enter_context(_stream(console, console.admin)).status_code == 200  # another key still may
    assert console.stack.edge_metric("iop_edge_console_watchers_refused_total") == refused_before + 1
    wait_for(lambda: console.watchers() == 0, 10, 0.05, "every live stream closed")


def test_a_revoked_keys_live_stream_ends(console: Console) -> None:
    key = create_key(console.stack.keys_path, "short-lived")
    wait_for(lambda: console.get("/console/api/me", key).status_code == 200, 10, 0.05, "the new key")
    with _stream(console, key) as stream:
        lines = stream.iter_lines()
        assert next(lines) == ": live"
        assert revoke_key(console.stack.keys_path, "short-lived")
        deadline, ended = time.monotonic() + 10, True
        for _ in lines:  # ends once the edge re-reads its keys and ticks
            if time.monotonic() > deadline:
                ended = False
                break
    assert ended, "the revoked key's stream went on"
    assert console.get("/console/api/me", key).status_code == 401


def test_a_key_store_that_cannot_be_written_is_503_not_500(console: Console) -> None:
    holder = sqlite3.connect(console.stack.keys_path, timeout=0)
    try:
        holder.execute("BEGIN EXCLUSIVE")  # writers wait the store's busy timeout (5 s), then fail
        refused = console.post("/console/api/keys", console.admin, {"name": "locked-out"})
    finally:
        holder.rollback()
        holder.close()
    assert refused.status_code == 503 and "key store" in refused.json()["error"]["message"], refused.text
    assert refused.headers["retry-after"]


def test_stopping_the_edge_ends_its_live_streams_first(console: Console) -> None:
    """Last in the module: the edge is stopped (SIGTERM) with a stream open, then started again."""
    edge = console.stack.edge
    assert edge is not None
    with _stream(console, console.admin) as stream:
        lines = stream.iter_lines()
        assert next(lines) == ": live"
        edge.popen.send_signal(signal.SIGTERM)
        edge.popen.wait(timeout=3)  # long before the 50 s graceful shutdown's cut: the stream did not hold it
        rest = list(lines)
    assert edge.popen.returncode == 0 and "ASGI callable returned without completing" not in edge.log.read_text()
    assert all(not line.startswith("event: error") for line in rest)
    console.stack.edge_port = int(edge.restart()["port"])  # a new port (the config asks for any)
