"""The router's merge of a request's sampling with its route's defaults, and its kinds."""

from __future__ import annotations

import pytest

from iop_gen.bp import iop as bp
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.router import Limits, Router
from iop_node.settings import RouteSettings
from iop_wire.errors import ErrorCode, IopError

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
    spec = _router().resolve(_request("tuned"))
    assert (spec.sampling.temperature, spec.sampling.seed, spec.sampling.stop) == (0.0, 0, ("END",))
    assert (spec.sampling.max_tokens, spec.sampling.top_p) == (64, None)


def test_the_request_wins_where_it_set_a_field() -> None:
    spec = _router().resolve(_request("tuned", temperature=0.7, seed=9, stop=["x", "y"], max_tokens=5))
    assert (spec.sampling.temperature, spec.sampling.seed, spec.sampling.stop) == (0.7, 9, ("x", "y"))
    assert spec.sampling.max_tokens == 5


def test_a_field_set_to_zero_by_the_request_is_kept() -> None:
    spec = _router().resolve(_request("plain", temperature=0.0, presence_penalty=0.0))
    assert (spec.sampling.temperature, spec.sampling.presence_penalty, spec.sampling.top_p) == (0.0, 0.0, None)
    assert spec.sampling.stop == ()


def test_an_unset_kind_is_chat_and_an_unknown_one_is_refused() -> None:
    router = _router()
    assert router.resolve(_request("plain")).kind == bp.RunKind.CHAT
    request = _request("plain")
    request.kind = 99  # type: ignore[assignment]
    with pytest.raises(IopError, match="unknown run kind 99") as caught:
        router.resolve(request)
    assert caught.value.code == ErrorCode.INVALID_ARGUMENT


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
