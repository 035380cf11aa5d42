"""Streams that survive a lost node (issue 22, item 4): a run cut mid-stream goes on on another node.

Real processes throughout (``iop control-plane``, ``iop node`` with the mock adapter, ``iop
edge``). 32 streams over three nodes, one node killed and another frozen under them, read at the
wire level where sequence numbers show: every stream completes, its text is byte for byte the
text of the same request run uninterrupted, its usage is that run's, its sequence has no gap. The
official SDK through the edge sees no error and the whole text. A model served by the cli adapter,
which cannot continue a run, still ends with node_lost when its node dies.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from .conftest import IOP, Stack, running_stack, wait_for
from .migration_helpers import (
    CONTINUED_ROUTES,
    MODEL,
    NODES,
    STREAMS,
    TOKENS,
    Received,
    attempts_on,
    control_plane_metric,
    cut_streams,
    dial_control_plane,
    receive_all,
    requests,
)
from .openai_schema import validate

CLI_MODEL = "cli-words"
SLOW_WORDS = """\
import sys, time
for index in range(100):
    sys.stdout.write(f"word{index} ")
    sys.stdout.flush()
    time.sleep(0.05)
"""
"""The cli route's program: 100 words at 20 a second, written as it goes (a backend that cannot continue)."""
T = TypeVar("T")
TELL: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me a long story"}]


def _whole(received: Received) -> None:
    """One start, then deltas, then one complete; sequence numbers 0, 1, 2, ... with no gap."""
    kinds = received.kinds()
    assert kinds[-1] == "complete", (received.request.run_id, received.end)
    assert kinds[0] == "start" and kinds.count("start") == 1, (received.request.run_id, kinds)
    assert set(kinds[1:-1]) == {"delta"}, (received.request.run_id, kinds)
    assert [event.sequence for _, event in received.events] == list(range(len(kinds))), received.request.run_id


# serial: five processes and 32 paced streams; under the parallel phase's load a starved heartbeat cuts runs again
@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.timeout(120)  # about 30 s alone, of which the platform's start 10
def test_32_streams_survive_a_killed_node_and_a_frozen_one(tmp_path: Path) -> None:
    nodes = dict.fromkeys(NODES, CONTINUED_ROUTES)
    with running_stack(tmp_path / "stack", nodes, control_plane={"metrics": {"port": 0}}) as stack:
        cut, (kill, freeze) = asyncio.run(cut_streams(stack, requests("cut"), (signal.SIGKILL, signal.SIGSTOP)))
        cut_ids = {run.request.run_id for run in cut}
        on_killed, on_frozen = attempts_on(stack, kill.node_id) & cut_ids, attempts_on(stack, freeze.node_id) & cut_ids
        continued = control_plane_metric(stack, 'iop_control_plane_migrations_total{outcome="continued"}')
        ledger = wait_for(lambda: _ledger(stack, cut_ids), 10, 0.1, "every cut run in the control-plane's ledger")
        wait_for(lambda: freeze.node_id in _ready(stack), 30, 0.1, "the thawed node registered again")
        whole = asyncio.run(_uninterrupted(stack, requests("whole")))

    assert on_killed and on_frozen, "both faults cut runs"
    print(
        f"cut: {len(on_killed)} runs by the kill, {len(on_frozen)} by the freeze; {kill.detection=} {freeze.detection=}"
    )
    for run, reference in zip(cut, whole, strict=True):
        _whole(run)
        assert run.text == reference.text, run.request.run_id
        usage, expected = run.end.complete.usage, reference.end.complete.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (expected.prompt_tokens, expected.completion_tokens)
        assert expected.completion_tokens == TOKENS and len(run.text.split()) == TOKENS
        lost = (run.request.run_id in on_killed) + (run.request.run_id in on_frozen)
        # a continued run's usage counts the delivered output each continuation re-read; an uncut one's is 0
        assert (usage.continuation_prompt_tokens > 0) == (lost > 0), (run.request.run_id, usage)
        entry = ledger[run.request.run_id]  # one attempt per node it ran on, the lost ones first
        assert (entry["status"], entry["migrations"], len(entry["attempts"])) == ("completed", lost, lost + 1), entry
        assert entry["attempts"][0]["node_id"] == run.started_on, entry
    assert continued == len(on_killed) + len(on_frozen)


async def _uninterrupted(stack: Stack, made: list[Any]) -> list[Received]:
    """The same requests again with nothing cut (the reference), each checked to be whole and never continued."""
    connection = await dial_control_plane(stack, "edge")
    try:
        whole = await receive_all(connection, made)
    finally:
        await connection.close()
    for received in whole:
        _whole(received)
        assert received.end.complete.usage.continuation_prompt_tokens == 0, received.request.run_id
    assert len(whole) == STREAMS
    return whole


