"""A node's routes read again without a restart (``NodeApp.reload``), in process: a config file on disk,
a real listener with mTLS, runs streamed by a client while the table changes under them."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from conftest import Pki, assert_eventually
from node_helpers import chat, client, collect, kinds, text

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.bootstrap import NodeApp, build_node
from iop_node.renewal import CertificateRenewal
from iop_node.settings import ConfigError, load_settings
from iop_wire.connection import Connection
from iop_wire.errors import IopError
from iop_wire.runs import RunStream
from iop_wire.tls import Role

_STALL = "import time; print('started', flush=True); time.sleep(60)"

STEADY = {"model": "steady", "adapter": "mock", "options": {"tokens": 30, "tokens_per_second": 30}}
OTHER = {"model": "other", "adapter": "mock", "options": {"tokens": 2}}
STALLS = {  # a program that says one word, then nothing until it is stopped
    "model": "stalls",
    "adapter": "cli",
    "options": {"argv": [sys.executable, "-c", _STALL], "kill_grace": 0.2},
}


def _write(path: Path, pki: Pki, routes: list[dict[str, Any]], **extra: Any) -> Path:
    """The node's config file: listener on port 0 with mTLS, a history file beside it, ``routes``."""
    tls = pki.config("node-t", Role.NODE)
    data = {
        "node_id": "node-t",
        "listen": {"port": 0},
        "tls": {"enabled": True, "cert": str(tls.cert), "key": str(tls.key), "ca": str(tls.ca)},
        "store_path": str(path.parent / "runs.db"),
        "heartbeat_interval": 0.5,
        "routes": routes,
        **extra,
    }
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
async def node(pki: Pki, tmp_path: Path) -> AsyncIterator[NodeApp]:
    config = _write(tmp_path / "node.yaml", pki, [STEADY, STALLS, OTHER])
    app = await build_node(load_settings(config), config_path=config).start()
    try:
        yield app
    finally:
        await app.stop(grace=0)


async def _streaming(connection: Connection, model: str, run_id: str) -> RunStream:
    """A run of ``model`` that has sent its first text."""
    stream = await connection.open_run(chat(model=model, run_id=run_id))
    assert (await anext(stream)).WhichOneof("event") == "start"
    assert (await anext(stream)).WhichOneof("event") == "delta"
    return stream


async def test_removed_route_runs_finish_within_grace_then_end_retryably_and_its_adapter_closes(
    node: NodeApp, pki: Pki, tmp_path: Path
) -> None:
    connection = await client(node, pki)
    steady = await _streaming(connection, "steady", "steady-1")
    stalled = await _streaming(connection, "stalls", "stalled-1")
    old_mock, old_cli = node.node.adapters["mock"], node.node.adapters["cli"]
    added = {"model": "added", "adapter": "mock", "options": {"tokens": 3}}
    _write(tmp_path / "node.yaml", pki, [STEADY, added, OTHER], reload_grace=0.5)
    with structlog.testing.capture_logs() as logs:
        summary = await node.reload()
        said = "node-t reloaded: added added; removed stalls; 1 run finishing on the old routes; 2 unchanged"
        assert str(summary) == said
        # removed: no longer listed, and refused retryably while the control-plane may still place it here
        assert [load.model for load in node.node.status().models] == ["steady", "added", "other"]
        refused = await collect(await connection.open_run(chat(model="stalls")))
        assert refused[-1].error.code == pb.ERROR_CODE_UNAVAILABLE and refused[-1].error.retryable
        assert "removed by a reload" in refused[-1].error.message
        assert len(text(await collect(await connection.open_run(chat(model="added")))).split()) == 3
        # the stalled run outlives the grace: ended retryably, so its requester sends it elsewhere
        ended = await collect(stalled)
        assert kinds(ended)[-1] == "error"
        assert ended[-1].error.code == pb.ERROR_CODE_SHUTTING_DOWN and ended[-1].error.retryable
        assert "reload" in ended[-1].error.message
        await assert_eventually(lambda: bool(_closed(logs)))
    assert _closed(logs)[0]["adapters"] == ["cli"]
    assert old_cli not in node.node.adapters.values()
    # the unchanged routes kept their adapter instance (the added route got one of its own); their runs go on
    assert node.node.adapters["mock"] is old_mock and len(node.node.adapters) == 2
    events = await collect(steady)
    assert kinds(events)[-1] == "complete" and len(text(events).split()) == 30 - 1  # one read above
    grace = [log for log in logs if log["event"] == "reload grace ran out"]
    assert grace and grace[0]["runs_ended"] == 1
    assert node.metrics.registry.get_sample_value("iop_node_reload_grace_runs_ended_total") == 1
    await connection.close()


