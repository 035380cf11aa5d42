"""The router's merge of a request's sampling with its route's defaults, and its kinds."""

from __future__ import annotations

import pytest

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.router import Limits, Router, merge_sampling
from iop_node.settings import RouteSettings
from iop_wire.errors import IopError

_DEFAULTS = {"temperature": 0.0, "seed": 0, "stop": ["END"], "max_tokens": 64}


def _router() -> Router:
    routes = [
        RouteSettings(model="tuned", adapter="mock", defaults=_DEFAULTS),  # type: ignore[arg-type]
        RouteSettings(model="plain", adapter="mock"),
    ]
    return Router(routes, Limits(max_prompt_chars=100, max_tokens=1000))


def _request(model: str, **sampling: object) -> pb.RunRequest:
    message = pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text="hi")])
    return pb.RunRequest(run_id="r", model=model, messages=[message], sampling=pb.Sampling(**sampling))  # type: ignore[arg-type]


def test_route_defaults_apply_where_the_request_is_silent_zeros_included() -> None:
    sampling = _router().resolve(_request("tuned")).sampling
    assert sampling.HasField("temperature") and sampling.HasField("seed")  # set to zero, not unset
    assert (sampling.temperature, sampling.seed, list(sampling.stop)) == (0.0, 0, ["END"])
    assert sampling.max_tokens == 64 and not sampling.HasField("top_p")


def test_the_request_wins_where_it_set_a_field() -> None:
    sampling = _router().resolve(_request("tuned", temperature=0.7, seed=9, stop=["x", "y"], max_tokens=5)).sampling
    assert (sampling.temperature, sampling.seed, list(sampling.stop)) == (0.7, 9, ["x", "y"])
    assert sampling.max_tokens == 5


def test_a_field_set_to_zero_by_the_request_is_kept() -> None:
    sampling = _router().resolve(_request("plain", temperature=0.0, presence_penalty=0.0)).sampling
    assert sampling.HasField("temperature") and sampling.HasField("presence_penalty")
    assert (sampling.temperature, sampling.presence_penalty) == (0.0, 0.0)
    assert not sampling.HasField("top_p") and list(sampling.stop) == []


def test_merging_changes_neither_input() -> None:
    defaults, given = pb.Sampling(stop=["a"], seed=1), pb.Sampling(stop=["b"], top_p=0.5)
    merged = merge_sampling(defaults, given)
    assert merged == pb.Sampling(stop=["b"], seed=1, top_p=0.5)
    assert defaults == pb.Sampling(stop=["a"], seed=1) and given == pb.Sampling(stop=["b"], top_p=0.5)


def test_the_spec_holds_the_request_and_only_what_was_resolved() -> None:
    request = _request("tuned")
    request.openai_fields.update({"tools": [{"type": "function"}]})
    spec = _router().resolve(request)
    assert spec.request is request and spec.adapter == "mock" and spec.target_model == "tuned"
    assert spec.openai_fields == {"tools": [{"type": "function"}]} and spec.deadline is None
    assert spec.prompt_text() == "user: hi"


def test_an_unset_kind_is_chat_and_an_unknown_one_is_refused() -> None:
    router = _router()
    assert router.resolve(_request("plain")).kind == pb.RUN_KIND_CHAT
    request = _request("plain")
    request.kind = 99  # type: ignore[assignment]
    with pytest.raises(IopError, match="unknown run kind 99") as caught:
        router.resolve(request)
    assert caught.value.code == pb.ERROR_CODE_INVALID_ARGUMENT


def test_a_prompt_kind_without_a_prompt_is_refused_by_name() -> None:
    request = _request("plain")
    request.kind = pb.RUN_KIND_EMBEDDING
    with pytest.raises(IopError, match="prompt is empty: embedding runs need a prompt"):
        _router().resolve(request)


def test_every_message_needs_a_role_and_the_prompt_limit_counts_all_text() -> None:
    router = _router()
    request = _request("plain")
    request.messages.add(content=[pb.ContentPart(text="no role")])
    with pytest.raises(IopError, match="every message needs a role"):
        router.resolve(request)
    request = _request("plain")
    request.messages.add(role=pb.ROLE_USER, content=[pb.ContentPart(text="x" * 99)])  # 2 + 99 characters
    with pytest.raises(IopError, match="prompt of 101 characters is over this node's limit of 100"):
        router.resolve(request)


_NAN, _INF = float("nan"), float("inf")


