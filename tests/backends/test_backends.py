"""The backend test infrastructure itself: the tiny model, both real servers, their stream shapes.

Skips (with the install command as reason) where tests/backends/install.sh has not run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from backends.servers import BackendServer, http_json, http_lines
from backends.tiny_model import SHA256

pytest_plugins = ["backends.fixtures"]


def test_tiny_model_is_byte_identical(tiny_gguf: Path) -> None:
    assert hashlib.sha256(tiny_gguf.read_bytes()).hexdigest() == SHA256


def _sse(lines: list[str]) -> list[dict[str, Any]]:
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_llama_streams_chat_to_length(llama_backend: BackendServer) -> None:
    models = http_json(llama_backend.openai_url + "/models")
    assert [entry["id"] for entry in models["data"]] == ["tiny"]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = _sse(list(http_lines(llama_backend.openai_url + "/chat/completions", body)))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None] * 9 + ["length"]
    # llama-cpp-python ignores stream_options: no usage chunk (vLLM and Ollama's /v1 send one).
    assert not any("usage" in chunk for chunk in chunks)
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert text.strip() and text.isprintable()


def test_llama_embeddings(llama_embedding_backend: BackendServer) -> None:
    body = {"model": "tiny", "input": ["hello", "world"]}
    answer = http_json(llama_embedding_backend.openai_url + "/embeddings", body)
    assert [len(item["embedding"]) for item in answer["data"]] == [64, 64]


def test_ollama_openai_stream_ends_with_usage(ollama_backend: BackendServer) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = _sse(list(http_lines(ollama_backend.openai_url + "/chat/completions", body)))
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def test_ollama_embed(ollama_backend: BackendServer) -> None:
    answer = http_json(ollama_backend.base_url + "/api/embed", {"model": "tiny", "input": ["hello", "world"]})
    assert [len(vector) for vector in answer["embeddings"]] == [64, 64]


def test_ollama_streams_chat_to_length(ollama_backend: BackendServer) -> None:
    tags = http_json(ollama_backend.base_url + "/api/tags")
    assert [entry["name"] for entry in tags["models"]] == ["tiny:latest"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "options": {"num_predict": 8}}
    lines = [json.loads(line) for line in http_lines(ollama_backend.base_url + "/api/chat", body)]
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["done_reason"] == "length"
    assert lines[-1]["eval_count"] == 8
    assert lines[-1]["prompt_eval_count"] > 0


def test_kill_ends_the_stream_and_leaves_no_process(ollama_backend_fresh: BackendServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "options": {"num_predict": 100_000}}
    group = ollama_backend_fresh.process.pid
    received = []
    for line in http_lines(ollama_backend_fresh.base_url + "/api/chat", body):
        received.append(json.loads(line))
        if len(received) == 3:
            assert len(_members(group)) >= 2  # the server and the runner it started for the model
            ollama_backend_fresh.kill()
    assert not received[-1]["done"]
    assert not ollama_backend_fresh.alive()
    _assert_group_gone(group)


def test_stop_leaves_no_process(ollama_backend_fresh: BackendServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "options": {"num_predict": 2}}
    list(http_lines(ollama_backend_fresh.base_url + "/api/chat", body))  # the model is loaded: a runner runs
    group = ollama_backend_fresh.process.pid
    assert len(_members(group)) >= 2
    ollama_backend_fresh.stop()
    assert not ollama_backend_fresh.alive()
    _assert_group_gone(group)


def _assert_group_gone(group: int) -> None:
    """Every process of the group is dead, by the helper's own doing: this sends no signal.

    A zombie child not yet reaped by init still counts as a group member: it is dead. A signal
    takes a moment to land, so poll with a deadline.
    """
    deadline = time.monotonic() + 5
    while not all(_state(pid) == "Z" for pid in _members(group)):
        assert time.monotonic() < deadline, [(pid, _state(pid)) for pid in _members(group)]
        time.sleep(0.01)


def _members(group: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == group:
                    pids.append(int(entry.name))
            except ProcessLookupError:
                continue
    return pids


def _state(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
