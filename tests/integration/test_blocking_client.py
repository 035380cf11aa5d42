"""The blocking client (``iop_wire.blocking``) against a real Listener over mTLS on 127.0.0.1, and the
lazy ``iop_wire`` package that lets it start without asyncio (what `iop nodes ls` and the other
admin commands use)."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
from conftest import Pki, assert_eventually

import iop_wire
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.blocking import BlockingClient
from iop_wire.connection import ConnectionConfig, Handler, Inbound
from iop_wire.endpoint import Listener, ListenerConfig
from iop_wire.errors import HandshakeError, IopError
from iop_wire.tls import Role, TlsConfig, client_context


class _Answers:
    """Answers capability.request late (after heartbeats went out), refuses node.register, ignores node.status."""

    def __init__(self) -> None:
        self.statuses: list[Inbound] = []

    async def capability(self, inbound: Inbound) -> None:
        await asyncio.sleep(0.5)  # heartbeats every 0.1 s meanwhile: the client skips them
        await inbound.reply(pb.Envelope(capability_response=pb.CapabilityResponse(node_id="answered")))

    async def register(self, inbound: Inbound) -> None:
        raise IopError(pb.ERROR_CODE_PERMISSION_DENIED, f"{inbound.peer.name} may not register here")

    async def status(self, inbound: Inbound) -> None:
        self.statuses.append(inbound)

    def handler(self) -> Handler:
        messages = {"capability_request": self.capability, "node_register": self.register, "node_status": self.status}
        return Handler(messages=messages)


@pytest.fixture
async def listener(pki: Pki) -> AsyncIterator[Listener]:
    config = ListenerConfig(
        tls=pki.config("test-cp", Role.CONTROL_PLANE),
        allowed_roles=frozenset({Role.ADMIN}),
        connection=ConnectionConfig(heartbeat_interval=0.1),
    )
    async with Listener(config, _Answers().handler()) as started:
        yield started


def _ask(port: int, tls: TlsConfig, envelope: pb.Envelope, timeout: float = 10.0) -> pb.Envelope:
    with BlockingClient.connect("127.0.0.1", port, context=client_context(tls), server_hostname="localhost") as client:
        return client.request(envelope, timeout=timeout)


async def test_a_request_gets_its_answer_past_heartbeats_and_the_close_is_graceful(
    listener: Listener, pki: Pki
) -> None:
    admin = pki.config("ops", Role.ADMIN)
    asked = pb.Envelope(id="ask-1", capability_request=pb.CapabilityRequest())
    answer = await asyncio.to_thread(_ask, listener.port, admin, asked)
    assert (answer.in_reply_to, answer.capability_response.node_id) == ("ask-1", "answered")
    await assert_eventually(lambda: not listener.connections)  # the listener let it go


async def test_an_error_answer_is_raised_with_its_code(listener: Listener, pki: Pki) -> None:
    admin = pki.config("ops", Role.ADMIN)
    with pytest.raises(IopError, match="ops may not register here") as raised:
        await asyncio.to_thread(_ask, listener.port, admin, pb.Envelope(node_register=pb.NodeRegister()))
    assert raised.value.code == pb.ERROR_CODE_PERMISSION_DENIED


async def test_a_role_the_listener_does_not_take_is_refused_at_the_preface(listener: Listener, pki: Pki) -> None:
    edge = pki.config("test-edge", Role.EDGE)
    with pytest.raises(HandshakeError) as raised:
        await asyncio.to_thread(_ask, listener.port, edge, pb.Envelope(capability_request=pb.CapabilityRequest()))
    assert raised.value.code == pb.ERROR_CODE_PERMISSION_DENIED


async def test_no_answer_in_time_is_a_timeout(listener: Listener, pki: Pki) -> None:
    admin = pki.config("ops", Role.ADMIN)
    with pytest.raises(TimeoutError):  # node.status is never answered
        await asyncio.to_thread(_ask, listener.port, admin, pb.Envelope(node_status=pb.NodeStatus()), 0.3)


def test_the_wire_package_loads_its_parts_when_first_asked_for() -> None:
    homes = iop_wire._HOME_OF
    assert sorted(homes) == sorted(iop_wire.__all__)
    for name, module in homes.items():  # every re-export is its module's object
        assert getattr(iop_wire, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = iop_wire.nothing  # type: ignore[attr-defined]  # the point: an unknown name
    check = (
        "import sys, iop_wire.blocking; "
        "print(sorted({'asyncio', 'structlog', 'prometheus_client', 'iop_wire.connection'} & set(sys.modules)))"
    )
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60, check=True)
    assert loaded.stdout.strip() == "[]", loaded
