"""Helpers for node tests: settings, a started node, a client, event collection."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from conftest import Pki

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.bootstrap import NodeApp, build_node
from iop_node.settings import Settings
from iop_wire.connection import Connection, ConnectionConfig
from iop_wire.endpoint import dial
from iop_wire.runs import RunStream
from iop_wire.tls import Role

_ids = itertools.count()


def node_settings(pki: Pki, tmp_path: Path, routes: list[dict[str, Any]], **extra: Any) -> Settings:
    """Settings for a node on 127.0.0.1 port 0 with mTLS, fast heartbeats and a fresh history file."""
    tls = pki.config("node-t", Role.NODE)
    return Settings.model_validate(
        {
            "node_id": "node-t",
            "listen": {"port": 0},
            "tls": {"enabled": True, "cert": tls.cert, "key": tls.key, "ca": tls.ca},
            "store_path": tmp_path / "runs.db",
            "heartbeat_interval": 0.5,
            "routes": routes,
            **extra,
        }
    )


@asynccontextmanager
async def running_node(settings: Settings) -> AsyncIterator[NodeApp]:
    app = await build_node(settings).start()
    try:
        yield app
    finally:
        await app.stop(grace=0)


async def client(app: NodeApp, pki: Pki, codec: str = "proto") -> Connection:
    assert app.listener is not None
    return await dial(
        "127.0.0.1",
        app.listener.port,
        tls=pki.config("edge-t", Role.EDGE),
        codec=codec,
        server_hostname="localhost",
        config=ConnectionConfig(heartbeat_interval=0.5),
    )


def chat(model: str = "mock-small", text: str = "hello there", **fields: Any) -> pb.RunRequest:
    """A chat request with a fresh run id."""
    return pb.RunRequest(
        run_id=fields.pop("run_id", f"run-{next(_ids)}"),
        model=model,
        messages=[pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text=text)])],
        stream=True,
        **fields,
    )


async def collect(stream: RunStream) -> list[pb.RunEvent]:
    return [event async for event in stream]


def kinds(events: list[pb.RunEvent]) -> list[str]:
    return [str(e.WhichOneof("event")) for e in events]


def text(events: list[pb.RunEvent]) -> str:
    return "".join(e.delta.text for e in events)
