"""Bad input on a real mTLS listener: each case gets an error envelope where the peer can still
read one, a structured log line with the reason, the connection closed where it cannot go on,
and the listener keeps serving a second, healthy connection."""

from __future__ import annotations

import asyncio
import datetime
import random
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import structlog
from conftest import EchoHandler, Pki, assert_eventually
from raw_peer import read_envelope

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import Authority
from iop_wire.endpoint import Listener, ListenerConfig, dial, open_stream, preface
from iop_wire.errors import ConnectionClosed, IopError
from iop_wire.framing import encode_frame
from iop_wire.tls import Role, TlsConfig

Logs = list[dict[str, Any]]


@contextmanager
def captured() -> Iterator[Logs]:
    with structlog.testing.capture_logs() as logs:
        yield logs


def _reasons(logs: Logs) -> str:
    return " | ".join(f"{entry['event']}: {entry.get('reason', '')}" for entry in logs)


async def _assert_closed_by_server(reader: asyncio.StreamReader) -> None:
    """The server closes: reading ends (after any last heartbeats or errors)."""
    await asyncio.wait_for(reader.read(), 5)
    assert reader.at_eof()


async def _assert_healthy(server: Listener, tls: TlsConfig) -> None:
    """A second connection still gets a full run."""
    connection = await dial("127.0.0.1", server.port, tls=tls, server_hostname="localhost")
    events = [e async for e in await connection.open_run(pb.RunRequest(run_id="ok", model="m"))]
    assert events[-1].WhichOneof("event") == "complete"
    await connection.close()


async def _raw(
    server: Listener, tls: TlsConfig, codec: str = "proto"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await open_stream("127.0.0.1", server.port, tls=tls, codec=codec, server_hostname="localhost")


async def test_eof_mid_frame(server: Listener, edge_tls: TlsConfig) -> None:
    with captured() as logs:
        _, writer = await _raw(server, edge_tls)
        writer.write((100).to_bytes(4, "big") + b"only ten b")
        await writer.drain()
        writer.close()
        await assert_eventually(lambda: "mid-frame" in _reasons(logs))
    await assert_eventually(lambda: not server.connections)
    await _assert_healthy(server, edge_tls)


@pytest.mark.parametrize(
    ("header", "expected"),
    [(0, "frame length 0 is outside"), (0xFFFF_FFFF, "frame length 4294967295 is outside")],
    ids=["length-zero", "length-over-max"],
)
async def test_bad_length_prefix_gets_error_and_close(
    server: Listener, edge_tls: TlsConfig, header: int, expected: str
) -> None:
    with captured() as logs:
        reader, writer = await _raw(server, edge_tls)
        writer.write(header.to_bytes(4, "big") + b"\x00" * 16)
        error = (await read_envelope(reader)).error
        assert error.code == pb.ERROR_CODE_FRAME_TOO_LARGE and expected in error.message
        await _assert_closed_by_server(reader)
        writer.close()
    assert expected in _reasons(logs)
    await _assert_healthy(server, edge_tls)


async def test_random_bytes(server: Listener, edge_tls: TlsConfig) -> None:
    noise = random.Random(20261130).randbytes(512)
    with captured() as logs:
        reader, writer = await _raw(server, edge_tls)
        writer.write(noise)
        error = (await read_envelope(reader)).error
        assert error.code == pb.ERROR_CODE_FRAME_TOO_LARGE
        await _assert_closed_by_server(reader)
        writer.close()
    assert "bad frame" in _reasons(logs)
    await _assert_healthy(server, edge_tls)


async def test_body_not_protobuf_is_rejected_and_connection_goes_on(server: Listener, edge_tls: TlsConfig) -> None:
    with captured() as logs:
        connection_reader, writer = await _raw(server, edge_tls)
        writer.write(encode_frame(b"\xff\xff\xff\xff not protobuf"))
        error = (await read_envelope(connection_reader)).error
        assert error.code == pb.ERROR_CODE_MALFORMED_FRAME and "not a protobuf Envelope" in error.message
        # framing is intact, so the same connection still answers
        writer.write(encode_frame(pb.Envelope(id="c1", capability_request=pb.CapabilityRequest()).SerializeToString()))
        reply = await read_envelope(connection_reader)
        assert reply.in_reply_to == "c1" and reply.capability_response.node_id == "test-node"
        writer.close()
    assert "not a protobuf Envelope" in _reasons(logs)
    await _assert_healthy(server, edge_tls)


@pytest.mark.parametrize(
    "body",
    [b"[1, 2]", b'{"runEvent": 5}', b"\xfe\xff", b'{"id": '],
    ids=["array", "wrong-type", "not-utf8", "truncated"],
)
async def test_json_that_is_not_an_envelope(server: Listener, edge_tls: TlsConfig, body: bytes) -> None:
    with captured() as logs:
        reader, writer = await _raw(server, edge_tls, codec="json")
        writer.write(encode_frame(body))
        error = (await read_envelope(reader, "json")).error
        assert error.code == pb.ERROR_CODE_MALFORMED_FRAME and "not a JSON Envelope" in error.message
        writer.close()
    assert "not a JSON Envelope" in _reasons(logs)
    await _assert_healthy(server, edge_tls)


@pytest.mark.parametrize("codec", ["proto", "json"])
async def test_unknown_message_type(server: Listener, edge_tls: TlsConfig, codec: str) -> None:
    # An envelope from a newer peer: id "u1" and a body field (number 99) this build does not know.
    body = b'{"id": "u1", "nodeTeleport": {"to": "mars"}}' if codec == "json" else b"\n\x02u1\x9a\x06\x02\x08\x01"
    with captured() as logs:
        reader, writer = await _raw(server, edge_tls, codec=codec)
        writer.write(encode_frame(body))
        reply = await read_envelope(reader, codec)
        assert reply.in_reply_to == "u1"
        assert reply.error.code == pb.ERROR_CODE_UNKNOWN_MESSAGE_TYPE
        writer.close()
    assert "unknown message type" in _reasons(logs)
    await _assert_healthy(server, edge_tls)


async def test_codec_mismatch_names_both(pki: Pki, handler: EchoHandler, edge_tls: TlsConfig) -> None:
    config = ListenerConfig(tls=pki.config("n", Role.NODE), codecs=("proto",))
    listener = await Listener(config, handler.wire()).start()
    with captured() as logs, pytest.raises(IopError) as caught:
        await dial("127.0.0.1", listener.port, tls=edge_tls, codec="json", server_hostname="localhost")
    assert caught.value.code == pb.ERROR_CODE_CODEC_MISMATCH
    assert "client asked for json, server accepts proto" in caught.value.message
    assert "codec mismatch" in _reasons(logs)
    await _assert_healthy(listener, edge_tls)
    await listener.close()


async def test_plaintext_client_on_tls_listener(server: Listener, edge_tls: TlsConfig) -> None:
    with captured() as logs:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(preface("proto"))
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing readable sent
        writer.close()
    assert "handshake failed" in _reasons(logs)
    await _assert_healthy(server, edge_tls)


def _context(ca: bytes, cert: tuple[bytes, bytes] | None, tmp: Any) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca.decode())
    if cert is not None:
        (tmp / "c.crt").write_bytes(cert[0])
        (tmp / "c.key").write_bytes(cert[1])
        context.load_cert_chain(tmp / "c.crt", tmp / "c.key")
    return context


