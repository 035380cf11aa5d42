"""The wire's pieces for joining machines (issue 19): a listener on several addresses, certless
peers where a listener takes them (and nowhere else), and the screen that refuses a verified
certificate at the preface. Real mTLS on 127.0.0.1 and 127.0.0.2 (all of 127/8 is loopback)."""

from __future__ import annotations

import pytest
from conftest import EchoHandler, Pki, assert_eventually

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Handler, Inbound
from iop_wire.endpoint import Listener, ListenerConfig, dial
from iop_wire.errors import HandshakeError, IopError
from iop_wire.settings import ListenSettings, TlsSettings
from iop_wire.tls import CERTLESS, PeerIdentity, Role, certless_context


async def test_a_listener_binds_every_host_on_one_port(pki: Pki, handler: EchoHandler) -> None:
    edge = pki.config("edge", Role.EDGE)
    config = ListenerConfig(hosts=("127.0.0.1", "127.0.0.2"), tls=pki.config("n", Role.NODE))
    async with Listener(config, handler.wire()) as listener:
        assert [host for host, _ in listener.addresses] == ["127.0.0.1", "127.0.0.2"]
        assert {port for _, port in listener.addresses} == {listener.port}
        for host in ("127.0.0.1", "127.0.0.2"):
            async with dial(host, listener.port, tls=edge, server_hostname="localhost") as connection:
                assert (await connection.capabilities()).node_id == "test-node"


def test_listen_host_takes_one_address_or_several() -> None:
    assert ListenSettings(host="10.0.0.5").hosts == ("10.0.0.5",)
    listen = ListenSettings.model_validate({"host": ["127.0.0.1", "10.0.0.5"], "port": 7400})
    config = listen.config(TlsSettings(), ListenerConfig().connection, None)
    assert (config.hosts, config.host, config.port) == (("127.0.0.1", "10.0.0.5"), "127.0.0.1", 7400)
    for bad in ([], ["127.0.0.1", "127.0.0.1"]):
        with pytest.raises(ValueError, match="host"):
            ListenSettings.model_validate({"host": bad})


async def test_certless_peers_get_the_handler_made_for_them(pki: Pki, handler: EchoHandler) -> None:
    seen: list[PeerIdentity] = []

    async def hello(inbound: Inbound) -> None:
        await inbound.reply(pb.Envelope(join_welcome=pb.JoinWelcome(ca_pem="the CA")))

    def handler_for(peer: PeerIdentity) -> Handler:
        seen.append(peer)
        return Handler(messages={"join_hello": hello}) if peer.certless else handler.wire()

    config = ListenerConfig(
        tls=pki.config("n", Role.NODE), allowed_roles=frozenset({Role.EDGE}), certless=True, certless_timeout=0.5
    )
    async with Listener(config, handler_for) as listener:
        anonymous = await dial(
            "127.0.0.1", listener.port, context=certless_context(pki.authority.cert_pem), server_hostname="localhost"
        )
        welcome = await anonymous.request(pb.Envelope(join_hello=pb.JoinHello()))
        assert welcome.join_welcome.ca_pem == "the CA" and seen[-1] == CERTLESS
        await assert_eventually(lambda: anonymous.closed, timeout=10)  # certless_timeout, whatever it does
        edge = pki.config("edge", Role.EDGE)  # a certificate is verified and its role checked as always
        async with dial("127.0.0.1", listener.port, tls=edge, server_hostname="localhost") as verified:
            assert (await verified.capabilities()).node_id == "test-node"
        assert seen[-1].name == "edge" and not seen[-1].certless
        with pytest.raises(HandshakeError) as other_role:
            await dial("127.0.0.1", listener.port, tls=pki.config("x", Role.NODE), server_hostname="localhost")
        assert other_role.value.code == pb.ERROR_CODE_PERMISSION_DENIED


async def test_a_listener_without_certless_requires_a_certificate(pki: Pki, handler: EchoHandler) -> None:
    async with Listener(ListenerConfig(tls=pki.config("n", Role.NODE)), handler.wire()) as listener:
        with pytest.raises((IopError, OSError)):
            await dial("127.0.0.1", listener.port, context=certless_context(), server_hostname="localhost")


async def test_the_screen_refuses_a_verified_peer_at_the_preface(pki: Pki, handler: EchoHandler) -> None:
    banned = pki.config("banned", Role.EDGE)
    refusal = IopError(pb.ERROR_CODE_PERMISSION_DENIED, "revoked", reason=pb.ERROR_REASON_CERTIFICATE_REVOKED)
    asked: list[str] = []

    def screen(peer: PeerIdentity) -> IopError | None:
        asked.append(peer.name)
        return refusal if peer.name == "banned" else None

    config = ListenerConfig(tls=pki.config("n", Role.NODE))
    async with Listener(config, handler.wire(), screen=screen) as listener:
        with pytest.raises(HandshakeError) as refused:
            await dial("127.0.0.1", listener.port, tls=banned, server_hostname="localhost")
        assert (refused.value.code, refused.value.reason) == (
            pb.ERROR_CODE_PERMISSION_DENIED,
            pb.ERROR_REASON_CERTIFICATE_REVOKED,
        )
        edge = pki.config("edge", Role.EDGE)
        async with dial("127.0.0.1", listener.port, tls=edge, server_hostname="localhost") as fine:
            assert (await fine.capabilities()).node_id == "test-node"
        assert asked == ["banned", "edge"]
