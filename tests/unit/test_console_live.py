"""The console's live hub (one poll per tick for every watcher, bounded watchers and queues) and its views."""

from __future__ import annotations

import asyncio
import csv
import io
import time
from collections.abc import AsyncIterator

import pytest

from iop_edge import live
from iop_edge.live import QUEUED, STALL_TICKS, LiveHub, LiveStream, Snapshot
from iop_edge.metrics import EdgeMetrics
from iop_edge.views import grouped, overview_view, run_view, summed_overview, usage_csv
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.openai.errors import ApiError


class _Polls:
    """Counts the polls; each answers a numbered admin event and a usage event per caller."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self, admins: bool, others: bool) -> Snapshot:
        self.count += 1
        number = self.count
        return Snapshot(
            admin=b"event: overview\ndata: %d\n\n" % number if admins else None,
            usage=(lambda caller: f"event: usage\ndata: {caller} {number}\n\n".encode()) if others else None,
        )


def _hub(polls: _Polls, metrics: EdgeMetrics, *, max_watchers: int = 8) -> LiveHub:
    return LiveHub(polls, interval=3600, max_watchers=max_watchers, metrics=metrics)  # ticks driven by the test


def _value(metrics: EdgeMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None
    return value


async def test_one_poll_feeds_every_watcher_each_its_own_events() -> None:
    polls, metrics = _Polls(), EdgeMetrics()
    hub = _hub(polls, metrics)
    admin, alice, bob = hub.join("ops", admin=True), hub.join("alice", admin=False), hub.join("bob", admin=False)
    await hub.aclose()  # the poller the first watcher started, before its first tick: the test ticks
    await hub.tick()
    assert polls.count == 1  # one poll for three watchers
    assert list(admin.queue) == [b"event: overview\ndata: 1\n\n"]
    assert list(alice.queue) == [b"event: usage\ndata: alice 1\n\n"]
    assert list(bob.queue) == [b"event: usage\ndata: bob 1\n\n"]
    assert _value(metrics, "iop_edge_console_watchers") == 3
    for watcher in (admin, alice, bob):
        hub.leave(watcher)
    assert _value(metrics, "iop_edge_console_watchers") == 0


async def test_the_poller_runs_while_someone_watches_and_stops_after_the_last() -> None:
    polls, metrics = _Polls(), EdgeMetrics()
    hub = LiveHub(polls, interval=0.01, max_watchers=4, metrics=metrics)
    watcher = hub.join("ops", admin=True)
    taken = [message async for message in _take(watcher.messages(), 3)]
    assert len(taken) == 3 and polls.count >= 3
    hub.leave(watcher)
    await asyncio.sleep(0.05)
    stopped_at = polls.count
    await asyncio.sleep(0.05)
    assert polls.count == stopped_at  # no watcher, no polls
    await hub.aclose()


async def _take(messages: AsyncIterator[bytes], count: int) -> AsyncIterator[bytes]:
    async for message in messages:
        yield message
        count -= 1
        if not count:
            return


async def test_a_watcher_that_never_reads_keeps_the_latest_and_is_dropped() -> None:
    polls, metrics = _Polls(), EdgeMetrics()
    hub = _hub(polls, metrics)
    stalled, reader = hub.join("ops", admin=True), hub.join("alice", admin=False)
    await hub.aclose()
    for _ in range(QUEUED + STALL_TICKS):
        await hub.tick()
        assert len(stalled.queue) <= QUEUED  # bounded: the oldest goes
        reader.queue.clear()  # the reader keeps up
        assert not reader.dropped.is_set()
    assert stalled.dropped.is_set() and stalled not in hub.watchers
    assert _value(metrics, "iop_edge_console_watchers_dropped_total") == 1
    assert reader in hub.watchers
    await hub.tick()
    assert reader.queue[-1].endswith(b"alice %d\n\n" % polls.count)  # the others are fed on


async def test_past_max_watchers_a_watcher_is_refused_429_and_counted() -> None:
    polls, metrics = _Polls(), EdgeMetrics()
    hub = _hub(polls, metrics, max_watchers=2)
    hub.join("b", admin=False)
    hub.join("a", admin=True)
    with pytest.raises(ApiError) as refused:
        hub.join("c", admin=True)
    assert refused.value.status == 429 and "console.max_watchers" in refused.value.message
    assert _value(metrics, "iop_edge_console_watchers_refused_total") == 1
    await hub.aclose()


async def test_without_an_answer_a_watcher_gets_a_comment_line() -> None:
    metrics = EdgeMetrics()

    async def away(admins: bool, others: bool) -> Snapshot:
        return Snapshot(trouble="control-plane: not reachable")

    hub = LiveHub(away, interval=3600, max_watchers=2, metrics=metrics)
    watcher = hub.join("ops", admin=True)
    await hub.aclose()
    await hub.tick()
    assert watcher.queue[-1] == b": control-plane: not reachable\n\n"


def _entry(start: int, caller: str, model: str, counts: tuple[int, int, int]) -> pb.UsageEntry:
    requests, prompt, completion = counts
    entry = pb.UsageEntry(caller=caller, model=model, requests=requests, prompt_tokens=prompt)
    entry.completion_tokens = completion
    entry.start.FromSeconds(start)
    return entry


def test_usage_rows_are_grouped_filtered_and_written_as_csv() -> None:
    entries = [
        _entry(3600, "a", "m1", (1, 10, 5)),
        _entry(3600, "a", "m2", (2, 20, 6)),
        _entry(3600, "b", "m1", (3, 30, 7)),
        _entry(7200, "a", "m1", (4, 40, 8)),
    ]
    rows, totals = grouped(entries, by_key=True, by_model=False)
    assert [(r["start"], r["key"], r["model"], r["requests"]) for r in rows] == [
        (3600.0, "a", None, 3),
        (3600.0, "b", None, 3),
        (7200.0, "a", None, 4),
    ]
    assert totals["prompt_tokens"] == 100 and totals["completion_tokens"] == 26
    assert grouped(entries[::-1], by_key=True, by_model=False) == (rows, totals)  # any order in, oldest first out
    repeat = [_entry(0, "a", "m1", (1, 1, 1)), _entry(0, "a", "m3", (1, 1, 1)), _entry(0, "b", "m1", (1, 1, 1))]
    repeat.append(_entry(0, "b", "m2", (1, 1, 1)))  # m1 again, then m2: before m3, after the repeat
    assert [r["model"] for r in grouped(repeat, by_key=False, by_model=True)[0]] == ["m1", "m2", "m3"]
    assert grouped([], by_key=True, by_model=True) == ([], dict.fromkeys(totals, 0))
    rows, totals = grouped(entries, by_key=False, by_model=True, keys=frozenset({"a"}))
    assert [(r["model"], r["requests"]) for r in rows] == [("m1", 1), ("m2", 2), ("m1", 4)]
    assert totals["requests"] == 7
    assert usage_csv(rows).splitlines() == [
        "start,key,model,requests,prompt_tokens,completion_tokens,cached_tokens,failed",
        "1970-01-01T01:00:00Z,,m1,1,10,5,0,0",
        "1970-01-01T01:00:00Z,,m2,2,20,6,0,0",
        "1970-01-01T02:00:00Z,,m1,4,40,8,0,0",
    ]


def test_usage_csv_keeps_names_that_look_like_formulas_as_text() -> None:
    rows, _ = grouped(
        [
            _entry(3600, '=HYPERLINK("http://evil","x")', "+cmd", (1, 1, 1)),
            _entry(3600, "@sum", "-2", (1, 1, 1)),
            _entry(3600, "\tkey", "\tmodel", (1, 1, 1)),
            _entry(3600, "plain", "mock-small", (1, 1, 1)),
        ],
        by_key=True,
        by_model=True,
    )
    parsed = [row[1:3] for row in csv.reader(io.StringIO(usage_csv(rows), newline=""))][1:]
    assert sorted(parsed) == sorted(
        [
            ['\'=HYPERLINK("http://evil","x")', "'+cmd"],
            ["'@sum", "'-2"],
            ["'\tkey", "'\tmodel"],
            ["plain", "mock-small"],
        ]
    )
    carriage = usage_csv([{**rows[0], "key": "\rkey", "model": None}])
    assert "'\rkey" in carriage.split("\n")[1]


async def test_a_revoked_keys_stream_ends_at_the_next_tick_and_a_changed_scope_is_followed() -> None:
    polls, metrics = _Polls(), EdgeMetrics()
    hub = _hub(polls, metrics)
    keys = {"alice": False, "bob": False}
    alice = hub.join("alice", admin=False, recheck=lambda: keys.get("alice"))
    bob = hub.join("bob", admin=False, recheck=lambda: keys.get("bob"))
    await hub.aclose()
    await hub.tick()
    assert not alice.dropped.is_set() and alice.queue[-1].startswith(b"event: usage")
    del keys["alice"]  # revoked
    keys["bob"] = True  # made an admin
    await hub.tick()
    assert alice.dropped.is_set() and alice not in hub.watchers
    assert bob.admin and bob.queue[-1].startswith(b"event: overview")
    assert _value(metrics, "iop_edge_console_watchers") == 1


def _refused(hub: LiveHub, caller: str, *, admin: bool) -> str:
    """The 429's message when ``caller`` (its key admin or not) asks for one more stream."""
    with pytest.raises(ApiError) as refused:
        hub.join(caller, admin=admin, recheck=lambda: admin)
    assert refused.value.status == 429
    return refused.value.message


