"""Opening a run leaves nothing behind when it fails, and leaving a run's block cancels the run.

Real mTLS connections on 127.0.0.1 (the ``server`` fixture serves EchoHandler).
"""

from __future__ import annotations

import pytest
from conftest import EchoHandler, assert_eventually

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection, ConnectionConfig
from iop_wire.endpoint import Listener, dial
from iop_wire.errors import IopError
from iop_wire.tls import TlsConfig

_SMALL_FRAMES = ConnectionConfig(max_frame_size=64 * 1024)


async def _dial(server: Listener, edge_tls: TlsConfig) -> Connection:
    return await dial("127.0.0.1", server.port, tls=edge_tls, server_hostname="localhost")


def _nested(depth: int) -> dict[str, object]:
    tools: dict[str, object] = {}
    level = tools
    for _ in range(depth):
        level["a"] = {}
        level = level["a"]  # type: ignore[assignment]  # one level deeper each time
    return tools


def _over_the_frame_limit(run_id: str) -> pb.RunRequest:
    return pb.RunRequest(run_id=run_id, model="m", prompt="x" * (_SMALL_FRAMES.max_frame_size + 1))


def _nested_too_deep(run_id: str) -> pb.RunRequest:
    request = pb.RunRequest(run_id=run_id, model="m")
    request.openai_fields.update({"tools": _nested(40)})
    return request


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (_over_the_frame_limit, pb.ERROR_REASON_TOO_LARGE),
        (_nested_too_deep, pb.ERROR_REASON_UNENCODABLE),
    ],
    # A lone surrogate cannot get this far: upb refuses it when the request is built.
    ids=["over-frame-limit", "nested-40-deep"],
)
@pytest.mark.parametrize("codec", ["proto", "json"])
async def test_a_run_that_cannot_be_sent_stays_unregistered(
    server: Listener, edge_tls: TlsConfig, build: object, reason: int, codec: str
) -> None:
    assert callable(build)
    connection = await dial(
        "127.0.0.1", server.port, tls=edge_tls, codec=codec, server_hostname="localhost", config=_SMALL_FRAMES
    )
    for _ in range(2):  # the second try is refused for the same reason, not as "already open"
        with pytest.raises(IopError) as caught:
            await connection.open_run(build("doomed"))
        assert caught.value.code == pb.ERROR_CODE_INVALID_ARGUMENT and caught.value.reason == reason
        assert caught.value.run_id == "doomed" and "run request" in caught.value.message
    assert not connection._streams  # nothing kept for a run that never left
    # The id is free and the connection serves on.
    events = [e async for e in await connection.open_run(pb.RunRequest(run_id="doomed", model="m"))]
    assert events[-1].WhichOneof("event") == "complete"
    await connection.close()


async def test_leaving_the_block_early_cancels_the_run(
    server: Listener, edge_tls: TlsConfig, handler: EchoHandler
) -> None:
    connection = await _dial(server, edge_tls)
    async with await connection.open_run(pb.RunRequest(run_id="left", model="hang")) as stream:
        assert (await anext(stream)).WhichOneof("event") == "start"
    await assert_eventually(lambda: handler.cancelled == ["the caller stopped reading the run"])
    await assert_eventually(lambda: not connection._streams)  # its terminal event came and was absorbed
    await connection.close()


async def test_leaving_the_block_on_an_error_cancels_the_run(
    server: Listener, edge_tls: TlsConfig, handler: EchoHandler
) -> None:
    connection = await _dial(server, edge_tls)

    async def read_then_fail() -> None:
        async with await connection.open_run(pb.RunRequest(run_id="broke", model="hang")) as stream:
            await anext(stream)
            raise LookupError("the caller's own bug")

    with pytest.raises(LookupError):
        await read_then_fail()
    await assert_eventually(lambda: len(handler.cancelled) == 1)
    await connection.close()


async def test_a_run_read_to_its_end_is_not_cancelled(
    server: Listener, edge_tls: TlsConfig, handler: EchoHandler
) -> None:
    connection = await _dial(server, edge_tls)
    async with await connection.open_run(pb.RunRequest(run_id="whole", model="m")) as stream:
        kinds = [event.WhichOneof("event") async for event in stream]
    assert kinds[-1] == "complete"
    assert (await connection.capabilities()).node_id == "test-node"  # a round trip: any cancel would be there
    assert handler.cancelled == [] and not connection._streams
    await connection.close()
