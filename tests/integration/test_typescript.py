"""Cross-language proof: the TypeScript client in tests/ts, built from gen/ts, against a real node."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Pki
from google.protobuf import json_format
from node_helpers import chat, client, collect, node_settings, running_node, text

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.bootstrap import NodeApp
from iop_wire.tls import Role

TS = Path(__file__).parents[1] / "ts"
EXAMPLES = Path(__file__).parents[1] / "contract" / "examples"
ROUTES = [
    {"model": "mock-small", "adapter": "mock", "options": {"tokens": 12}},
    {"model": "mock-slow", "adapter": "mock", "options": {"tokens": 12, "tokens_per_second": 15}},
]


@pytest.fixture(scope="session")
def ts_client() -> Path:
    """tests/ts compiled against the current gen/ts (npm packages from `just ts-install`)."""
    if not (TS / "node_modules" / ".bin" / "tsc").exists():
        pytest.fail("tests/ts/node_modules is missing: run `just ts-install` (`just test` does)")
    npm = shutil.which("npm")
    assert npm is not None, "npm is needed for the TypeScript client"
    subprocess.run([npm, "run", "--silent", "build"], cwd=TS, check=True, timeout=120)
    return TS / "build" / "client.js"


@pytest.fixture
async def node(pki: Pki, tmp_path: Path) -> AsyncIterator[NodeApp]:
    async with running_node(node_settings(pki, tmp_path, ROUTES)) as app:
        yield app


def _ts(
    client_js: Path, app: NodeApp, pki: Pki, command: str, *args: str, stdin: str | None = None
) -> list[dict[str, Any]]:
    tls = pki.config("ts-edge", Role.EDGE)
    assert app.listener is not None
    node = shutil.which("node")
    assert node is not None
    result = subprocess.run(
        [
            node,
            str(client_js),
            command,
            "--port",
            str(app.listener.port),
            "--cert",
            str(tls.cert),
            "--key",
            str(tls.key),
            "--ca",
            str(tls.ca),
            *args,
        ],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.parametrize("codec", ["proto", "json"])
async def test_streamed_text_equals_the_python_clients(ts_client: Path, node: NodeApp, pki: Pki, codec: str) -> None:
    lines = await _to_thread(_ts, ts_client, node, pki, "run", "--codec", codec, "--text", "same prompt")
    events, summary = lines[:-1], lines[-1]
    assert [e["event"] for e in events] == ["start"] + ["delta"] * 12 + ["complete"]
    assert [int(e["sequence"]) for e in events] == list(range(14))
    assert events[-1]["json"]["complete"]["usage"]["completionTokens"] == 12
    connection = await client(node, pki)
    python_events = await collect(
        await connection.open_run(chat(text="same prompt", sampling=pb.Sampling(max_tokens=12)))
    )
    assert summary["text"] == text(python_events) != ""
    await connection.close()


# The node beats every 0.5 s (node_settings) and cuts off a peer silent for 3 intervals (1.5 s here):
# holding an idle connection for 2.5 s shows both directions. These waits are the protocol's own timers.
HOLD_MS = "2500"


async def test_heartbeats_keep_an_idle_typescript_connection_alive_both_ways(
    ts_client: Path, node: NodeApp, pki: Pki
) -> None:
    (line,) = await _to_thread(_ts, ts_client, node, pki, "hold", "--heartbeat-ms", "100", "--hold-ms", HOLD_MS)
    # Only the client's heartbeats told the node it was alive: without them it is cut off (the next test).
    assert line["error"] is None and line["answered"]
    assert line["heartbeatsSent"] >= 20
    # And the node kept beating the whole time, not only once at the start (~5 in 2.5 s).
    assert line["heartbeatsReceived"] >= 4


async def test_a_typescript_client_that_sends_no_heartbeats_is_cut_off(
    ts_client: Path, node: NodeApp, pki: Pki
) -> None:
    (line,) = await _to_thread(_ts, ts_client, node, pki, "hold", "--heartbeat-ms", "0", "--hold-ms", HOLD_MS)
    assert line["heartbeatsSent"] == 0 and not line["answered"]
    assert line["error"]["error"]["code"] == "ERROR_CODE_UNAVAILABLE"


@pytest.mark.parametrize("codec", ["proto", "json"])
async def test_cancel_from_typescript(ts_client: Path, node: NodeApp, pki: Pki, codec: str) -> None:
    (final,) = await _to_thread(_ts, ts_client, node, pki, "cancel", "--model", "mock-slow", "--codec", codec)
    assert final["final"] == "error"
    assert final["json"]["error"]["code"] == "ERROR_CODE_CANCELLED"
    assert "ts says stop" in final["json"]["error"]["message"]


async def test_capability_response_decoded(ts_client: Path, node: NodeApp, pki: Pki) -> None:
    (line,) = await _to_thread(_ts, ts_client, node, pki, "capabilities")
    adapters = line["capabilities"]["adapters"]
    assert [a["name"] for a in adapters] == ["mock"]
    assert {m["name"] for m in adapters[0]["models"]} == {"mock-small", "mock-slow"}
    assert line["capabilities"]["nodeId"] == "node-t"


def _has_map(message: Any) -> bool:
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            if len(value) > 1:
                return True
            continue
        for item in value if field.is_repeated else [value]:
            if _has_map(item):
                return True
    return False


async def test_every_golden_example_round_trips_through_protobuf_es(ts_client: Path, node: NodeApp, pki: Pki) -> None:
    inputs, python = [], {}
    for path in sorted(EXAMPLES.glob("*.json")):
        name = path.name.split(".")[0]
        document = json.loads(path.read_text())
        message = json_format.ParseDict(document, getattr(pb, name)())
        binary = message.SerializeToString()
        inputs.append(
            {"file": path.name, "message": name, "json": document, "binary": base64.b64encode(binary).decode()}
        )
        python[path.name] = (message, binary, document)
    results = await _to_thread(_ts, ts_client, node, pki, "golden", stdin=json.dumps(inputs))
    assert len(results) == len(inputs)
    for result in results:
        message, binary, document = python[result["file"]]
        for side in ("fromJson", "fromBinary"):
            assert result[side]["json"] == document, (result["file"], side)
            ts_bytes = base64.b64decode(result[side]["binary"])
            if _has_map(message):  # entry order may differ; the content may not
                assert type(message).FromString(ts_bytes) == message, (result["file"], side)
            else:
                assert ts_bytes == binary, (result["file"], side)


@pytest.mark.parametrize(
    ("kind", "code"), [("oversized", "ERROR_CODE_FRAME_TOO_LARGE"), ("garbage", "ERROR_CODE_MALFORMED_FRAME")]
)
async def test_bad_frames_from_typescript_get_an_error_and_the_node_keeps_serving(
    ts_client: Path, node: NodeApp, pki: Pki, kind: str, code: str
) -> None:
    (line,) = await _to_thread(_ts, ts_client, node, pki, kind)
    assert line["reply"]["error"]["code"] == code
    connection = await client(node, pki)
    assert (await collect(await connection.open_run(chat())))[-1].WhichOneof("event") == "complete"
    await connection.close()


async def _to_thread(*args: Any, **kwargs: Any) -> Any:
    import asyncio
    import functools

    return await asyncio.to_thread(functools.partial(*args, **kwargs))
