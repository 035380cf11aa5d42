"""The mock adapter's tools, response_format and token counts, called directly: which tool it calls,
its arguments (valid for the tool's schema, the same for the same request), how a call streams and
ends, when it answers in text instead, and the bad tools it refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
import structlog
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]  # no stubs installed

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters.mock import MockAdapter, MockOptions
from iop_node.adapters.schema_values import MAX_CHARS, MAX_STRING
from iop_node.domain import ExecutionSpec
from iop_wire.errors import IopError

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 2},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "format": "uuid"}}},
    },
}


PROMPT_WORDS = 7
"""Words of the default conversation as the mock reads it: "user: what is the weather in Paris"."""


class Sink:
    """An EventSink keeping everything an adapter writes."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.outputs: list[pb.RunDelta] = []
        self.finish: pb.FinishReason.ValueType | None = None
        self.usage: pb.Usage | None = None
        self.counted_tokens: int | None = None
        self.annotations: dict[str, str] = {}

    async def delta(self, text: str) -> None:
        self.texts.append(text)

    async def output(self, delta: pb.RunDelta) -> None:
        self.outputs.append(delta)

    async def complete(
        self, finish_reason: pb.FinishReason.ValueType, usage: pb.Usage | None = None, timings: pb.Timings | None = None
    ) -> None:
        self.finish, self.usage = finish_reason, usage

    async def counted(self, tokens: int) -> None:
        self.counted_tokens = tokens

    def annotate(self, key: str, value: str) -> None:
        self.annotations[key] = value

    def counting(self, prompt_tokens: int, *, token_per_delta: bool = False) -> None:
        pass

    def call(self) -> tuple[str, str, str]:
        """The one tool call streamed: id, name and arguments joined."""
        fragments = [fragment for delta in self.outputs for fragment in delta.tool_calls]
        assert fragments and {fragment.index for fragment in fragments} == {0}
        head, *rest = fragments
        assert head.arguments == "" and all(not (f.id or f.function_name) for f in rest), "id and name come first"
        return head.id, head.function_name, "".join(fragment.arguments for fragment in rest)


def _spec(
    fields: dict[str, Any],
    *,
    messages: list[pb.ChatMessage] | None = None,
    kind: pb.RunKind.ValueType = pb.RUN_KIND_CHAT,
    sampling: pb.Sampling | None = None,
) -> ExecutionSpec:
    request = pb.RunRequest(run_id="r", model="m", kind=kind, stream=True)
    request.messages.extend(messages or [_message(pb.ROLE_USER, "what is the weather in Paris")])
    return ExecutionSpec(request, "mock", "m", kind, sampling or pb.Sampling(), fields)


def _message(role: pb.Role.ValueType, text: str, **fields: Any) -> pb.ChatMessage:
    return pb.ChatMessage(role=role, content=[pb.ContentPart(text=text)], **fields)


async def _run(spec: ExecutionSpec, **options: Any) -> Sink:
    sink = Sink()
    await MockAdapter({"m": MockOptions(**options)}).execute(spec, sink)
    return sink


async def _refused(spec: ExecutionSpec) -> IopError:
    with pytest.raises(IopError) as caught:
        await _run(spec)
    assert caught.value.code == pb.ERROR_CODE_INVALID_ARGUMENT
    return caught.value


def _valid(arguments: str, tool: dict[str, Any]) -> dict[str, Any]:
    value = json.loads(arguments)
    errors = [e.message for e in Draft202012Validator(tool["function"]["parameters"]).iter_errors(value)]
    assert not errors, (value, errors)
    assert isinstance(value, dict)
    return value


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "function": {"name": "get_time"}},
        {"type": "function", "name": "get_time"},  # the Responses API's shape
    ],
)
async def test_the_tool_tool_choice_names_is_called(choice: dict[str, Any]) -> None:
    sink = await _run(_spec({"tools": [WEATHER, TIME], "tool_choice": choice}))
    call_id, name, arguments = sink.call()
    assert name == "get_time" and len(call_id) == len("call_") + 24 and call_id.startswith("call_")
    assert _valid(arguments, TIME) == {"zone": "00000000-0000-4000-8000-000000000000"}
    assert sink.finish == pb.FINISH_REASON_TOOL_CALLS and not sink.texts


