"""Delivered: what a relay keeps of a run's output, and the continuation it builds from it."""

from __future__ import annotations

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.continuation import Delivered


def _chat(**fields: object) -> pb.RunRequest:
    return pb.RunRequest(run_id="r", model="m", kind=pb.RUN_KIND_CHAT, **fields)  # type: ignore[arg-type]


def test_text_and_token_ids_are_handed_on_exactly_when_every_delta_carried_ids() -> None:
    delivered = Delivered(_chat())
    for text, ids in (("Hel", [1]), ("lo", [2, 3]), ("", [])):
        delivered.add(pb.RunDelta(text=text, token_ids=ids))
    continuation = delivered.continuation()
    assert continuation == pb.Continuation(text="Hello", token_ids=[1, 2, 3], completion_tokens=3, migration=1)


def test_one_delta_without_ids_makes_the_count_an_estimate_and_drops_the_ids() -> None:
    delivered = Delivered(_chat())
    delivered.add(pb.RunDelta(text="a", token_ids=[7]))
    delivered.add(pb.RunDelta(text="b c"))
    continuation = delivered.continuation()
    assert continuation is not None
    assert (continuation.text, list(continuation.token_ids), continuation.completion_tokens) == ("ab c", [], 2)


def test_a_second_migration_carries_the_first_ones_output_and_cost() -> None:
    base = pb.Continuation(text="one ", token_ids=[1], completion_tokens=1, migration=1, continuation_prompt_tokens=0)
    delivered = Delivered(_chat(continuation=base))
    delivered.add(pb.RunDelta(text="two ", token_ids=[2]))
    first = delivered.continuation()
    assert first == pb.Continuation(
        text="one two ", token_ids=[1, 2], completion_tokens=2, migration=2, continuation_prompt_tokens=1
    )
    delivered.sent(first)
    delivered.add(pb.RunDelta(text="three", token_ids=[3]))
    second = delivered.continuation()
    assert second is not None
    assert (second.text, second.migration, second.continuation_prompt_tokens) == ("one two three", 3, 3)


def test_tool_calls_embeddings_several_prompts_and_too_much_text_are_not_continued() -> None:
    offered = _chat()
    offered.openai_fields.update({"tools": [{"type": "function", "function": {"name": "f"}}]})
    tools = Delivered(offered)
    tools.add(pb.RunDelta(text="x"))
    tools.add(pb.RunDelta(tool_calls=[pb.ToolCallDelta(index=0, function_name="f")]))
    assert tools.continuation() is None and "tool calls" in tools.why_not
    embedding = Delivered(pb.RunRequest(kind=pb.RUN_KIND_EMBEDDING, prompt=["a"]))
    assert embedding.continuation() is None and "embeddings" in embedding.why_not
    prompts = Delivered(pb.RunRequest(kind=pb.RUN_KIND_COMPLETION, prompt=["a", "b"]))
    assert prompts.continuation() is None and "2 prompts" in prompts.why_not
    long = Delivered(_chat(), limit=5)
    long.add(pb.RunDelta(text="abc"))
    assert long.continuation() is not None
    long.add(pb.RunDelta(text="def"))
    assert long.continuation() is None and "5 characters" in long.why_not and long.text == ""


def test_a_refused_continuation_costs_nothing_and_keeps_its_number_free() -> None:
    delivered = Delivered(_chat())
    delivered.add(pb.RunDelta(text="a b", token_ids=[1, 2]))
    first = delivered.continuation()
    assert first is not None
    delivered.sent(first)
    delivered.refused()  # the node refused it before reading it
    again = delivered.continuation()
    assert again == first  # migration 1 again, and no re-read counted for the refusal
    delivered.sent(first)
    second = delivered.continuation()
    assert second is not None and (second.migration, second.continuation_prompt_tokens) == (2, 2)


def test_a_peer_flooding_token_ids_gets_them_dropped_not_held() -> None:
    delivered = Delivered(_chat())
    delivered.add(pb.RunDelta(text="a", token_ids=[1]))
    delivered.add(pb.RunDelta(text="b", token_ids=list(range(100_000))))  # a lying node: 100,000 ids for one letter
    continuation = delivered.continuation()
    assert continuation is not None
    assert (continuation.text, list(continuation.token_ids), continuation.completion_tokens) == ("ab", [], 2)


def test_output_of_a_constrained_shape_is_not_continued_and_plain_text_is() -> None:
    json_schema = _chat()
    json_schema.openai_fields.update({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert "response_format" in Delivered(json_schema).why_not
    guided = _chat()
    guided.openai_fields.update({"guided_regex": "[a-z]+"})
    assert "guided_regex" in Delivered(guided).why_not
    plain = _chat()
    plain.openai_fields.update({"response_format": {"type": "text"}, "guided_json": None})
    assert Delivered(plain).why_not == ""


def test_ids_after_a_continuation_given_without_ids_are_not_taken_for_the_whole_text() -> None:
    delivered = Delivered(_chat(continuation=pb.Continuation(text="given ", completion_tokens=0)))
    delivered.add(pb.RunDelta(text="more", token_ids=[5]))
    continuation = delivered.continuation()
    assert continuation is not None and continuation.text == "given more" and list(continuation.token_ids) == []