async def test_replaced_route_new_runs_use_it_and_old_run_finishes_on_the_old_adapter(
    node: NodeApp, pki: Pki, tmp_path: Path
) -> None:
    connection = await client(node, pki)
    old_run = await _streaming(connection, "steady", "old")
    old_adapter = node.node.adapters["mock"]
    faster = {**STEADY, "options": {"tokens": 4}}
    _write(tmp_path / "node.yaml", pki, [faster, STALLS, OTHER])
    with structlog.testing.capture_logs() as logs:
        summary = await node.reload()
        assert str(summary) == "node-t reloaded: replaced steady; 1 run finishing on the old routes; 2 unchanged"
        new_events = await collect(await connection.open_run(chat(model="steady")))
        assert len(text(new_events).split()) == 4  # the new route's options at once
        old_events = await collect(old_run)
        assert kinds(old_events)[-1] == "complete" and len(text(old_events).split()) == 30 - 1
        # "other" still uses the old instance: kept, not closed; "steady" has an instance of its own
        assert old_adapter in node.node.adapters.values() and len(node.node.adapters) == 3
        assert not _closed(logs)
    capabilities = await node.node.capabilities()
    served = sorted((adapter.name, model.name) for adapter in capabilities.adapters for model in adapter.models)
    # each model once, by the instance serving it (the old mock instance still knows "steady")
    assert served == [("cli", "stalls"), ("mock", "other"), ("mock", "steady")]
    await connection.close()


async def test_bad_config_changes_nothing_and_names_the_key(node: NodeApp, pki: Pki, tmp_path: Path) -> None:
    connection = await client(node, pki)
    config = _write(tmp_path / "node.yaml", pki, [OTHER, {"model": "new", "adapter": "mock", "options": {"x": 1}}])
    with pytest.raises(ConfigError, match=r"routes\.1\.options\.x \(line \d+\)"):
        await node.reload()
    config.write_text(config.read_text().replace("adapter: mock", "adapter: nope", 1))
    with pytest.raises(ConfigError, match=r"routes\.0\.adapter \(line \d+\): unknown adapter 'nope'"):
        await node.reload()
    assert [route.model for route in node.node.routes] == ["steady", "stalls", "other"]
    assert len(text(await collect(await connection.open_run(chat(model="other")))).split()) == 2
    assert _reloads(node) == {"applied": 0, "bad_config": 2}
    await connection.close()


async def test_settings_other_than_routes_wait_for_a_restart(node: NodeApp, pki: Pki, tmp_path: Path) -> None:
    _write(tmp_path / "node.yaml", pki, [STEADY, STALLS, OTHER], max_prompt_chars=10, reload_grace=3)
    summary = await node.reload()
    assert str(summary) == "node-t reloaded: 3 unchanged; needs a restart: max_prompt_chars"
    assert node.settings.max_prompt_chars == 1_000_000 and node.settings.reload_grace == 3