@pytest.mark.parametrize("choice", [None, "auto", "required"])
async def test_without_a_named_tool_the_first_is_called_with_valid_arguments_streamed_8_characters_a_token(
    choice: str | None,
) -> None:
    fields: dict[str, Any] = {"tools": [WEATHER, TIME]}
    if choice is not None:
        fields["tool_choice"] = choice
    sink = await _run(_spec(fields))
    _, name, arguments = sink.call()
    assert name == "get_weather"
    value = _valid(arguments, WEATHER)
    assert set(value) == {"city", "unit", "days"}
    pieces = [delta.tool_calls[0].arguments for delta in sink.outputs[1:]]
    assert all(len(piece) == 8 for piece in pieces[:-1]) and 0 < len(pieces[-1]) <= 8
    assert sink.finish == pb.FINISH_REASON_TOOL_CALLS and sink.usage is not None
    assert sink.usage.completion_tokens == len(pieces)
    tools_words = len(json.dumps([WEATHER, TIME]).split())
    assert sink.usage.prompt_tokens == PROMPT_WORDS + tools_words


async def test_a_null_tool_choice_is_auto() -> None:
    _, name, _ = (await _run(_spec({"tools": [TIME, WEATHER], "tool_choice": None}))).call()
    assert name == "get_time"


async def test_the_same_request_calls_with_the_same_id_and_arguments_another_prompt_with_others() -> None:
    fields = {"tools": [WEATHER]}
    first, again = await _run(_spec(fields)), await _run(_spec(fields))
    assert first.call() == again.call()
    other = await _run(_spec(fields, messages=[_message(pb.ROLE_USER, "and in Rome?")]))
    assert other.call()[2] != first.call()[2] and other.call()[0] != first.call()[0]
    seeded = [await _run(_spec(fields, sampling=pb.Sampling(seed=seed))) for seed in (1, 1, 2)]
    assert seeded[0].call() == seeded[1].call() != seeded[2].call()


async def test_tool_choice_none_answers_in_text() -> None:
    sink = await _run(_spec({"tools": [WEATHER], "tool_choice": "none"}), tokens=5)
    assert len(sink.texts) == 5 and not sink.outputs and sink.finish == pb.FINISH_REASON_STOP


async def test_once_the_conversation_ends_with_a_tool_result_it_answers_in_text() -> None:
    call = pb.ToolCall(id="call_1", type="function", function=pb.FunctionCall(name="get_weather", arguments="{}"))
    messages = [
        _message(pb.ROLE_USER, "what is the weather in Paris"),
        pb.ChatMessage(role=pb.ROLE_ASSISTANT, tool_calls=[call]),
        _message(pb.ROLE_TOOL, '{"celsius": 21}', tool_call_id="call_1"),
    ]
    sink = await _run(_spec({"tools": [WEATHER], "tool_choice": "required"}, messages=messages), tokens=6)
    assert len(sink.texts) == 6 and not sink.outputs and sink.finish == pb.FINISH_REASON_STOP
    assert sink.usage is not None and sink.usage.completion_tokens == 6


async def test_max_tokens_cuts_the_arguments_and_ends_length() -> None:
    whole = await _run(_spec({"tools": [WEATHER]}))
    pieces = len(whole.outputs) - 1
    assert pieces > 3
    cut = await _run(_spec({"tools": [WEATHER]}, sampling=pb.Sampling(max_tokens=3)))
    assert len(cut.outputs) == 1 + 3 and cut.finish == pb.FINISH_REASON_LENGTH
    assert whole.call()[2].startswith(cut.call()[2]) and cut.usage is not None and cut.usage.completion_tokens == 3
    exact = await _run(_spec({"tools": [WEATHER]}, sampling=pb.Sampling(max_tokens=pieces)))
    assert exact.finish == pb.FINISH_REASON_TOOL_CALLS and exact.call() == whole.call(), "the whole call fitted"


async def test_tool_calls_are_not_continued() -> None:
    spec = _spec({"tools": [WEATHER]})
    spec.request.continuation.CopyFrom(pb.Continuation(text="", completion_tokens=1))
    error = await _refused(spec)
    assert error.param == "continuation"


