"""Placement by run kind: a run counting tokens goes only to a node whose route for the model can count
(its capabilities list RUN_KIND_COUNT_TOKENS), with a clear INVALID_ARGUMENT when no node serving the
model can; real `iop node` processes (a mock route that counts, a cli route of the same model name that
cannot) behind an in-process control-plane."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from conftest import Pki
from cp_helpers import all_ready, client, cp_settings
from cp_policy_helpers import cp_port, nodes_serving
from node_helpers import chat, collect

from iop_control_plane.bootstrap import build_control_plane
from iop_gen.pb.iop import runtime_pb2 as pb

_ECHO = {"argv": [sys.executable, "-c", "import sys; print(sys.stdin.read().upper(), end='')"]}


async def test_counting_goes_only_to_nodes_that_can_count_and_is_refused_where_none_can(
    pki: Pki, tmp_path: Path
) -> None:
    routes = {
        "node-a": [{"model": "shared", "adapter": "mock", "options": {"tokens": 4}}],
        "node-b": [
            {"model": "shared", "adapter": "cli", "options": _ECHO},
            {"model": "cli-only", "adapter": "cli", "options": _ECHO},
        ],
    }
    async with build_control_plane(cp_settings(pki, tmp_path)) as cp:
        with nodes_serving(pki, tmp_path, cp_port(cp), routes):
            await all_ready(cp, "node-a", "node-b")
            edge = await client(cp, pki)
            counts = [
                await collect(await edge.open_run(chat(model="shared", text="one two three", kind=kind)))
                for kind in [pb.RUN_KIND_COUNT_TOKENS] * 6
            ]
            assert Counter(events[0].start.node_id for events in counts) == {"node-a": 6}
            assert all(events[-1].complete.counted_tokens == 4 for events in counts), counts[-1][
                -1
            ]  # "user: one two three"
            chats = [await collect(await edge.open_run(chat(model="shared"))) for _ in range(6)]
            assert {events[0].start.node_id for events in chats} == {"node-a", "node-b"}, "chat runs go to both"

            count_cli = chat(model="cli-only", kind=pb.RUN_KIND_COUNT_TOKENS)
            (refused,) = await collect(await edge.open_run(count_cli))  # no start: refused before placement
            assert refused.error.code == pb.ERROR_CODE_INVALID_ARGUMENT and refused.error.param == "model"
            assert refused.error.message == "no node serving 'cli-only' can count tokens"
            assert (
                cp.metrics.registry.get_sample_value(
                    "iop_control_plane_decisions_total", {"policy": "least-loaded", "outcome": "unsupported_kind"}
                )
                == 1.0
            )
            await edge.close()