async def test_one_key_may_hold_only_max_per_key_streams() -> None:
    polls, metrics = _Polls(), EdgeMetrics()
    hub = LiveHub(polls, interval=3600, max_watchers=8, max_per_key=2, metrics=metrics)
    hub.join("alice", admin=False, recheck=lambda: False)
    hub.join("alice", admin=False, recheck=lambda: False)
    assert "console.max_watchers_per_key" in _refused(hub, "alice", admin=False)
    assert _value(metrics, "iop_edge_console_watchers_refused_total") == 1
    hub.join("bob", admin=False, recheck=lambda: False)  # another key still gets one
    await hub.aclose()


async def test_with_keys_off_the_per_key_bound_does_not_make_the_edge_hold_only_that_many() -> None:
    """auth: none: every watcher is `anonymous` (no key to re-check); only max_watchers bounds them."""
    polls, metrics = _Polls(), EdgeMetrics()
    hub = LiveHub(polls, interval=3600, max_watchers=4, max_per_key=2, metrics=metrics)
    for _ in range(4):
        hub.join("anonymous", admin=True)
    with pytest.raises(ApiError) as refused:
        hub.join("anonymous", admin=True)
    assert refused.value.status == 429 and "console.max_watchers)" in refused.value.message
    await hub.aclose()