async def test_a_completion_run_ignores_tools() -> None:
    request = pb.RunRequest(run_id="r", model="m", kind=pb.RUN_KIND_COMPLETION, prompt=["once"])
    spec = ExecutionSpec(request, "mock", "m", pb.RUN_KIND_COMPLETION, pb.Sampling(), {"tools": [WEATHER]})
    sink = await _run(spec, tokens=3)
    assert len(sink.texts) == 3 and not sink.outputs


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]", "not a function tool"),
        ({"tools": [WEATHER, {"type": "function", "function": {"name": ""}}]}, "tools[1]", "not a function tool"),
        ({"tools": [WEATHER, "get_time"]}, "tools[1]", "not a function tool"),
        ({"tools": [{"type": "function"}]}, "tools[0]", "with a name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}},
            "tool_choice",
            "names 'launch', which is not one of the request's tools",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "is not auto, none, required"),
        ({"tools": [WEATHER], "tool_choice": 7}, "tool_choice", "is not auto, none, required"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "a function with a name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "is not auto"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
        ({"tools": [], "tool_choice": {"type": "function", "name": "x"}}, "tool_choice", "only allowed when tools"),
        ({"functions": [{"name": "f"}]}, "functions", "does not support functions"),
    ],
)
async def test_bad_tools_are_refused_naming_the_field(fields: dict[str, Any], param: str, words: str) -> None:
    error = await _refused(_spec(fields))
    assert error.param == param and words in error.message, error.message


async def test_a_garbage_tool_choice_is_refused_even_after_a_tool_result() -> None:
    messages = [_message(pb.ROLE_USER, "hi"), _message(pb.ROLE_TOOL, "{}", tool_call_id="c")]
    error = await _refused(_spec({"tools": [WEATHER], "tool_choice": "sometimes"}, messages=messages))
    assert error.param == "tool_choice"


async def test_response_format_json_object_answers_a_json_object() -> None:
    sink = await _run(_spec({"response_format": {"type": "json_object"}}))
    assert isinstance(json.loads("".join(sink.texts)), dict) and sink.finish == pb.FINISH_REASON_STOP
    assert all(len(text) <= 8 for text in sink.texts)
    assert sink.usage is not None and sink.usage.completion_tokens == len(sink.texts)


async def test_response_format_json_schema_answers_json_valid_for_the_schema() -> None:
    schema = WEATHER["function"]["parameters"]
    fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
    sink = await _run(_spec(fields))
    _valid("".join(sink.texts), WEATHER)
    assert sink.finish == pb.FINISH_REASON_STOP and sink.texts == (await _run(_spec(fields))).texts
    cut = await _run(_spec(fields, sampling=pb.Sampling(max_tokens=2)))
    assert cut.texts == sink.texts[:2] and cut.finish == pb.FINISH_REASON_LENGTH


async def test_response_format_text_answers_words() -> None:
    sink = await _run(_spec({"response_format": {"type": "text"}}), tokens=4)
    assert len("".join(sink.texts).split()) == 4


@pytest.mark.parametrize(
    "response_format", [{"type": "json_schema"}, {"type": "json_schema", "json_schema": "x"}, {"type": "yaml"}]
)
async def test_a_response_format_it_cannot_follow_is_refused(response_format: dict[str, Any]) -> None:
    error = await _refused(_spec({"response_format": response_format}))
    assert error.param == "response_format"


async def test_count_tokens_counts_the_prompt_and_the_tools_and_generates_nothing() -> None:
    fields = {"tools": [WEATHER]}
    sink = await _run(_spec(fields, kind=pb.RUN_KIND_COUNT_TOKENS))
    tools_words = len(json.dumps([WEATHER]).split())
    assert sink.counted_tokens == PROMPT_WORDS + tools_words
    assert not sink.texts and not sink.outputs and sink.finish is None
    called = await _run(_spec(fields))
    assert called.usage is not None and called.usage.prompt_tokens == sink.counted_tokens, "the count a run reports"


async def test_top_k_is_accepted_and_changes_nothing() -> None:
    plain = await _run(_spec({}), tokens=5)
    with_k = await _run(_spec({}, sampling=pb.Sampling(top_k=3)), tokens=5)
    assert with_k.texts == plain.texts and with_k.finish == pb.FINISH_REASON_STOP


async def test_the_mock_says_it_counts_tokens() -> None:
    (model,) = await MockAdapter({"m": MockOptions()}).capabilities()
    assert pb.RUN_KIND_COUNT_TOKENS in model.kinds and pb.RUN_KIND_COUNT_TOKENS not in model.continuable_kinds


