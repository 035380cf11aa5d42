"""The mock adapter continues a run exactly: delivered part + continued part == the uninterrupted run."""

from __future__ import annotations

import pytest
from conftest import TextSink

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters.mock import MockAdapter, MockOptions
from iop_node.domain import ExecutionSpec


def _spec(kind: pb.RunKind.ValueType, continuation: pb.Continuation | None = None) -> ExecutionSpec:
    request = pb.RunRequest(run_id="r", model="m", kind=kind, stream=True)
    if kind == pb.RUN_KIND_CHAT:
        request.messages.append(pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text="tell me a story")]))
    else:
        request.prompt.append("Once upon a time")
    if continuation is not None:
        request.continuation.CopyFrom(continuation)
    return ExecutionSpec(request, "mock", "m", kind, pb.Sampling(max_tokens=20), {})


async def _run(spec: ExecutionSpec) -> TextSink:
    sink = TextSink()
    await MockAdapter({"m": MockOptions(tokens=30)}).execute(spec, sink)
    return sink


@pytest.mark.parametrize("kind", [pb.RUN_KIND_CHAT, pb.RUN_KIND_COMPLETION])
@pytest.mark.parametrize("cut", [0, 1, 7, 19, 20])
async def test_a_continued_run_joined_to_its_delivered_part_is_the_uninterrupted_run(
    kind: pb.RunKind.ValueType, cut: int
) -> None:
    whole = await _run(_spec(kind))
    assert len(whole.deltas) == 20 and whole.usage is not None
    earlier = pb.Continuation(
        text="".join(whole.deltas[:cut]), completion_tokens=cut, migration=2, continuation_prompt_tokens=3
    )
    rest = await _run(_spec(kind, earlier))
    assert "".join(whole.deltas[:cut]) + "".join(rest.deltas) == "".join(whole.deltas)
    assert rest.finish == whole.finish == pb.FINISH_REASON_LENGTH
    assert rest.usage is not None
    assert (rest.usage.prompt_tokens, rest.usage.completion_tokens) == (whole.usage.prompt_tokens, 20)
    assert rest.usage.continuation_prompt_tokens == 3 + cut  # earlier migrations' cost, and this one's re-read
    assert whole.usage.continuation_prompt_tokens == 0


async def test_the_mock_says_it_continues_chat_and_completions_but_not_embeddings() -> None:
    (model,) = await MockAdapter({"m": MockOptions()}).capabilities()
    assert list(model.continuable_kinds) == [pb.RUN_KIND_CHAT, pb.RUN_KIND_COMPLETION]