async def test_end_all_ends_every_stream_and_takes_no_more() -> None:
    polls, metrics = _Polls(), EdgeMetrics()
    hub = _hub(polls, metrics)
    watchers = [hub.join("ops", admin=True), hub.join("alice", admin=False)]
    hub.end_all()
    assert all(watcher.dropped.is_set() for watcher in watchers) and not hub.watchers
    with pytest.raises(ApiError) as refused:
        hub.join("ops", admin=True)
    assert refused.value.status == 503
    await hub.aclose()


def test_a_run_with_an_error_code_this_edge_does_not_know_shows_its_number() -> None:
    run = pb.LedgerRun(run_id="run-1", status="failed", error_message="from a newer control-plane")
    run.error_code = 9999  # type: ignore[assignment]
    assert run_view(run)["error"] == {"code": "9999", "message": "from a newer control-plane"}
    run.error_code = pb.ERROR_CODE_MODEL_NOT_FOUND
    assert run_view(run)["error"]["code"] == "model_not_found"


def _shown(name: str, requests: int, p50_ms: int, p95_ms: int, queued: int) -> pb.OverviewShown:
    shown = pb.OverviewShown(window_seconds=60, requests=requests, failed=1, prompt_tokens=10 * requests)
    shown.completion_tokens, shown.queued, shown.running, shown.control_plane = 5 * requests, queued, 2, name
    shown.ttft_p50.FromMilliseconds(p50_ms)
    shown.ttft_p95.FromMilliseconds(p95_ms)
    traffic = shown.models.add(model="m", requests=requests, failed=1, completion_tokens=5 * requests)
    traffic.ttft_p50.FromMilliseconds(p50_ms)
    return shown