async def _tls_attempt(server: Listener, context: ssl.SSLContext) -> bytes:
    """Connect with ``context``, send a preface and return what comes back before the close."""
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", server.port, ssl=context, server_hostname="localhost"
        )
        writer.write(preface("proto"))
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return data
    except (ssl.SSLError, ConnectionError):
        return b""


@pytest.mark.parametrize("case", ["no-certificate", "other-ca", "expired"])
async def test_rejected_client_certificates(
    server: Listener, pki: Pki, edge_tls: TlsConfig, case: str, tmp_path: Any
) -> None:
    ca = pki.authority.cert_pem
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
    if case == "no-certificate":
        context, reason = _context(ca, None, tmp_path), "PEER_DID_NOT_RETURN_A_CERTIFICATE"
    elif case == "other-ca":
        stranger = Authority("another CA").issue("intruder", Role.EDGE)
        context, reason = _context(ca, (stranger.cert_pem, stranger.key_pem), tmp_path), "unable to get local issuer"
    else:
        stale = pki.authority.issue("stale", Role.EDGE, not_before=past - datetime.timedelta(days=30), not_after=past)
        context, reason = _context(ca, (stale.cert_pem, stale.key_pem), tmp_path), "certificate has expired"
    with captured() as logs:
        assert await _tls_attempt(server, context) == b""  # no envelope: the handshake failed
        await assert_eventually(lambda: reason in _reasons(logs))
    assert any(entry["event"] == "handshake failed" for entry in logs)
    await _assert_healthy(server, edge_tls)


async def test_role_not_allowed_on_listener(server: Listener, pki: Pki, edge_tls: TlsConfig) -> None:
    with captured() as logs, pytest.raises(IopError) as caught:
        await dial("127.0.0.1", server.port, tls=pki.config("w1", Role.WORKER), server_hostname="localhost")
    assert caught.value.code == pb.ERROR_CODE_PERMISSION_DENIED
    assert "role worker of w1 may not connect here" in caught.value.message
    assert "may not connect" in _reasons(logs)
    await _assert_healthy(server, edge_tls)


async def test_client_refuses_server_of_unexpected_role(server: Listener, edge_tls: TlsConfig) -> None:
    with pytest.raises(IopError) as caught:
        await dial(
            "127.0.0.1", server.port, tls=edge_tls, server_hostname="localhost", expect_roles={Role.CONTROL_PLANE}
        )
    assert caught.value.code == pb.ERROR_CODE_PERMISSION_DENIED
    assert not isinstance(caught.value, ConnectionClosed)
