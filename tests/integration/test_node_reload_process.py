"""Reloading a real `iop node` process registered with a control-plane: SIGHUP and `iop nodes reload NODE`
change what it serves while its other models keep streaming; the control-plane's view follows."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Pki, assert_eventually
from cp_helpers import IOP, admin_certs, all_ready, client, cp_settings, listening_port, node_config
from node_helpers import chat, collect, kinds, text

from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection
from iop_wire.errors import IopError
from iop_wire.runs import RunStream
from iop_wire.tls import Role

pytestmark = pytest.mark.slow

KEEP = {"model": "keep", "adapter": "mock", "options": {"tokens": 40, "tokens_per_second": 20}}
GONE = {"model": "gone", "adapter": "mock", "options": {"tokens": 30, "tokens_per_second": 20}}
FRESH = {"model": "fresh", "adapter": "mock", "options": {"tokens": 5}}


@dataclass
class Cluster:
    app: ControlPlaneApp
    config: Path
    """The node's config file."""
    log: Path
    """What the node process wrote."""
    process: subprocess.Popen[bytes]
    state: Path
    """A state folder with an admin's certificates, for `iop nodes ...`."""


@contextmanager
def _node(
    pki: Pki, tmp_path: Path, port: int, routes: list[dict[str, Any]]
) -> Iterator[tuple[Path, Path, subprocess.Popen[bytes]]]:
    """`iop node` node-r registering with the control-plane at ``port``: its config file, its log, its process."""
    config = node_config(pki, tmp_path, "node-r", port, routes, log_level="info")
    log = tmp_path / "node.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([*IOP, "node", "--config", str(config)], stdout=sink, stderr=sink)
    try:
        yield config, log, process
    finally:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture
async def cluster(pki: Pki, tmp_path: Path) -> AsyncIterator[Cluster]:
    async with build_control_plane(cp_settings(pki, tmp_path)) as app:
        with _node(pki, tmp_path, listening_port(app), [KEEP, GONE]) as (config, log, process):
            await all_ready(app, "node-r")
            yield Cluster(app, config, log, process, admin_certs(pki, tmp_path / "admin"))


def _rewrite(cluster: Cluster, routes: list[dict[str, Any]]) -> None:
    """The node's config file with ``routes`` (everything else as it was)."""
    data = yaml.safe_load(cluster.config.read_text())
    cluster.config.write_text(yaml.safe_dump({**data, "routes": routes}))


async def _streaming(edge: Connection, model: str) -> RunStream:
    stream = await edge.open_run(chat(model=model))
    assert (await anext(stream)).WhichOneof("event") == "start"
    assert (await anext(stream)).WhichOneof("event") == "delta"
    return stream


def _served(cluster: Cluster) -> tuple[set[str], set[str]]:
    """The node's models in the control-plane's registry, and in the capabilities it keeps for it."""
    node = cluster.app.registry.nodes["node-r"]
    capabilities = cluster.app.sessions.capabilities["node-r"]
    return set(node.models), {model.name for adapter in capabilities.adapters for model in adapter.models}


async def _iop(cluster: Cluster, *args: str) -> tuple[int, str, str]:
    where = ["--control-plane", f"127.0.0.1:{listening_port(cluster.app)}", "--dir", str(cluster.state)]
    process = await asyncio.create_subprocess_exec(
        *IOP, *args, *where, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_sighup_adds_and_removes_models_while_the_others_stream_on(cluster: Cluster, pki: Pki) -> None:
    edge = await client(cluster.app, pki)
    keep, gone = await _streaming(edge, "keep"), await _streaming(edge, "gone")
    _rewrite(cluster, [KEEP, FRESH])
    cluster.process.send_signal(signal.SIGHUP)
    # the control-plane takes the node's new status and its unasked capabilities
    await assert_eventually(lambda: _served(cluster) == ({"keep", "fresh"},) * 2, timeout=10)
    assert cluster.app.registry.nodes["node-r"].continuable.keys() == {"keep", "fresh"}  # from the capabilities
    assert kinds(await collect(await edge.open_run(chat(model="fresh"))))[-1] == "complete"
    refused = await collect(await edge.open_run(chat(model="gone")))
    assert refused[-1].error.code == pb.ERROR_CODE_MODEL_NOT_FOUND, refused[-1]
    # the removed model's run in flight finished on its old route; the kept model's stream was not disturbed
    for stream, tokens in ((gone, 30), (keep, 40)):
        events = await collect(stream)
        assert kinds(events)[-1] == "complete", events[-1]
        assert len(text(events).split()) == tokens - 1  # the first delta was read above
    await edge.close()
    assert "routes reloaded" in cluster.log.read_text()


async def test_iop_nodes_reload_applies_or_names_the_bad_key(cluster: Cluster, pki: Pki) -> None:
    _rewrite(cluster, [KEEP, {"model": "bad", "adapter": "nope"}])
    code, out, err = await _iop(cluster, "nodes", "reload", "node-r")
    assert code == 1 and "routes.1.adapter" in err and "unknown adapter 'nope'" in err, (code, out, err)
    assert "node node-r kept its routes" in err
    assert "routes.1.adapter" in cluster.log.read_text()  # the node's own log line names it too
    edge = await client(cluster.app, pki)
    still = await collect(await edge.open_run(chat(model="gone", metadata={"mock.tokens": "2"})))
    assert kinds(still)[-1] == "complete"

    _rewrite(cluster, [KEEP, FRESH])
    code, out, err = await _iop(cluster, "nodes", "reload", "node-r")
    assert (code, out) == (0, "node-r reloaded: added fresh; removed gone; 1 unchanged\n"), err
    await assert_eventually(lambda: _served(cluster) == ({"keep", "fresh"},) * 2, timeout=10)
    code, out, err = await _iop(cluster, "nodes", "ls", "--json")
    assert code == 0, err
    assert [model["model"] for model in json.loads(out)[0]["models"]] == ["keep", "fresh"]
    assert kinds(await collect(await edge.open_run(chat(model="fresh"))))[-1] == "complete"
    await edge.close()

    code, out, err = await _iop(cluster, "nodes", "reload", "node-x")
    assert code == 1 and "no node 'node-x' is registered" in err, (code, out, err)


async def test_unasked_capabilities_count_only_from_a_nodes_own_registration(pki: Pki, tmp_path: Path) -> None:
    async with build_control_plane(cp_settings(pki, tmp_path)) as app:
        with _node(pki, tmp_path, listening_port(app), [KEEP]):
            await all_ready(app, "node-r")
            claimed = pb.CapabilityResponse(
                node_id="node-r", adapters=[pb.AdapterInfo(name="mock", models=[pb.ModelInfo(name="stolen")])]
            )
            before = pb.CapabilityResponse()
            before.CopyFrom(app.sessions.capabilities["node-r"])
            for name, role, code in (
                ("edge-1", Role.EDGE, pb.ERROR_CODE_PERMISSION_DENIED),  # not a node
                ("node-r", Role.NODE, pb.ERROR_CODE_PROTOCOL_VIOLATION),  # its certificate, not its registration
            ):
                peer = await client(app, pki, name, role)
                with pytest.raises(IopError) as refused:
                    await peer.request(pb.Envelope(capability_response=claimed))
                assert refused.value.code == code, refused.value
                await peer.close()
            assert app.sessions.capabilities["node-r"] == before
            assert set(app.registry.nodes["node-r"].models) == {"keep"}
