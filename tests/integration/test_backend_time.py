"""The backend's own time, as the node's HTTP client sees it (its request written to the response's
last byte read), is the run's ``generation`` timing: the node's own work on the answer is not in it,
so the edge's x-iop-overhead-ms (the request's time minus ``generation``) counts that work as IOP's.

A real OpenAI-compatible server in a subprocess (tests/bench/fast_openai.py, paced at 100 tokens a
second) and the real vllm adapter; the sink stands in for the node's work, slow on purpose.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters.vllm import VllmAdapter, VllmOptions
from iop_node.domain import ExecutionSpec

FAST_OPENAI = Path(__file__).resolve().parents[1] / "bench" / "fast_openai.py"
TOKENS = 10
BACKEND_SECONDS = TOKENS / 100  # the server's pace: 100 tokens a second
NODE_WORK = 0.05
"""Seconds the sink takes per output: the node's own work on the answer."""


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    with subprocess.Popen([sys.executable, str(FAST_OPENAI), "0", "100"], stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            yield int(process.stdout.readline())
        finally:
            process.terminate()
            process.wait(timeout=10)


class SlowSink:
    """Takes NODE_WORK seconds for each output, as a busy node would; keeps the timings it is given."""

    def __init__(self) -> None:
        self.outputs = 0
        self.timings: pb.Timings | None = None

    async def delta(self, text: str) -> None:
        await self.output(pb.RunDelta(text=text))

    async def output(self, delta: pb.RunDelta) -> None:
        self.outputs += 1
        await asyncio.sleep(NODE_WORK)

    async def complete(
        self, finish_reason: pb.FinishReason.ValueType, usage: pb.Usage | None = None, timings: pb.Timings | None = None
    ) -> None:
        self.timings = timings

    def annotate(self, key: str, value: str) -> None:
        pass


def _spec(*, stream: bool) -> ExecutionSpec:
    message = pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text="hi")])
    request = pb.RunRequest(run_id="r1", model="fast", messages=[message], stream=stream)
    return ExecutionSpec(
        request=request,
        adapter="vllm",
        target_model="fast",
        kind=pb.RUN_KIND_CHAT,
        sampling=pb.Sampling(max_tokens=TOKENS),
        openai_fields={},
        deadline=None,
    )


@pytest.mark.serial  # alone, after the parallel tests: generation is measured against the backend's pace, 10 % margin
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_generation_is_the_backends_time_without_the_nodes_work(server: int, stream: bool) -> None:
    adapter = VllmAdapter({"fast": VllmOptions(base_url=f"http://127.0.0.1:{server}")})
    sink = SlowSink()
    try:
        started = time.perf_counter()
        await adapter.execute(_spec(stream=stream), sink)
        took = time.perf_counter() - started
    finally:
        await adapter.aclose()
    assert sink.outputs >= 1
    assert sink.timings is not None and sink.timings.HasField("generation")
    generation = sink.timings.generation.ToNanoseconds() / 1e9
    assert BACKEND_SECONDS * 0.9 <= generation < took - NODE_WORK * sink.outputs * 0.8, (generation, took)
