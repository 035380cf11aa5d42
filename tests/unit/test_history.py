"""What ``iop runs`` prints: parsing --since and formatting runs, with no files."""

from __future__ import annotations

import datetime

import pytest

from iop_node.domain import RunRecord, RunStatus
from iop_node.history import format_record, format_table, parse_since

UTC = datetime.UTC
NOW = datetime.datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", NOW - datetime.timedelta(seconds=30)),
        ("10m", NOW - datetime.timedelta(minutes=10)),
        ("2h", NOW - datetime.timedelta(hours=2)),
        ("7d", NOW - datetime.timedelta(days=7)),
        (" 0s ", NOW),
        ("2026-04-30T08:15:00", datetime.datetime(2026, 4, 30, 8, 15, tzinfo=UTC)),
        ("2026-04-30T08:15:00Z", datetime.datetime(2026, 4, 30, 8, 15, tzinfo=UTC)),
        ("2026-04-30T10:15:00+02:00", datetime.datetime(2026, 4, 30, 8, 15, tzinfo=UTC)),
        ("2026-04-30", datetime.datetime(2026, 4, 30, tzinfo=UTC)),
    ],
)
def test_parse_since_accepts_iso_times_and_durations(text: str, expected: datetime.datetime) -> None:
    parsed = parse_since(text, now=NOW)
    assert parsed == expected and parsed.tzinfo == UTC


def test_parse_since_defaults_to_the_current_time() -> None:
    before = datetime.datetime.now(UTC)
    parsed = parse_since("1h")
    assert before - datetime.timedelta(hours=1) <= parsed <= datetime.datetime.now(UTC) - datetime.timedelta(hours=1)


@pytest.mark.parametrize("text", ["", "10", "10x", "-5m", "5 m", "1.5h", "yesterday", "2026-13-01", "9" * 20 + "d"])
def test_parse_since_rejects_other_text_naming_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"ISO 8601.*30s, 10m, 2h, 7d") as caught:
        parse_since(text, now=NOW)
    assert "\n" not in str(caught.value) and repr(text.strip()) in str(caught.value)


def _full() -> RunRecord:
    return RunRecord(
        run_id="run-1",
        node_id="node-a",
        model="llama",
        status=RunStatus.FAILED,
        caller="alice",
        peer="edge-1",
        connection="c0ffee",
        adapter="cli",
        error_code="BACKEND_ERROR",
        error_message="exit status 3",
        received_at=NOW,
        started_at=NOW + datetime.timedelta(milliseconds=10),
        first_token_at=NOW + datetime.timedelta(milliseconds=260),
        finished_at=NOW + datetime.timedelta(milliseconds=1500),
        prompt_tokens=12,
        completion_tokens=34,
        usage_estimated=True,
        finish_reason="error",
        stderr_tail="first line\nsecond line",
        extra={"pid": "42"},
    )


def _bare() -> RunRecord:
    return RunRecord(run_id="run-2", node_id="node-a", model="m", status=RunStatus.RUNNING)


def test_format_table_lines_up_columns_with_a_header() -> None:
    lines = format_table([_full(), _bare()]).splitlines()
    assert lines[0].split() == [
        "RUN",
        "ID",
        "MODEL",
        "PEER",
        "ADAPTER",
        "STATUS",
        "ERROR",
        "RECEIVED",
        "TTFT",
        "(ms)",
        "DURATION",
        "(ms)",
        "TOKENS",
    ]
    assert lines[1].split() == [
        "run-1",
        "llama",
        "edge-1",
        "cli",
        "failed",
        "BACKEND_ERROR",
        "2026-05-01T12:00:00Z",
        "250",
        "1500",
        "12/34~",  # _full's counts are estimated: marked
    ]
    assert lines[2].split() == ["run-2", "m", "-", "-", "running", "-", "-", "-", "-", "0/0"]
    assert [line.index("MODEL") for line in lines[:1]] == [lines[1].index("llama")] == [lines[2].index("m ")]


def test_format_table_shows_a_long_error_message_cut_short() -> None:
    record = _bare()
    record.error_message = "node stopped while the run was in progress"
    row = format_table([record]).splitlines()[1]
    assert " node stopped while the run was in pro...  " in row


def test_format_table_of_no_runs() -> None:
    assert format_table([]) == "no runs"


def test_format_record_shows_every_field_with_the_stderr_tail_last() -> None:
    text = format_record(_full())
    lines = text.splitlines()
    assert lines[0] == "run_id: run-1"
    for line in [
        "status: failed",
        "caller: alice",
        "peer: edge-1",
        "connection: c0ffee",
        "error_message: exit status 3",
        "received_at: 2026-05-01T12:00:00+00:00",
        "first_token_at: 2026-05-01T12:00:00.260000+00:00",
        "completion_tokens: 34",
        "usage_estimated: True",
        'extra: {"pid": "42"}',
        "ttft_ms: 250",
        "duration_ms: 1500",
    ]:
        assert line in lines
    assert lines[-3:] == ["stderr_tail:", "    first line", "    second line"]
    keys = {line.split(":")[0] for line in lines if not line.startswith(" ")}
    assert set(RunRecord.__dataclass_fields__) <= keys


def test_format_record_shows_unknowns_as_a_dash() -> None:
    lines = format_record(_bare()).splitlines()
    keys = ["caller", "peer", "connection", "adapter", "error_code", "finished_at", "extra", "ttft_ms", "duration_ms"]
    for key in keys:
        assert f"{key}: -" in lines
    assert "prompt_tokens: 0" in lines and "usage_estimated: False" in lines
    assert lines[-1] == "stderr_tail: -"


def test_only_estimated_token_counts_are_marked() -> None:
    reported = _full()
    reported.usage_estimated = False
    assert format_table([reported]).splitlines()[1].split()[-1] == "12/34"