_OUT_OF_RANGE: list[tuple[dict[str, object], str]] = [
    ({"temperature": _NAN}, "sampling.temperature must be between 0 and 2, got nan"),
    ({"temperature": _INF}, "sampling.temperature must be between 0 and 2, got inf"),
    ({"temperature": -0.1}, "sampling.temperature must be between 0 and 2, got -0.1"),
    ({"temperature": 2.01}, "sampling.temperature must be between 0 and 2, got 2.01"),
    ({"top_p": _NAN}, "sampling.top_p must be between 0 and 1, got nan"),
    ({"top_p": -_INF}, "sampling.top_p must be between 0 and 1, got -inf"),
    ({"top_p": 1.5}, "sampling.top_p must be between 0 and 1, got 1.5"),
    ({"presence_penalty": _NAN}, "sampling.presence_penalty must be between -2 and 2, got nan"),
    ({"presence_penalty": -2.5}, "sampling.presence_penalty must be between -2 and 2, got -2.5"),
    ({"frequency_penalty": _INF}, "sampling.frequency_penalty must be between -2 and 2, got inf"),
    ({"frequency_penalty": 3.0}, "sampling.frequency_penalty must be between -2 and 2, got 3.0"),
    ({"max_tokens": 0}, "sampling.max_tokens must be between 1 and 1000, got 0"),
    ({"max_tokens": -5}, "sampling.max_tokens must be between 1 and 1000, got -5"),
    ({"max_tokens": 1001}, "sampling.max_tokens must be between 1 and 1000, got 1001"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "sampling.stop takes at most 4 sequences, got 5"),
    ({"top_k": 0}, "sampling.top_k must be at least 1, got 0"),
    ({"top_k": -1}, "sampling.top_k must be at least 1, got -1"),
]


@pytest.mark.parametrize(
    ("sampling", "message"),
    _OUT_OF_RANGE,
    ids=[f"{name}={value}" for case, _ in _OUT_OF_RANGE for name, value in case.items()],
)
def test_sampling_out_of_its_range_is_refused_naming_the_field(sampling: dict[str, object], message: str) -> None:
    with pytest.raises(IopError) as caught:
        _router().resolve(_request("plain", **sampling))
    assert caught.value.code == pb.ERROR_CODE_INVALID_ARGUMENT
    assert caught.value.message == message and caught.value.param == next(iter(sampling))


@pytest.mark.parametrize(
    "sampling",
    [
        {
            "temperature": 0.0,
            "top_p": 0.0,
            "presence_penalty": -2.0,
            "frequency_penalty": -2.0,
            "max_tokens": 1,
            "top_k": 1,
        },
        {
            "temperature": 2.0,
            "top_p": 1.0,
            "presence_penalty": 2.0,
            "frequency_penalty": 2.0,
            "max_tokens": 1000,
            "top_k": 2**31 - 1,
        },
        {"seed": -(2**63), "stop": ["a", "b", "c", "d"]},
        {"seed": 2**63 - 1},
    ],
    ids=["lowest", "highest", "seed-min-and-four-stops", "seed-max"],
)
def test_sampling_at_the_ends_of_its_ranges_runs(sampling: dict[str, object]) -> None:
    resolved = _router().resolve(_request("plain", **sampling)).sampling
    assert resolved == pb.Sampling(**sampling)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "prompt", "continuation", "message"),
    [
        (pb.RUN_KIND_EMBEDDING, ["a"], pb.Continuation(text="x"), "embedding run has no output"),
        (pb.RUN_KIND_COMPLETION, ["a", "b"], pb.Continuation(text="x"), "one prompt, not 2"),
        (pb.RUN_KIND_COMPLETION, ["a"], pb.Continuation(text="x y", token_ids=[1, 2], completion_tokens=3), "2 token"),
    ],
)
def test_a_continuation_of_a_shape_that_cannot_be_continued_is_refused(
    kind: int, prompt: list[str], continuation: pb.Continuation, message: str
) -> None:
    request = pb.RunRequest(run_id="r", model="plain", kind=kind, prompt=prompt, continuation=continuation)  # type: ignore[arg-type]
    with pytest.raises(IopError) as refused:
        _router().resolve(request)
    assert refused.value.code == pb.ERROR_CODE_INVALID_ARGUMENT and refused.value.param == "continuation"
    assert message in str(refused.value)


def test_a_continuation_of_one_completion_or_a_chat_resolves() -> None:
    completion = pb.RunRequest(
        run_id="r", model="plain", kind=pb.RUN_KIND_COMPLETION, prompt=["a"], continuation=pb.Continuation(text="b")
    )
    assert _router().resolve(completion).request.continuation.text == "b"
    chat = _request("plain")
    chat.continuation.CopyFrom(pb.Continuation(text="so far", token_ids=[5, 6], completion_tokens=2))
    assert _router().resolve(chat).request.continuation.completion_tokens == 2


def test_the_prompt_limit_counts_the_delivered_text_a_backend_rereads() -> None:
    request = pb.RunRequest(run_id="r", model="plain", kind=pb.RUN_KIND_COMPLETION, prompt=["a" * 60])
    request.continuation.text = "b" * 40
    assert _router().resolve(request).request.continuation.text == "b" * 40
    request.continuation.text += "b"
    with pytest.raises(IopError, match="prompt of 101 characters"):
        _router().resolve(request)
