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
