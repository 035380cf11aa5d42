"""What a peer names is bounded: a run whose model or caller is over NAME_CHARS is refused with
INVALID_ARGUMENT, not echoed whole, and its ledger row holds the names clipped; so is a node id."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from conftest import Pki, assert_eventually
from cp_helpers import BusyNode, client, cp_settings
from node_helpers import chat, collect, kinds

from iop_control_plane import ledger
from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_control_plane.text import NAME_CHARS
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.errors import IopError
from iop_wire.tls import Role

HUGE = "m" * 1_000_000


@pytest.fixture
async def cp(pki: Pki, tmp_path: Path) -> AsyncIterator[ControlPlaneApp]:
    async with build_control_plane(cp_settings(pki, tmp_path)) as app:
        yield app


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [({"model": HUGE}, "model"), ({"caller": pb.Caller(id=HUGE)}, "caller")],
    ids=["model", "caller"],
)
async def test_an_over_long_name_is_refused_clipped_and_stored_clipped(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path, request_fields: dict[str, Any], field: str
) -> None:
    edge = await client(cp, pki)  # an edge may name the caller it acts for
    events = await asyncio.wait_for(collect(await edge.open_run(chat(run_id="long", **request_fields))), 10)
    assert kinds(events) == ["error"]
    error = events[0].error
    assert error.code == pb.ERROR_CODE_INVALID_ARGUMENT and error.param == ("model" if field == "model" else "")
    assert error.message.startswith(f"{field} is 1000000 characters, over the limit of {NAME_CHARS}")
    assert len(error.message) < 200
    assert cp.metrics.registry.get_sample_value("iop_control_plane_names_refused_total", {"field": field}) == 1
    path, query = tmp_path / "cp.db", pb.RunsList(run_id="long")
    await assert_eventually(lambda: len(ledger.query(path, query).runs) == 1)  # the writer committed it
    admin = await client(cp, pki, "ops", Role.ADMIN)
    (run,) = (await admin.request(pb.Envelope(runs_list=query))).runs_listed.runs
    assert run.status == "failed" and run.error_code == pb.ERROR_CODE_INVALID_ARGUMENT
    stored = run.model if field == "model" else run.caller
    assert stored.startswith("m" * NAME_CHARS + "…[") and len(stored) < NAME_CHARS + 20
    assert run.ByteSize() < 2_000


async def test_a_requester_sending_over_long_names_in_a_loop_is_logged_once_a_second(
    cp: ControlPlaneApp, pki: Pki
) -> None:
    edge = await client(cp, pki)
    began = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        for number in range(50):
            events = await collect(await edge.open_run(chat(model="m" * (NAME_CHARS + 1), run_id=f"r{number}")))
            assert events[0].error.code == pb.ERROR_CODE_INVALID_ARGUMENT
    took = time.monotonic() - began
    refused = [log for log in logs if log["event"] == "run refused"]
    assert 1 <= len(refused) <= took + 1  # one a second at most, however slow the machine
    assert cp.metrics.registry.get_sample_value("iop_control_plane_names_refused_total", {"field": "model"}) == 50


async def test_a_node_id_over_the_limit_is_refused_at_registration(cp: ControlPlaneApp, pki: Pki) -> None:
    node = BusyNode("n" * (NAME_CHARS + 1), certificate="long-node")
    with pytest.raises(IopError) as refused:
        await node.register(cp, pki)
    assert refused.value.code == pb.ERROR_CODE_INVALID_ARGUMENT
    assert refused.value.message.endswith(f"not a node_id of {NAME_CHARS + 1} characters")
    assert not cp.registry.nodes and not cp.sessions.store.first_seen