async def test_reloads_run_one_at_a_time(node: NodeApp, pki: Pki, tmp_path: Path) -> None:
    _write(tmp_path / "node.yaml", pki, [STEADY, OTHER])
    first, second = await asyncio.gather(node.reload(), node.reload())
    assert str(first) == "node-t reloaded: removed stalls; 2 unchanged"
    assert str(second) == "node-t reloaded: 2 unchanged"  # after the first, not beside it
    assert _reloads(node) == {"applied": 2, "bad_config": 0}


async def test_a_node_without_a_config_file_has_nothing_to_reload(pki: Pki, tmp_path: Path) -> None:
    config = _write(tmp_path / "node.yaml", pki, [STEADY])
    app = await build_node(load_settings(config)).start()
    try:
        with pytest.raises(ConfigError, match="without a config file"):
            await app.reload()
    finally:
        await app.stop(grace=0)


async def test_nodes_reload_is_refused_on_a_client_connection(node: NodeApp, pki: Pki) -> None:
    connection = await client(node, pki)
    with pytest.raises(IopError) as refused:
        await connection.request(pb.Envelope(nodes_reload=pb.NodesReload(node_id="node-t")))
    assert refused.value.code == pb.ERROR_CODE_PERMISSION_DENIED
    await connection.close()


def _reloads(node: NodeApp) -> dict[str, float]:
    """``iop_node_reloads_total`` by outcome."""
    value = node.metrics.registry.get_sample_value
    return {
        outcome: value("iop_node_reloads_total", {"outcome": outcome}) or 0 for outcome in ("applied", "bad_config")
    }


def _closed(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [log for log in logs if log["event"] == "retired adapters closed"]


class _GaveUp:
    """Stands in for an engine route's adapter (the engine supervisor is built elsewhere) whose server failed
    to start too often: FAILED, "not started again until a reload"."""

    name = "mock"

    async def capabilities(self) -> list[pb.ModelInfo]:
        return [pb.ModelInfo(name="steady", available=False), pb.ModelInfo(name="other", available=True)]

    def available(self, model: str) -> bool:
        return model != "steady"

    def served(self, model: str) -> pb.ServedModel | None:
        failed = pb.ServedModel(engine="command", state=pb.SERVED_STATE_FAILED, reason="exited 1, 3 times")
        return failed if model == "steady" else None

    async def execute(self, spec: Any, sink: Any) -> None:
        raise IopError(pb.ERROR_CODE_UNAVAILABLE, "its server failed")

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def test_a_reload_starts_a_failed_model_again_though_its_route_is_unchanged(pki: Pki, tmp_path: Path) -> None:
    config = _write(tmp_path / "node.yaml", pki, [STEADY, OTHER])
    gave_up = _GaveUp()
    app = await build_node(load_settings(config), adapters={"mock": gave_up}, config_path=config).start()
    try:
        assert str(await app.reload()) == "node-t reloaded: replaced steady; 1 unchanged"
        assert app.node.status().models[0].available and gave_up in app.node.adapters.values()  # "other" kept it
        connection = await client(app, pki)
        events = await collect(await connection.open_run(chat(model="steady", metadata={"mock.tokens": "2"})))
        assert kinds(events)[-1] == "complete"
        await connection.close()
    finally:
        await app.stop(grace=0)


async def test_a_reload_reads_the_settings_only_between_certificate_renewals(node: NodeApp, tmp_path: Path) -> None:
    """The settings' check completes or drops a renewal it finds half written: not while one is written."""

    async def never() -> Connection:
        raise AssertionError("not asked")

    key = node.settings.tls.key
    assert key is not None
    draft = key.with_name(key.name + ".new")  # the renewal writes the key's draft first
    node.renewal = CertificateRenewal(tmp_path / "node.crt", key, never)
    async with node.renewal.installing:
        draft.write_bytes(key.read_bytes())
        reload = asyncio.create_task(node.reload())
        await asyncio.wait({reload}, timeout=1)  # a reload takes milliseconds: this one waits for the writer
        assert not reload.done() and draft.exists()
    assert str(await reload) == "node-t reloaded: 3 unchanged"
