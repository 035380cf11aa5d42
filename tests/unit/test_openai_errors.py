"""OpenAI's error type for each HTTP status an ApiError carries."""

from __future__ import annotations

import json

import pytest

from iop_wire.openai.errors import ApiError


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (404, "invalid_request_error"),
        (408, "invalid_request_error"),  # the body did not arrive in time: the client's doing
        (409, "invalid_request_error"),  # a key name in use: was "server_error"
        (499, "invalid_request_error"),
        (429, "requests"),
        (500, "server_error"),
        (503, "server_error"),
    ],
)
def test_a_clients_error_is_an_invalid_request_and_a_servers_a_server_error(status: int, kind: str) -> None:
    error = ApiError(status, "what went wrong")
    assert error.type == kind
    assert json.loads(error.content())["error"]["type"] == kind


def test_a_type_given_is_kept() -> None:
    assert ApiError(409, "in use", type="conflict_error").type == "conflict_error"
