"""What a node counts for a run that ends without completing (its terminal error's usage): the output's
token ids when every delta carried them, else its text at ~4 characters a token."""

from __future__ import annotations

import datetime
from typing import Any

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.core import MeteredSink
from iop_node.domain import ExecutionSpec, RunRecord, RunStatus
from iop_node.metrics import NodeMetrics


class _Wire:
    """The wire's sink, keeping nothing."""

    async def output(self, delta: pb.RunDelta) -> None:
        pass

    async def delta(self, text: str) -> None:
        pass


def _sink() -> MeteredSink:
    request = pb.RunRequest(model="m", prompt=["x" * 40])  # 10 tokens at ~4 characters a token
    spec = ExecutionSpec(request, "mock", "m", pb.RUN_KIND_COMPLETION, pb.Sampling(), {})
    record = RunRecord(run_id="r", node_id="n", model="m", status=RunStatus.RUNNING)
    record.received_at = record.started_at = datetime.datetime.now(datetime.UTC)
    wire: Any = _Wire()
    return MeteredSink(wire, spec, record, NodeMetrics().model("m"))


async def test_token_ids_count_the_output_when_every_delta_carries_them() -> None:
    sink = _sink()
    await sink.output(pb.RunDelta(text="a long word", token_ids=[1, 2]))
    await sink.output(pb.RunDelta(text="another", token_ids=[3]))
    assert sink.estimated_usage() == pb.Usage(prompt_tokens=10, completion_tokens=3, estimated=True)


async def test_text_counts_the_output_when_a_delta_has_no_ids() -> None:
    sink = _sink()
    await sink.output(pb.RunDelta(text="a long word", token_ids=[1, 2]))
    await sink.delta("another")  # 18 characters in all
    assert sink.estimated_usage() == pb.Usage(prompt_tokens=10, completion_tokens=5, estimated=True)


async def test_a_prompt_the_backend_counted_and_token_ids_make_the_usage_exact() -> None:
    sink = _sink()
    sink.counting(7)  # a backend that reports its prompt's tokens before its output
    await sink.output(pb.RunDelta(text="a long word", token_ids=[1, 2]))
    assert sink.estimated_usage() == pb.Usage(prompt_tokens=7, completion_tokens=2, estimated=False)
    await sink.output(pb.RunDelta(text="no ids"))  # a part without ids: the output is estimated from its text
    assert sink.estimated_usage() == pb.Usage(prompt_tokens=7, completion_tokens=5, estimated=True)


async def test_a_token_a_delta_counts_the_output_exactly_and_nothing_streamed_is_zero() -> None:
    sink = _sink()
    sink.counting(7, token_per_delta=True)  # the mock: a word a token
    assert sink.estimated_usage() == pb.Usage(prompt_tokens=7, completion_tokens=0, estimated=False)
    for word in ("the ", "cluster ", "answer "):
        await sink.delta(word)
    assert sink.estimated_usage() == pb.Usage(prompt_tokens=7, completion_tokens=3, estimated=False)
    unsaid = _sink()  # no count of the prompt: estimated from its text, whatever the output
    await unsaid.output(pb.RunDelta(text="abc", token_ids=[1]))
    assert unsaid.estimated_usage() == pb.Usage(prompt_tokens=10, completion_tokens=1, estimated=True)


async def test_tool_call_arguments_are_output_a_fragment_a_token() -> None:
    sink = _sink()
    sink.counting(7, token_per_delta=True)  # the mock: a fragment of arguments a token
    await sink.output(pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, id="call_1", function_name="f")]))
    for piece in ('{"city"', ': "Paris', '"}'):
        await sink.output(pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, arguments=piece)]))
    assert sink.estimated_usage() == pb.Usage(prompt_tokens=7, completion_tokens=3, estimated=False)
    estimated = _sink()  # no token a delta: the arguments' characters, ~4 a token
    await estimated.output(pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, arguments='{"city": "Paris"}')]))
    assert estimated.estimated_usage() == pb.Usage(prompt_tokens=10, completion_tokens=5, estimated=True)  # 17 chars