async def test_a_schema_past_the_bounds_is_cut_logged_and_noted_in_the_run_record() -> None:
    long = {"type": "object", "properties": {"s": {"type": "string", "minLength": 10**9}}}
    big = {"type": "function", "function": {"name": "big", "parameters": long}}
    with structlog.testing.capture_logs() as logs:
        sink = await _run(_spec({"tools": [big]}))
        plain = await _run(_spec({"tools": [WEATHER]}))
    assert len(json.loads(sink.call()[2])["s"]) == MAX_STRING and sink.finish == pb.FINISH_REASON_TOOL_CALLS
    assert sink.annotations == {"schema_bounded": "tool 'big': string"} and plain.annotations == {}
    (line,) = [log for log in logs if log["event"] == "schema value bounded"]
    assert (line["run_id"], line["bound"], line["log_level"]) == ("r", "string", "warning")
    schema = {"type": "array", "minItems": 10**6}
    fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "many", "schema": schema}}}
    assert (await _run(_spec(fields))).annotations == {"schema_bounded": "response_format: items"}


@pytest.mark.parametrize(
    "parameters",
    [None, {}, {"type": "object"}, {"type": "string"}, {"type": "array", "items": {"type": "integer"}}],
)
async def test_arguments_are_always_a_json_object(parameters: dict[str, Any] | None) -> None:
    function: dict[str, Any] = {"name": "ping"} | ({} if parameters is None else {"parameters": parameters})
    sink = await _run(_spec({"tools": [{"type": "function", "function": function}]}))
    assert json.loads(sink.call()[2]) == {} and sink.finish == pb.FINISH_REASON_TOOL_CALLS
    forced = (parameters or {}).get("type", "object") != "object"
    assert ("tool_parameters" in sink.annotations) == forced, sink.annotations


@pytest.mark.parametrize("parameters", ["{}", [], 3, True])
async def test_parameters_that_are_not_an_object_are_refused(parameters: Any) -> None:
    tool = {"type": "function", "function": {"name": "ping", "parameters": parameters}}
    error = await _refused(_spec({"tools": [WEATHER, tool]}))
    assert error.param == "tools[1].function.parameters", error.message


async def test_each_turn_of_a_seeded_conversation_gets_its_own_call_id() -> None:
    seeded = pb.Sampling(seed=5)
    first = await _run(_spec({"tools": [WEATHER]}, sampling=seeded))
    call = pb.ToolCall(id=first.call()[0], type="function", function=pb.FunctionCall(name="get_weather"))
    turn = [
        _message(pb.ROLE_USER, "what is the weather in Paris"),
        pb.ChatMessage(role=pb.ROLE_ASSISTANT, tool_calls=[call]),
        _message(pb.ROLE_TOOL, "{}", tool_call_id=call.id),
        _message(pb.ROLE_USER, "and in Rome?"),
    ]
    second = await _run(_spec({"tools": [WEATHER]}, sampling=seeded, messages=turn))
    assert second.call()[0] != first.call()[0]
    other_tool = await _run(_spec({"tools": [WEATHER, TIME], "tool_choice": "required"}, sampling=seeded))
    named = {"type": "function", "function": {"name": "get_time"}}
    time_call = await _run(_spec({"tools": [WEATHER, TIME], "tool_choice": named}, sampling=seeded))
    assert other_tool.call()[0] == first.call()[0] != time_call.call()[0], "the tool's index is in the id"


async def test_a_structured_answer_is_not_continued() -> None:
    spec = _spec({"response_format": {"type": "json_object"}})
    spec.request.continuation.CopyFrom(pb.Continuation(text='{"ans', completion_tokens=1))
    error = await _refused(spec)
    assert error.param == "continuation" and "structured" in error.message


async def test_a_large_constant_referred_to_many_times_is_bounded() -> None:
    schema = {
        "type": "object",
        "properties": {f"p{index}": {"$ref": "#/$defs/big"} for index in range(500)},
        "$defs": {"big": {"const": "x" * 100_000}},
    }
    tool = {"type": "function", "function": {"name": "big", "parameters": schema}}
    sink = await _run(_spec({"tools": [tool]}))
    arguments = sink.call()[2]
    assert len(arguments) < 2 * MAX_CHARS and sink.annotations == {"schema_bounded": "tool 'big': characters"}
    assert all(value is None for value in json.loads(arguments).values())