def test_several_control_planes_overviews_are_summed_and_named() -> None:
    total = summed_overview([_shown("cp-a", 30, 100, 400, 3), _shown("cp-b", 10, 200, 900, 1)])
    view = overview_view(total, [], 0.0, ["cp-a", "cp-b"])
    assert view["control_planes"] == ["cp-a", "cp-b"]
    assert (total.requests, total.failed, total.prompt_tokens, total.completion_tokens) == (40, 2, 400, 200)
    assert (view["queued"], view["running"]) == (4, 4)
    assert view["ttft_p50_ms"] == 125.0  # (30 x 100 + 10 x 200) / 40: weighted by requests
    assert view["ttft_p95_ms"] == 900.0  # the largest
    [model] = view["models"]
    assert (model["requests"], model["failed"], model["completion_tokens"], model["ttft_p50_ms"]) == (40, 2, 200, 125.0)
    alone = _shown("cp-a", 30, 100, 400, 3)
    assert summed_overview([alone]) is alone and overview_view(alone, [], 0.0)["control_planes"] == ["cp-a"]


async def test_a_stream_dropped_before_it_began_is_answered_503_not_left_unanswered() -> None:
    """end_all() (the edge stopping) right after a watcher joined: its response had not started, and
    returning without one made the server answer 500 and log an ASGI error."""
    polls, metrics = _Polls(), EdgeMetrics()
    hub = _hub(polls, metrics)
    watcher = hub.join("ops", admin=True)
    hub.end_all()
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        await asyncio.Event().wait()  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    await LiveStream(hub, watcher)({"type": "http"}, receive, send)  # type: ignore[arg-type]
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    assert b"stopping" in sent[1]["body"]  # type: ignore[operator]
    await hub.aclose()


async def test_the_last_slots_are_kept_for_admin_keys() -> None:
    """Plain keys, four streams each, filled every slot and the operators' console got 429 (found
    attacking the console: 16 keys x 4 unread streams). The last max_per_key slots are the admins'."""
    polls, metrics = _Polls(), EdgeMetrics()
    hub = LiveHub(polls, interval=3600, max_watchers=8, max_per_key=2, metrics=metrics)
    for key in ("alice", "bob", "carol"):
        for _ in range(2):
            hub.join(key, admin=False, recheck=lambda: False)
    assert "kept for admin keys" in _refused(hub, "dave", admin=False)
    hub.join("ops", admin=True, recheck=lambda: True)
    hub.join("ops", admin=True, recheck=lambda: True)
    assert "console.max_watchers)" in _refused(hub, "root", admin=True)
    assert _value(metrics, "iop_edge_console_watchers_refused_total") == 2
    await hub.aclose()


async def test_a_stream_is_renewed_with_a_reconnect_event_after_renew_seconds() -> None:
    """A client that stopped reading is found out only once the kernel's buffers are full: megabytes,
    hours of pushes. Every stream ends after RENEW_SECONDS, telling its page to reconnect."""
    polls, metrics = _Polls(), EdgeMetrics()
    hub = _hub(polls, metrics)
    watcher, other = hub.join("ops", admin=True), hub.join("alice", admin=False)
    await hub.aclose()
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        await asyncio.Event().wait()  # the client stays (and never reads: nothing here blocks on it)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    stream = asyncio.ensure_future(LiveStream(hub, watcher)({"type": "http"}, receive, send))  # type: ignore[arg-type]
    await hub.tick()
    await asyncio.sleep(0.01)
    assert not stream.done() and sent[0]["status"] == 200
    assert time.monotonic() + 0.8 * live.RENEW_SECONDS - 5 < watcher.renew_at <= time.monotonic() + live.RENEW_SECONDS
    watcher.renew_at = time.monotonic()  # due now; `other` joined with it is not
    await hub.tick()
    await asyncio.wait_for(stream, 5)
    assert sent[-1] == {"type": "http.response.body", "body": b"event: reconnect\ndata: {}\n\n", "more_body": False}
    assert watcher.renewed and watcher not in hub.watchers
    assert other in hub.watchers and not other.renewed
    assert _value(metrics, "iop_edge_console_watchers_renewed_total") == 1
    await hub.aclose()