def _ledger(stack: Stack, run_ids: set[str]) -> dict[str, dict[str, Any]] | None:
    """The control-plane ledger's records of ``run_ids`` (``iop runs ls --control-plane``); None until all are in."""
    address = f"127.0.0.1:{stack.cp_port}"
    command = [*IOP, "runs", "ls", "--control-plane", address, "--certs", str(stack.certs), "--json", "--limit", "200"]
    listed = json.loads(subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout)
    runs = {run["run_id"]: run for run in listed if run["run_id"] in run_ids}
    return runs if runs.keys() == run_ids else None


def _ready(stack: Stack) -> set[str]:
    listed = json.loads(stack.admin("ls", "--json").stdout)
    return {node["node_id"] for node in listed if node["state"] == "ready"}


@pytest.fixture(scope="module")
def two_nodes_and_a_cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two nodes serving the paced mock model (continuable) and a cli model (not), shared by the tests below;
    each test that kills a node starts it again."""
    root = tmp_path_factory.mktemp("migration")
    program = root / "slow_words.py"
    program.write_text(SLOW_WORDS)
    cli_route = {"model": CLI_MODEL, "adapter": "cli", "options": {"argv": [sys.executable, str(program)]}}
    routes = [*CONTINUED_ROUTES, cli_route]
    with running_stack(root / "stack", {"node-a": routes, "node-b": routes}) as started:
        yield started


def _kill_the_node_running(stack: Stack, model: str) -> str:
    doomed = wait_for(lambda: stack.running(model), 5, 0.01, f"a run of {model} on a node")
    stack.nodes[doomed].kill()
    return str(doomed)


def _read_killing_its_node(stack: Stack, chunks: Iterable[T], model: str, after: int = 6) -> list[T]:
    """Every chunk of a stream of ``model``; the node running it is killed once ``after`` chunks are in,
    and started again (registered) once the stream has ended, however it ended."""
    read, doomed = [], ""
    try:
        for chunk in chunks:
            read.append(chunk)
            if len(read) == after:
                doomed = _kill_the_node_running(stack, model)
    finally:
        if doomed:
            stack.nodes[doomed].restart()
            wait_for(lambda: _ready(stack) == set(stack.nodes), 30, 0.1, f"{doomed} registered again")
    assert doomed, "the stream ended before its node was killed"
    return read


def test_sdk_chat_stream_sees_no_error_when_its_node_dies(two_nodes_and_a_cli: Stack) -> None:
    client = two_nodes_and_a_cli.client()
    stream = client.chat.completions.create(
        model=MODEL, messages=TELL, stream=True, stream_options={"include_usage": True}
    )
    chunks = _read_killing_its_node(two_nodes_and_a_cli, stream, MODEL)  # an error event would raise APIError
    choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
    usage = chunks[-1].usage
    reference = client.chat.completions.create(model=MODEL, messages=TELL)
    assert "".join(choice.delta.content or "" for choice in choices) == reference.choices[0].message.content
    assert choices[-1].finish_reason == reference.choices[0].finish_reason
    assert usage is not None and reference.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (reference.usage.prompt_tokens, TOKENS)


def test_sdk_completion_stream_sees_no_error_when_its_node_dies(two_nodes_and_a_cli: Stack) -> None:
    client, prompt = two_nodes_and_a_cli.client(), "once upon a time"
    stream = client.completions.create(  # max_tokens: the completions API's default is 16
        model=MODEL, prompt=prompt, max_tokens=TOKENS, stream=True, stream_options={"include_usage": True}
    )
    chunks = _read_killing_its_node(two_nodes_and_a_cli, stream, MODEL)
    usage = chunks[-1].usage
    reference = client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS)
    assert "".join(choice.text for chunk in chunks for choice in chunk.choices) == reference.choices[0].text
    assert usage is not None and reference.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (reference.usage.prompt_tokens, TOKENS)


def test_a_run_its_adapter_cannot_continue_ends_with_node_lost(two_nodes_and_a_cli: Stack) -> None:
    stack = two_nodes_and_a_cli
    body = {"model": CLI_MODEL, "messages": TELL, "stream": True}
    with stack.http() as http, http.stream("POST", "/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = (line.removeprefix("data: ") for line in response.iter_lines() if line)
        payloads = _read_killing_its_node(stack, lines, CLI_MODEL, after=3)
    assert "[DONE]" not in payloads, "an error must not look like a finished stream"
    *chunks, last = (json.loads(payload) for payload in payloads)
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    validate("ErrorResponse", last)
    assert last["error"]["type"] == "server_error" and last["error"]["code"] == "node_lost", last
    assert "not continued" in last["error"]["message"], last  # the control-plane says why, not just that

    # the SDK turns that event into APIError, as before continuation existed
    stream = stack.client().chat.completions.create(model=CLI_MODEL, messages=TELL, stream=True)
    with pytest.raises(openai.APIError) as caught:
        _read_killing_its_node(stack, stream, CLI_MODEL, after=3)
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "node_lost"
