"""What the HTTP adapters share, without sockets: options checked at start-up, the one mapping
from client errors to IOP errors, and the JSON shapes read alike from vllm and ollama backends."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters import httperrors as errors
from iop_node.adapters.http import Backend, HttpOptions
from iop_node.adapters.shapes import MESSAGE_LIMIT, capped, embeddings, finish_reason, json_object, model_names
from iop_node.bootstrap import build_adapters
from iop_node.settings import ConfigError, Settings
from iop_wire.errors import IopError


@pytest.mark.parametrize("key", ["sk-a\r\nX-Admin: 1", "sk-\n", "sk-\x00", "sk-\u00e9\u20ac"])
def test_an_api_key_a_header_cannot_carry_is_refused_without_echoing_it(key: str) -> None:
    with pytest.raises(ValidationError) as caught:
        HttpOptions(base_url="http://127.0.0.1:1", api_key=key)
    error = caught.value.errors()[0]
    assert error["loc"] == ("api_key",) and "CR, LF" in error["msg"]
    assert key not in str(error["msg"])


def test_a_bad_api_key_stops_start_up_naming_the_route_key() -> None:
    routes = [
        {"model": "a", "adapter": "vllm", "options": {"base_url": "http://127.0.0.1:1", "api_key": "ok"}},
        {"model": "b", "adapter": "ollama", "options": {"api_key": "bad\r\nkey"}},
    ]
    settings = Settings.model_validate({"node_id": "n", "tls": {"enabled": False}, "routes": routes})
    with pytest.raises(ConfigError, match=r"routes\.1\.options\.api_key") as caught:
        build_adapters(settings)
    assert "bad" not in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("given", "used"),
    [
        ("http://gpu-0:8000", "http://gpu-0:8000"),
        ("http://gpu-0:8000/", "http://gpu-0:8000"),
        ("http://gpu-0:8000/v1", "http://gpu-0:8000"),
        ("http://gpu-0:8000/v1/", "http://gpu-0:8000"),
        ("https://gateway/openai/v1", "https://gateway/openai"),
        ("https://gateway/v1beta", "https://gateway/v1beta"),
    ],
)
def test_a_base_url_with_or_without_v1_names_the_same_server(given: str, used: str) -> None:
    assert HttpOptions(base_url=given).base_url == used


def test_kinds_must_name_at_least_one_known_kind() -> None:
    assert HttpOptions(base_url="http://h", kinds=["chat"]).kinds == ("chat",)
    for kinds in ([], ["chat", "images"]):
        with pytest.raises(ValidationError):
            HttpOptions(base_url="http://h", kinds=kinds)


@pytest.mark.parametrize(
    ("error", "code", "down"),
    [
        (errors.ConnectError("connection refused"), pb.ERROR_CODE_UNAVAILABLE, True),
        (errors.ConnectTimeout("connect timed out after 5 s"), pb.ERROR_CODE_UNAVAILABLE, True),
        (errors.ConnectionLost("closed mid-response"), pb.ERROR_CODE_UNAVAILABLE, True),
        (errors.ServerDisconnected("closed a reused connection"), pb.ERROR_CODE_UNAVAILABLE, False),
        (errors.ReadTimeout("stalled"), pb.ERROR_CODE_UNAVAILABLE, False),
        (errors.PoolTimeout("no free connection"), pb.ERROR_CODE_UNAVAILABLE, False),
        (errors.ClientClosed("the client is closed"), pb.ERROR_CODE_UNAVAILABLE, False),
        (errors.ProtocolError("not HTTP/1.1"), pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR, False),
    ],
)
async def test_one_table_maps_client_errors_and_says_which_mark_the_backend_down(
    error: errors.HttpError, code: int, down: bool
) -> None:
    backend = Backend(
        "http://b", name="vllm http://b", list_path="/v1/models", list_models=set, health_interval=60, models_refresh=60
    )
    mapped = backend.error(error)
    assert (mapped.code, mapped.retryable) == (code, code == pb.ERROR_CODE_UNAVAILABLE)
    assert mapped.message.startswith("vllm http://b: ") and str(error) in mapped.message
    assert backend.available is not down
    await backend.aclose()


def test_nested_embeddings_name_the_fix() -> None:
    assert [list(e.values) for e in embeddings([[0.5, 1.0], [2.0]])] == [[0.5, 1.0], [2.0]]
    with pytest.raises(IopError, match=r"one vector per token.*pooling") as caught:
        embeddings([[[0.1, 0.2], [0.3, 0.4]]])
    assert caught.value.code == pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR
    with pytest.raises(IopError, match="not a list of numbers"):
        embeddings([["a", "b"]])


@pytest.mark.parametrize(
    "document",
    [
        "<html><body>404 Not Found</body></html>",
        {"detail": "Not Found"},
        {"data": "x"},
        {"data": [{"name": "m"}]},
        None,
    ],
)
def test_only_a_well_formed_model_list_is_one(document: object) -> None:
    with pytest.raises(IopError, match="not a model list") as caught:
        model_names(document, "data", "id")
    assert caught.value.code == pb.ERROR_CODE_BACKEND_PROTOCOL_ERROR
    assert model_names({"data": [{"id": "a"}, {"id": "b"}]}, "data", "id") == {"a", "b"}
    assert model_names({"models": [{"name": "tiny:latest"}]}, "models", "name") == {"tiny:latest"}


def test_finish_reasons_of_both_apis() -> None:
    assert finish_reason("length") == pb.FINISH_REASON_LENGTH
    assert finish_reason("tool_calls") == pb.FINISH_REASON_TOOL_CALLS
    assert finish_reason(None) == finish_reason("unheard-of") == finish_reason(7) == pb.FINISH_REASON_STOP


def test_backend_messages_are_capped_on_one_line() -> None:
    page = "<html>\n" + "<p>Error</p>\n" * 5000 + "</html>"
    assert len(capped(page)) == MESSAGE_LIMIT and "\n" not in capped(page)
    with pytest.raises(IopError) as caught:
        json_object(b'{"error": {"message": "%s"}}' % (b"x" * 50_000))
    assert caught.value.code == pb.ERROR_CODE_BACKEND_ERROR and len(caught.value.message) == MESSAGE_LIMIT
