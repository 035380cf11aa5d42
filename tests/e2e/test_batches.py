"""OpenAI's Files and Batch APIs through the edge and the worker, with the official SDK."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from .batch_helpers import worker_reachable
from .conftest import MOCK_ROUTES, Stack, batch_ended, file_lines, running_stack, wait_for
from .openai_schema import validate


@pytest.fixture(scope="module")
def batch_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = {"batches": {"poll_interval": 0.05, "lease_seconds": 2.0}}
    with running_stack(tmp_path_factory.mktemp("batches"), {"node-a": MOCK_ROUTES}, worker=settings) as stack:
        yield worker_reachable(stack)


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _upload(client: openai.OpenAI, lines: list[dict[str, Any]], name: str = "input.jsonl") -> str:
    uploaded = client.files.create(file=(name, io.BytesIO(_jsonl(lines))), purpose="batch")
    validate("OpenAIFile", uploaded.model_dump(mode="json", exclude_unset=True))
    return uploaded.id


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (
            "/v1/chat/completions",
            {"model": "mock-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        ),
        ("/v1/completions", {"model": "mock-small", "prompt": "once", "max_tokens": 3}),
        ("/v1/embeddings", {"model": "mock-small", "input": "embed me"}),
    ],
)
def test_a_batch_runs_every_line_once(batch_stack: Stack, endpoint: str, body: dict[str, Any]) -> None:
    client = batch_stack.client()
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": endpoint, "body": body} for i in range(20)]
    lines.append({"custom_id": "missing", "method": "POST", "url": endpoint, "body": {**body, "model": "no-such"}})
    batch = client.batches.create(input_file_id=_upload(client, lines), endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
    raw = client.batches.with_raw_response.retrieve(batch.id).http_response.json()
    validate("Batch", raw)
    done = batch_ended(client, batch.id)
    validate("Batch", client.batches.with_raw_response.retrieve(batch.id).http_response.json())
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (21, 20, 1)
    output, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{i}" for i in range(20))
    assert [line["custom_id"] for line in errors] == ["missing"]
    for line in output:
        assert line["response"]["status_code"] == 200 and line["error"] is None
        schema = {
            "/v1/chat/completions": "CreateChatCompletionResponse",
            "/v1/completions": "CreateCompletionResponse",
            "/v1/embeddings": "CreateEmbeddingResponse",
        }[endpoint]
        validate(schema, line["response"]["body"])
    assert errors[0]["response"]["status_code"] == 404 and errors[0]["error"]["message"]
    listed = client.batches.with_raw_response.list(limit=100).http_response.json()
    validate("ListBatchesResponse", listed)
    assert batch.id in [item["id"] for item in listed["data"]]


@pytest.mark.parametrize(
    ("line", "code"),
    [
        ("not json", "invalid_json_line"),
        (json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}), "missing_required_parameter"),
        (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}), "mismatched_endpoint"),
    ],
)
def test_a_bad_line_fails_the_batch_at_validation_naming_it(batch_stack: Stack, line: str, code: str) -> None:
    client = batch_stack.client()
    good = json.dumps({"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}})
    uploaded = client.files.create(file=("bad.jsonl", io.BytesIO(f"{good}\n{line}\n".encode())), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = batch_ended(client, batch.id)
    assert done.status == "failed"
    assert done.errors is not None and done.errors.data
    assert (done.errors.data[0].code, done.errors.data[0].line) == (code, 2)
    validate("Batch", client.batches.with_raw_response.retrieve(batch.id).http_response.json())


def test_a_wrong_purpose_is_a_400_naming_it(batch_stack: Stack) -> None:
    client = batch_stack.client()
    with pytest.raises(openai.BadRequestError) as upload:
        client.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert upload.value.status_code == 400 and upload.value.body["param"] == "purpose"  # type: ignore[index]
    body = {"model": "mock-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    line = {"custom_id": "only", "method": "POST", "url": "/v1/chat/completions", "body": body}
    done = batch_ended(
        client,
        client.batches.create(
            input_file_id=_upload(client, [line]), endpoint="/v1/chat/completions", completion_window="24h"
        ).id,
    )
    assert done.output_file_id is not None
    with pytest.raises(openai.BadRequestError) as create:  # an output file (purpose batch_output) as input
        client.batches.create(
            input_file_id=done.output_file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert create.value.status_code == 400 and create.value.body["param"] == "input_file_id"  # type: ignore[index]
    validate("ErrorResponse", {"error": create.value.body})


def test_a_repeated_custom_id_fails_the_batch(batch_stack: Stack) -> None:
    client = batch_stack.client()
    line = {"custom_id": "same", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "mock-small"}}
    batch = client.batches.create(
        input_file_id=_upload(client, [line, line]), endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = batch_ended(client, batch.id)
    assert done.status == "failed" and done.errors is not None
    assert [(error.code, error.line) for error in done.errors.data] == [("duplicate_custom_id", 2)]


def test_a_missing_file_is_404_and_a_cancel_keeps_the_finished_lines(batch_stack: Stack) -> None:
    client = batch_stack.client()
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    body = {"model": "mock-slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}  # 2 s each
    lines = [{"custom_id": f"s-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(200)]
    batch = client.batches.create(
        input_file_id=_upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )

    def some_finished() -> int:
        counts = client.batches.retrieve(batch.id).request_counts
        return counts.completed if counts is not None else 0

    finished = wait_for(some_finished, 20.0, 0.05, "lines finishing before the cancel")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = batch_ended(client, batch.id)
    assert done.status == "cancelled"
    assert done.request_counts is not None and finished <= done.request_counts.completed < 200
    kept = file_lines(client, done.output_file_id)
    assert len(kept) == done.request_counts.completed
    assert all(line["response"]["status_code"] == 200 for line in kept)


def test_files_list_retrieve_content_and_delete(batch_stack: Stack, tmp_path: Path) -> None:
    client = batch_stack.client()
    data = b"".join(b'{"n": %d}\n' % i for i in range(50_000))  # ~550 KB: several chunks each way
    uploaded = client.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
    assert uploaded.bytes == len(data)
    assert client.files.retrieve(uploaded.id).filename == "big.jsonl"
    assert client.files.content(uploaded.id).content == data
    listed = client.files.with_raw_response.list().http_response.json()
    validate("ListFilesResponse", listed)
    assert uploaded.id in [item["id"] for item in listed["data"]]
    validate("OpenAIFile", client.files.with_raw_response.retrieve(uploaded.id).http_response.json())
    deleted = client.files.with_raw_response.delete(uploaded.id).http_response.json()
    validate("DeleteFileResponse", deleted)
    assert deleted["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_100_mb_upload_streams_through_the_edge(batch_stack: Stack) -> None:
    """The edge holds a chunk or two of an upload, never the file: its memory grows by far less than 50 MB."""
    pid = int(json.loads((batch_stack.root / "edge.ready").read_text())["pid"])
    before = _rss_mb(pid)
    peak = before
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_mb(pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    size = 100 * 1024 * 1024
    try:
        client = batch_stack.client(timeout=120.0)
        uploaded = client.files.create(file=("big.jsonl", io.BytesIO(b"x" * size)), purpose="batch")
    finally:
        done.set()
        sampler.join()
    assert uploaded.bytes == size
    assert peak - before < 50, f"the edge grew from {before:.0f} MB to {peak:.0f} MB"
    assert client.files.delete(uploaded.id).deleted


def test_files_and_batches_belong_to_the_key_that_made_them(batch_stack: Stack) -> None:
    """Another key sees none of them: not in its lists, and a 404 for each id, as for an unknown one."""
    alice = batch_stack.client(batch_stack.new_key("alice"))
    bob = batch_stack.client(batch_stack.new_key("bob"))
    for client in (alice, bob):  # the edge reads new keys within about a second
        wait_for(lambda client=client: _authenticates(client), 5.0, 0.1, "the new keys")
    body = {"model": "mock-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    lines = [{"custom_id": f"a-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(3)]
    file_id = _upload(alice, lines)
    batch = alice.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    done = batch_ended(alice, batch.id)
    assert done.status == "completed" and done.output_file_id is not None
    output = done.output_file_id

    assert not {file_id, output} & {item.id for item in bob.files.list().data}
    assert batch.id not in {item.id for item in bob.batches.list().data}
    refused = {
        "files.retrieve": lambda: bob.files.retrieve(file_id),
        "files.content": lambda: bob.files.content(file_id),
        "output content": lambda: bob.files.content(output),
        "files.delete": lambda: bob.files.delete(file_id),
        "batches.retrieve": lambda: bob.batches.retrieve(batch.id),
        "batches.cancel": lambda: bob.batches.cancel(batch.id),
        "batches.create": lambda: bob.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    }
    for name, call in refused.items():
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.status_code == 404, name

    assert alice.files.retrieve(file_id).id == file_id  # bob's delete took nothing
    assert {file_id, output} <= {item.id for item in alice.files.list().data}
    assert batch.id in {item.id for item in alice.batches.list().data}
    assert sorted(line["custom_id"] for line in file_lines(alice, output)) == ["a-0", "a-1", "a-2"]
    ran = [record for record in batch_stack.runs("node-a") if record["caller"] == "alice"]
    assert len(ran) == 3  # the lines ran as alice's runs: her policy and usage on every node


def _authenticates(client: openai.OpenAI) -> bool:
    try:
        client.models.list()
    except openai.AuthenticationError:
        return False
    return True
