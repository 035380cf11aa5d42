"""RUN_KIND_COUNT_TOKENS on the node without sockets: the router takes it with messages as it takes a
chat, and a route the node runs the server of counts where its engine can (vllm, llama.cpp), advertising
the kind before the server is up, unless the route says otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.bootstrap import build_adapters
from iop_node.router import Limits, Router
from iop_node.settings import RouteSettings, Settings
from iop_wire.errors import IopError


def _router() -> Router:
    return Router([RouteSettings(model="m", adapter="mock")], Limits(max_prompt_chars=20, max_tokens=100))


def _count(*texts: str) -> pb.RunRequest:
    messages = [pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text=text)]) for text in texts]
    return pb.RunRequest(run_id="r", model="m", kind=pb.RUN_KIND_COUNT_TOKENS, messages=messages)


def _refusal(request: pb.RunRequest) -> IopError:
    with pytest.raises(IopError) as caught:
        _router().resolve(request)
    assert caught.value.code == pb.ERROR_CODE_INVALID_ARGUMENT
    return caught.value


def test_the_router_takes_a_count_with_messages_as_it_takes_a_chat() -> None:
    spec = _router().resolve(_count("how many tokens"))
    assert spec.kind == pb.RUN_KIND_COUNT_TOKENS and spec.prompt_text() == "user: how many tokens"


def test_a_count_without_messages_over_the_limit_or_continued_is_refused() -> None:
    empty = _refusal(_count())
    assert empty.param == "messages" and "counting tokens needs at least one message" in empty.message
    assert "over this node's limit of 20" in _refusal(_count("x" * 21)).message
    continued = _count("hi")
    continued.continuation.CopyFrom(pb.Continuation(text="x", completion_tokens=1))
    refused = _refusal(continued)
    assert refused.param == "continuation" and "counting tokens has no output to continue" in refused.message
    with_prompt = _count()
    with_prompt.prompt.append("a prompt is not a conversation")
    assert _refusal(with_prompt).param == "messages"


@pytest.mark.parametrize(
    ("route", "counts"),
    [
        ({"engine": "llama.cpp", "serve": {"model_path": "/m/a.gguf"}}, True),
        ({"engine": "vllm", "serve": {"model": "org/m"}}, True),
        ({"engine": "llama.cpp", "serve": {"model_path": "/m/a.gguf"}, "options": {"count_tokens": None}}, False),
        ({"engine": "ollama", "serve": {"pull": ["qwen2.5:0.5b"]}}, False),
    ],
    ids=["llama.cpp", "vllm", "llama.cpp-said-not", "ollama"],
)
async def test_an_engine_route_advertises_counting_where_its_server_counts(
    tmp_path: Path, route: dict[str, Any], counts: bool
) -> None:
    settings = Settings.model_validate({"engines_dir": str(tmp_path), "routes": [{"model": "m", **route}]})
    (adapter,) = build_adapters(settings).values()
    (info,) = await adapter.capabilities()
    assert (pb.RUN_KIND_COUNT_TOKENS in info.kinds) is counts and pb.RUN_KIND_CHAT in info.kinds
    assert not info.available, "advertised before the server is up"
