"""The pure rules of joining (issue 19): the token's shape, node names, the failure bound, and the
checks a certificate request passes before anything is signed."""

from __future__ import annotations

import datetime

import pytest

from iop_control_plane.identity import parse_token
from iop_control_plane.joining import _FailureBound, failure_source, valid_node_name
from iop_wire.certs import Authority, RequestError, certificate_facts, certificate_request, new_key, requested_name
from iop_wire.logs import RateLimitedLog
from iop_wire.metrics import REGISTRY


def test_a_token_is_an_id_and_a_secret() -> None:
    secret = "0123456789abcdef" * 2
    assert parse_token(f"iopjt-ab12cd.{secret}") == ("ab12cd", secret)
    assert parse_token(f"  iopjt-ab12cd.{secret}\n") == ("ab12cd", secret)  # pasted with blanks
    for bad in ("", "iopjt-ab12cd", f"iopjt-AB12CD.{secret}", f"iopjt-ab12c.{secret}", f"iopjt-ab12cd.{secret}0"):
        assert parse_token(bad) is None, bad


@pytest.mark.parametrize("name", ["gpu-1", "a", "node.example_2", "x" * 63])
def test_node_names_that_may_join(name: str) -> None:
    assert valid_node_name(name)


@pytest.mark.parametrize("name", ["", "-gpu", "gpu 1", "gpu/1", "x" * 64, "node", "edge", "admin", "control-plane"])
def test_node_names_that_may_not(name: str) -> None:
    assert not valid_node_name(name)


def test_failures_are_bounded_per_address_within_the_window() -> None:
    bound = _FailureBound(limit=2, window=60, sources=100, logs=RateLimitedLog())
    assert bound.retry_after("10.0.0.7") is None
    bound.failed("10.0.0.7")
    assert bound.retry_after("10.0.0.7") is None
    bound.failed("10.0.0.7")
    wait = bound.retry_after("10.0.0.7")
    assert wait is not None and 0 < wait <= 60
    assert bound.retry_after("10.0.0.8") is None  # another address is not held back
    expired = _FailureBound(limit=1, window=0.0, sources=100, logs=RateLimitedLog())
    expired.failed("10.0.0.7")
    assert expired.retry_after("10.0.0.7") is None  # failures older than the window are forgotten


def test_many_failing_sources_are_bounded_by_forgetting_the_first() -> None:
    """A peer with many addresses cannot grow the table: beyond ``sources`` the first is forgotten."""
    hits = REGISTRY.get_sample_value("iop_wire_limit_hits_total", {"limit": "join_failure_sources"}) or 0.0
    bound = _FailureBound(limit=1, window=60, sources=2, logs=RateLimitedLog())
    for source in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        bound.failed(source)
    assert bound.retry_after("10.0.0.1") is None  # forgotten to make room
    assert bound.retry_after("10.0.0.2") is not None and bound.retry_after("10.0.0.3") is not None
    assert REGISTRY.get_sample_value("iop_wire_limit_hits_total", {"limit": "join_failure_sources"}) == hits + 1


@pytest.mark.parametrize(
    ("address", "source"),
    [
        ("10.0.0.7", "10.0.0.7"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),  # the same host's share: one source
        ("::ffff:10.0.0.7", "10.0.0.7"),  # IPv4 on a dual-stack socket
        ("?", "?"),
    ],
)
def test_failures_are_counted_by_address_or_ipv6_slash_64(address: str, source: str) -> None:
    assert failure_source(address) == source


def test_a_request_is_checked_before_it_is_signed() -> None:
    key = new_key()
    assert requested_name(certificate_request(key, "gpu-1")) == "gpu-1"
    with pytest.raises(RequestError, match="asks for role 'admin'"):
        requested_name(certificate_request(key, "gpu-1", "admin"))
    with pytest.raises(RequestError, match="not a PEM PKCS#10"):
        requested_name(b"junk")
    pem, facts = Authority("test CA").sign_request(
        certificate_request(key, "gpu-1"), role="node", lifetime=datetime.timedelta(days=7)
    )
    assert (facts.name, facts.role) == ("gpu-1", "node") and certificate_facts(pem) == facts
