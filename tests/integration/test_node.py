"""The node in-process: real mTLS on 127.0.0.1, a real SQLite history, the mock and cli adapters."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Pki, assert_eventually
from google.protobuf.struct_pb2 import Struct
from node_helpers import chat, client, collect, kinds, node_settings, running_node, text

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.domain import RunStatus
from iop_node.store import SqliteRunStore
from iop_wire.endpoint import dial
from iop_wire.tls import Role

PY = sys.executable
ROUTES = [
    {"model": "mock-small", "adapter": "mock", "options": {"tokens": 8}},
    {
        "model": "mock-slow",
        "adapter": "mock",
        "max_concurrency": 1,
        "queue_size": 2,
        "options": {"tokens": 1000, "tokens_per_second": 50},
    },
    {
        "model": "echo",
        "adapter": "cli",
        "options": {"argv": [PY, "-c", "import sys; print(sys.stdin.read().upper(), end='')"]},
    },
    {
        "model": "sleeper",
        "adapter": "cli",
        "max_concurrency": 1,
        "options": {"argv": ["sh", "-c", "echo started; sleep 30 & sleep 30; wait"]},
    },
    {"model": "missing", "adapter": "cli", "options": {"argv": ["/no/such/program"]}},
    {
        "model": "fails",
        "adapter": "cli",
        "options": {"argv": [PY, "-c", "import sys; print('bad thing', file=sys.stderr); sys.exit(1)"]},
    },
    {
        "model": "garbage",
        "adapter": "cli",
        "options": {"argv": [PY, "-c", "import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe')"]},
    },
]


@pytest.fixture
def settings(pki: Pki, tmp_path: Path):  # type: ignore[no-untyped-def]
    return node_settings(pki, tmp_path, ROUTES, max_prompt_chars=1000, max_tokens_limit=4096)


async def _record(app, run_id: str):  # type: ignore[no-untyped-def]
    assert isinstance(app.store, SqliteRunStore)
    return await app.store.get(run_id)


@pytest.mark.parametrize("codec", ["proto", "json"])
async def test_mock_streams_deterministic_text_and_records_it(settings, pki: Pki, codec: str) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        connection = await client(app, pki, codec)
        first = await collect(await connection.open_run(chat(run_id="a")))
        second = await collect(await connection.open_run(chat(run_id="b")))
        other = await collect(await connection.open_run(chat(run_id="c", text="something else")))
        assert kinds(first) == ["start"] + ["delta"] * 8 + ["complete"]
        assert first[0].start.node_id == "node-t" and first[0].start.adapter == "mock"
        assert text(first) == text(second) != text(other)
        assert first[-1].complete.usage.completion_tokens == 8
        assert first[-1].complete.timings.HasField("generation")
        record = await _record(app, "a")
        assert record.status is RunStatus.COMPLETED and record.completion_tokens == 8
        assert not record.usage_estimated  # the mock backend reports its usage
        assert record.started_at and record.first_token_at and record.finished_at
        assert record.caller == "edge-t" and record.adapter == "mock" and record.finish_reason == "stop"
        assert record.peer == "edge-t" and record.connection  # from the certificate, scoped to the connection
        await connection.close()


async def test_mock_embeds_each_prompt_entry_and_completion_prompts(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        embed = pb.RunRequest(run_id="e", model="mock-small", kind=pb.RUN_KIND_EMBEDDING, prompt=["one", "two words"])
        events = await collect(await connection.open_run(embed))
        assert kinds(events) == ["start", "delta", "complete"]
        vectors = events[1].delta.embeddings
        assert [v.index for v in vectors] == [0, 1] and len(vectors[0].values) == 8
        assert events[-1].complete.usage.prompt_tokens == 3
        assert (await _record(app, "e")).first_token_at is not None  # an output times the first token too
        completion = pb.RunRequest(
            run_id="c",
            model="mock-small",
            kind=pb.RUN_KIND_COMPLETION,
            prompt=["once"],
            sampling=pb.Sampling(max_tokens=2),
        )
        events = await collect(await connection.open_run(completion))
        assert kinds(events) == ["start", "delta", "delta", "complete"]
        assert events[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH
        await connection.close()


async def test_capabilities_list_both_adapters_and_their_models(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        capabilities = await connection.capabilities()
        models = {a.name: {m.name: m for m in a.models} for a in capabilities.adapters}
        assert set(models) == {"mock", "cli"}
        assert set(models["mock"]) == {"mock-small", "mock-slow"}
        assert set(models["cli"]) == {"echo", "sleeper", "missing", "fails", "garbage"}
        assert models["mock"]["mock-slow"].max_concurrency == 1
        assert not models["cli"]["missing"].available and models["cli"]["echo"].available
        await connection.close()


async def test_cli_streams_program_output_and_counts_tokens(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        events = await collect(await connection.open_run(chat(model="echo", text="shout this", run_id="shout")))
        assert kinds(events)[0] == "start" and kinds(events)[-1] == "complete"
        assert text(events) == "USER: SHOUT THIS"
        usage = events[-1].complete.usage
        assert usage.estimated and usage.completion_tokens == 4 and usage.prompt_tokens == 4
        record = await _record(app, "shout")
        assert (record.prompt_tokens, record.completion_tokens, record.usage_estimated) == (4, 4, True)
        await connection.close()


def _struct(**fields: object) -> Struct:
    struct = Struct()
    struct.update(fields)
    return struct


@pytest.mark.parametrize(
    ("request_fields", "code", "message", "param"),
    [
        ({"model": "nope"}, pb.ERROR_CODE_MODEL_NOT_FOUND, "not served here", ""),
        ({"messages": []}, pb.ERROR_CODE_INVALID_ARGUMENT, "messages is empty", "messages"),
        (
            {"sampling": pb.Sampling(max_tokens=-1)},
            pb.ERROR_CODE_INVALID_ARGUMENT,
            "between 1 and 4096, got -1",
            "max_tokens",
        ),
        ({"sampling": pb.Sampling(max_tokens=10**9)}, pb.ERROR_CODE_INVALID_ARGUMENT, "got 1000000000", "max_tokens"),
        (
            {"sampling": pb.Sampling(temperature=float("nan"))},
            pb.ERROR_CODE_INVALID_ARGUMENT,
            "sampling.temperature must be between 0 and 2, got nan",
            "temperature",
        ),
        (
            {"messages": [pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text="x" * 1001)])]},
            pb.ERROR_CODE_INVALID_ARGUMENT,
            "over this node's limit of 1000",
            "",
        ),
        (
            {"openai_fields": _struct(tools=[{"type": "function"}])},
            pb.ERROR_CODE_INVALID_ARGUMENT,
            "is not a function tool with a name",
            "tools[0]",
        ),
        ({"openai_fields": _struct(n=2)}, pb.ERROR_CODE_INVALID_ARGUMENT, "n > 1", "n"),
        ({"model": "missing"}, pb.ERROR_CODE_BACKEND_ERROR, "not found", ""),
        ({"model": "fails"}, pb.ERROR_CODE_BACKEND_ERROR, "exit code 1", ""),
        ({"model": "garbage"}, pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR, "UTF-8", ""),
    ],
    ids=[
        "unknown-model",
        "no-messages",
        "negative-max-tokens",
        "huge-max-tokens",
        "nan-temperature",
        "prompt-too-big",
        "mock-tools",
        "mock-n-2",
        "cli-missing",
        "cli-exit-1",
        "cli-invalid-utf8",
    ],
)
async def test_bad_requests_get_their_error_code_and_a_failed_row(  # type: ignore[no-untyped-def]  # noqa: PLR0917 - pytest parameters
    settings, pki: Pki, request_fields: dict, code: int, message: str, param: str
) -> None:
    async with running_node(settings) as app:
        connection = await client(app, pki)
        request = chat(**{k: v for k, v in request_fields.items() if k != "messages"})
        if "messages" in request_fields:
            del request.messages[:]
            request.messages.extend(request_fields["messages"])
        events = await collect(await connection.open_run(request))
        assert events[-1].error.code == code, events[-1]
        assert message in events[-1].error.message
        assert events[-1].error.param == param  # the field to blame, by its OpenAI name
        record = await _record(app, request.run_id)
        assert record.status is RunStatus.FAILED
        assert record.error_code == pb.ErrorCode.Name(code).removeprefix("ERROR_CODE_")
        if request.model == "fails":
            assert "bad thing" in record.stderr_tail
        # the node keeps serving
        assert kinds(await collect(await connection.open_run(chat())))[-1] == "complete"
        await connection.close()


@pytest.mark.parametrize("model", ["mock-slow", "sleeper"], ids=["mock", "cli"])
async def test_cancel_while_queued_never_starts(settings, pki: Pki, model: str) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        holder = await connection.open_run(chat(model=model, run_id="holder"))
        assert (await anext(holder)).WhichOneof("event") == "start"
        waiting = await connection.open_run(chat(model=model, run_id="waiting"))
        await assert_eventually(lambda: app.node.admissions[model].queued == 1)
        await waiting.cancel("changed my mind")
        events = await collect(waiting)
        assert kinds(events) == ["error"]  # no start: it never left the queue
        assert events[0].error.code == pb.ERROR_CODE_CANCELLED
        assert events[0].error.HasField("usage") and events[0].error.usage == pb.Usage()  # it used nothing
        assert app.node.admissions[model].queued == 0
        record = await _record(app, "waiting")
        assert record.status is RunStatus.CANCELLED and record.error_message == "changed my mind"
        assert record.started_at is None
        if model == "sleeper":
            assert len(_sleepers()) == 1  # only the holder's program was ever started
        await holder.cancel()
        await collect(holder)
        await connection.close()


async def test_cancel_while_starting_and_while_streaming(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        starting = await connection.open_run(chat(run_id="s", metadata={"mock.ttft": "30"}))
        assert (await anext(starting)).WhichOneof("event") == "start"
        await starting.cancel("too slow to start")
        assert kinds(await collect(starting)) == ["error"]
        streaming = await connection.open_run(chat(model="mock-slow", run_id="t"))
        seen = [await anext(streaming) for _ in range(4)]
        await streaming.cancel("enough")
        rest = await collect(streaming)
        assert kinds(seen) == ["start", "delta", "delta", "delta"]
        assert rest[-1].error.code == pb.ERROR_CODE_CANCELLED and "enough" in rest[-1].error.message
        for run_id, reason in (("s", "too slow to start"), ("t", "enough")):
            record = await _record(app, run_id)
            assert (record.status, record.error_message) == (RunStatus.CANCELLED, reason)
        assert (await _record(app, "s")).first_token_at is None
        await connection.close()


def _group_alive(pgid: int) -> bool:
    return any(entry.name.isdigit() and _pgid(entry) == pgid for entry in Path("/proc").iterdir())


def _sleepers() -> list[int]:
    """The sleeper programs the cli adapter started (group leaders, not their forked children)."""
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _cmdline(p).startswith(_SLEEPER) and _pgid(p) == int(p.name)
    ]


def _pgid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


_SLEEPER = "sh\0-c\0echo started"


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
async def test_cli_run_stopped_mid_stream_leaves_no_process(settings, pki: Pki, how: str) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        stream = await connection.open_run(chat(model="sleeper", run_id="sl"))
        assert kinds([await anext(stream), await anext(stream)]) == ["start", "delta"]
        pids = _sleepers()
        assert len(pids) == 1
        if how == "cancel":
            await stream.cancel("stop the program")
            assert kinds(await collect(stream)) == ["error"]
        else:
            connection._writer.transport.abort()
        await assert_eventually(lambda: not _group_alive(pids[0]))
        assert not Path(f"/proc/{pids[0]}").exists()  # reaped, not a zombie
        await assert_eventually(lambda: app.node.admissions["sleeper"].in_flight == 0)
        record = await _record(app, "sl")
        assert record.status is RunStatus.CANCELLED
        expected = "stop the program" if how == "cancel" else "connection closed"
        assert record.error_message.startswith(expected)
        await connection.close()


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_text()
    except OSError:
        return ""


async def test_client_disconnect_cancels_its_runs(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        stream = await connection.open_run(chat(model="mock-slow", run_id="gone"))
        await anext(stream)
        connection._writer.transport.abort()
        await assert_eventually(lambda: app.node.admissions["mock-slow"].in_flight == 0)
        record = await _record(app, "gone")
        assert record.status is RunStatus.CANCELLED and record.error_message.startswith("connection closed")


async def test_queue_overflow_and_priority_order(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        holder = await connection.open_run(chat(model="mock-slow", run_id="holder"))
        await anext(holder)
        low = await connection.open_run(
            chat(model="mock-slow", run_id="low", priority=-1, sampling=pb.Sampling(max_tokens=1))
        )
        await assert_eventually(lambda: app.node.admissions["mock-slow"].queued == 1)
        high = await connection.open_run(
            chat(model="mock-slow", run_id="high", priority=5, sampling=pb.Sampling(max_tokens=1))
        )
        await assert_eventually(lambda: app.node.admissions["mock-slow"].queued == 2)
        overflow = await collect(await connection.open_run(chat(model="mock-slow", run_id="over")))
        assert overflow[-1].error.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED and overflow[-1].error.retryable
        finished: list[str] = []

        async def drain(name: str, stream) -> None:  # type: ignore[no-untyped-def]
            await collect(stream)
            finished.append(name)

        tasks = [asyncio.create_task(drain("low", low)), asyncio.create_task(drain("high", high))]
        await holder.cancel()
        await asyncio.gather(*tasks)
        assert finished == ["high", "low"]  # the higher priority left the queue first
        await connection.close()


async def test_a_deadline_shortens_a_cli_programs_timeout(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    import datetime
    import time

    async with running_node(settings) as app:
        connection = await client(app, pki)
        soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=0.3)
        started = time.monotonic()
        events = await collect(await connection.open_run(chat(model="sleeper", deadline=soon)))  # 30 s program
        assert events[-1].error.code == pb.ERROR_CODE_DEADLINE_EXCEEDED
        assert time.monotonic() - started < 5
        past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=1)
        events = await collect(await connection.open_run(chat(model="missing", deadline=past)))
        assert events[-1].error.code == pb.ERROR_CODE_DEADLINE_EXCEEDED
        await connection.close()


async def test_deadline_exceeded(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    import datetime

    async with running_node(settings) as app:
        connection = await client(app, pki)
        soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=0.3)
        events = await collect(await connection.open_run(chat(model="mock-slow", run_id="late", deadline=soon)))
        assert events[-1].error.code == pb.ERROR_CODE_DEADLINE_EXCEEDED
        assert (await _record(app, "late")).status is RunStatus.FAILED
        await connection.close()


async def test_mock_failure_injection(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        failed = await collect(await connection.open_run(chat(metadata={"mock.fail_after": "3"})))
        assert kinds(failed) == ["start", "delta", "delta", "delta", "error"]
        assert failed[-1].error.code == pb.ERROR_CODE_BACKEND_ERROR
        crashed = await collect(await connection.open_run(chat(metadata={"mock.crash_after": "1"})))
        assert crashed[-1].error.code == pb.ERROR_CODE_INTERNAL
        bad = await collect(await connection.open_run(chat(metadata={"mock.tokens": "many"})))
        assert bad[-1].error.code == pb.ERROR_CODE_INVALID_ARGUMENT and "mock.tokens" in bad[-1].error.message
        await connection.close()


async def test_failed_and_cancelled_runs_record_the_tokens_they_streamed(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        failed = await collect(await connection.open_run(chat(run_id="f", metadata={"mock.fail_after": "3"})))
        streaming = await connection.open_run(chat(model="mock-slow", run_id="c"))
        seen = [await anext(streaming) for _ in range(5)]
        await streaming.cancel("enough")
        cancelled = seen + await collect(streaming)
        prompt_tokens = 3  # the mock counts "user: hello there" before its output: a word a token
        for run_id, events, status in (("f", failed, RunStatus.FAILED), ("c", cancelled, RunStatus.CANCELLED)):
            streamed = sum(1 for event in events if event.WhichOneof("event") == "delta")  # a token each
            record = await _record(app, run_id)
            assert record.status is status
            assert (record.prompt_tokens, record.completion_tokens) == (prompt_tokens, streamed)
            assert record.completion_tokens >= 3 and not record.usage_estimated  # exact, though it did not complete
            used = events[-1].error.usage  # and the terminal error says so, for the control-plane's ledger
            assert (used.prompt_tokens, used.completion_tokens, used.estimated) == (prompt_tokens, streamed, False)
        await connection.close()


async def test_a_cancelled_tool_call_records_the_fragments_it_streamed(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    parameters = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20)}}
    tools: list[Any] = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        request = chat(model="mock-slow", run_id="tc")
        request.openai_fields.update({"tools": tools})
        streaming = await connection.open_run(request)
        fragments = 4
        seen = [await anext(streaming) for _ in range(2 + fragments)]  # start, the call's id and name, arguments
        await streaming.cancel("enough")
        events = seen + await collect(streaming)
        arguments = [call.arguments for event in events if event.HasField("delta") for call in event.delta.tool_calls]
        streamed = sum(1 for piece in arguments if piece)
        assert streamed >= fragments and events[-1].error.code == pb.ERROR_CODE_CANCELLED
        record = await _record(app, "tc")
        assert record.status is RunStatus.CANCELLED
        assert (record.completion_tokens, record.usage_estimated) == (streamed, False), "a fragment a token, exact"
        used = events[-1].error.usage
        assert (used.completion_tokens, used.estimated) == (streamed, False)
        await connection.close()


async def test_a_schema_bound_that_bites_is_counted_by_bound(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    long = {"type": "object", "properties": {"s": {"type": "string", "minLength": 10**6}}}
    tools: list[Any] = [{"type": "function", "function": {"name": "f", "parameters": long}}]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        request = chat(run_id="sb", sampling=pb.Sampling(max_tokens=4))
        request.openai_fields.update({"tools": tools})
        events = await collect(await connection.open_run(request))
        assert events[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH
        assert (await _record(app, "sb")).extra["schema_bounded"] == "tool 'f': string"
        sample = app.metrics.registry.get_sample_value("iop_node_schema_bounded_total", {"bound": "string"})
        assert sample == 1.0
        await connection.close()


async def test_metrics_exposed(pki: Pki, tmp_path: Path) -> None:
    import urllib.request

    settings = node_settings(pki, tmp_path, ROUTES[:1], metrics={"port": 0})
    async with running_node(settings) as app:
        connection = await client(app, pki)
        await collect(await connection.open_run(chat()))
        await collect(await connection.open_run(chat(model="nope")))
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{app.metrics_port}/metrics", timeout=5).read().decode()
        )
        assert 'iop_node_runs_total{model="mock-small",status="completed"} 1.0' in body
        assert 'iop_node_runs_total{model="(unrouted)",status="failed"} 1.0' in body  # no label per bad name
        assert "iop_node_time_to_first_token_seconds_bucket" in body
        assert "iop_node_inter_token_latency_seconds_count" in body
        assert 'iop_node_runs_in_flight{model="mock-small"} 0.0' in body
        await connection.close()


async def test_closing_a_connection_with_running_and_queued_runs_records_both_cancelled(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        connection = await client(app, pki)
        holder = await connection.open_run(chat(model="mock-slow", run_id="holding"))
        await anext(holder)
        await connection.open_run(chat(model="mock-slow", run_id="queued"))
        await assert_eventually(lambda: app.node.admissions["mock-slow"].queued == 1)
        connection._writer.transport.abort()  # both runs are cancelled in the same turn
        await assert_eventually(lambda: app.node.admissions["mock-slow"].in_flight == 0)
        for run_id in ("holding", "queued"):
            record = await _record(app, run_id)
            assert record.status is RunStatus.CANCELLED, (run_id, record.error_code, record.error_message)
        assert app.node.admissions["mock-slow"].queued == 0


async def test_run_ids_are_scoped_to_the_connection_and_identity_comes_from_the_certificate(settings, pki: Pki) -> None:  # type: ignore[no-untyped-def]
    async with running_node(settings) as app:
        assert app.listener is not None
        first, second = await client(app, pki), await client(app, pki)
        admin = await dial(
            "127.0.0.1", app.listener.port, tls=pki.config("admin-t", Role.ADMIN), server_hostname="localhost"
        )
        await collect(await first.open_run(chat(run_id="same", caller=pb.Caller(id="alice"))))
        await collect(await second.open_run(chat(run_id="same", model="nope")))
        await collect(await admin.open_run(chat(run_id="same", caller=pb.Caller(id="alice"))))
        assert isinstance(app.store, SqliteRunStore)
        rows = {row.connection: row for row in await app.store.list()}
        assert len(rows) == 3  # one row per connection, none written over
        by_outcome = sorted((row.peer, row.caller, row.status.value) for row in rows.values())
        assert by_outcome == [
            ("admin-t", "admin-t", "completed"),  # an admin acts for nobody: the named caller is ignored
            ("edge-t", "alice", "completed"),  # an edge acts for its callers
            ("edge-t", "edge-t", "failed"),
        ]
        for connection in (first, second, admin):
            await connection.close()
