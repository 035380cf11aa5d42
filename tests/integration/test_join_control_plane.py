"""Machines joining a control-plane, and node identity (issue 19, items 2, 4 and 5), at the wire:
a real control-plane on 127.0.0.1 port 0 with mTLS, certificates minted here, its SQLite file,
and joiners written with the wire API (join.hello unverified, join.request verifying the CA).
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import Pki, assert_eventually
from cp_helpers import all_ready, client, cp_settings, node_processes
from join_helpers import admin, certless, create_token, csr, join, join_request, join_settings, port, register
from node_helpers import chat, collect, kinds

from iop_control_plane.bootstrap import ControlPlaneApp, build_control_plane
from iop_control_plane.registry import NodeState
from iop_control_plane.settings import ConfigError, load_settings
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import ca_hash, certificate_facts
from iop_wire.endpoint import dial
from iop_wire.errors import HandshakeError, IopError
from iop_wire.metrics import REGISTRY
from iop_wire.tls import Role, TlsConfig

_NOT_A_CSR = "-----BEGIN CERTIFICATE REQUEST-----\nbm90IGEgcmVxdWVzdA==\n-----END CERTIFICATE REQUEST-----\n"


@pytest.fixture
async def cp(pki: Pki, tmp_path: Path) -> AsyncIterator[ControlPlaneApp]:
    async with build_control_plane(join_settings(pki, tmp_path)) as app:
        yield app


def _sample(app: ControlPlaneApp, name: str, **labels: str) -> float:
    return app.metrics.registry.get_sample_value(name, labels) or 0.0


def _attempts(app: ControlPlaneApp, outcome: str) -> float:
    return _sample(app, "iop_control_plane_join_attempts_total", outcome=outcome)


async def _refused(app: ControlPlaneApp, pki: Pki, token: str, csr_pem: str) -> IopError:
    with pytest.raises(IopError) as refused:
        await join_request(app, pki, token, csr_pem)
    return refused.value


async def test_a_machine_joins_and_registers_under_its_certificate(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    created = await create_token(cp, pki, name_prefix="gpu-")
    assert created.token.startswith(f"iopjt-{created.info.id}.") and created.info.created_by == "ops"
    assert created.ca_hash == ca_hash(pki.authority.cert_pem) and created.info.uses == 1
    hello = await certless(cp)  # verifies nothing: the joiner checks the CA it gets against its pin
    welcome = (await hello.request(pb.Envelope(join_hello=pb.JoinHello()))).join_welcome
    assert ca_hash(welcome.ca_pem.encode()) == created.ca_hash
    await hello.close()

    tls = await join(cp, pki, created.token, "gpu-1", tmp_path / "gpu-1")
    assert tls.cert is not None
    facts = certificate_facts(tls.cert.read_bytes())
    assert (facts.name, facts.role) == ("gpu-1", "node")
    assert facts.not_after - facts.not_before == datetime.timedelta(days=7, minutes=1)  # a lifetime of days
    node = await register(cp, tls, "gpu-1")
    async with await admin(cp, pki) as ops:
        (info,) = (await ops.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed.nodes
        (token,) = (await ops.request(pb.Envelope(join_tokens_list=pb.JoinTokensList()))).join_tokens_listed.tokens
    assert (info.node_id, info.certificate_serial, info.shared_certificate) == ("gpu-1", facts.serial, False)
    assert info.certificate_not_after.ToDatetime(datetime.UTC) == facts.not_after
    assert (token.id, token.used, token.uses, token.name_prefix) == (created.info.id, 1, 1, "gpu-")
    assert await cp.joining.store.attempts() == [(created.info.id, "127.0.0.1", "gpu-1", "accepted")]
    assert _attempts(cp, "accepted") == 1
    await node.close()


async def test_bad_tokens_are_refused_each_with_its_reason(cp: ControlPlaneApp, pki: Pki) -> None:
    _, request = csr("gpu-1")
    good = await create_token(cp, pki)
    wrong_secret = good.token[:-4] + ("0000" if not good.token.endswith("0000") else "1111")
    for token in (wrong_secret, "iopjt-zzzzzz." + "0" * 32, "not a token", ""):
        refused = await _refused(cp, pki, token, request)
        assert (refused.code, refused.reason) == (pb.ERROR_CODE_PERMISSION_DENIED, pb.ERROR_REASON_TOKEN_INVALID)
        assert refused.message == "the join token is not valid"  # nothing told about which part is wrong

    expired, _ = await cp.joining.store.create_token(ttl=-1, uses=1, name_prefix="", created_by="test")
    refused = await _refused(cp, pki, expired, request)
    assert (refused.code, refused.reason) == (pb.ERROR_CODE_PERMISSION_DENIED, pb.ERROR_REASON_TOKEN_EXPIRED)

    revoked = await create_token(cp, pki)
    async with await admin(cp, pki) as ops:
        revoke = pb.JoinTokenRevoke(id=revoked.info.id)
        assert "revoked" in (await ops.request(pb.Envelope(join_token_revoke=revoke))).operation_done.message
        with pytest.raises(IopError) as unknown:
            await ops.request(pb.Envelope(join_token_revoke=pb.JoinTokenRevoke(id="nosuch")))
        assert unknown.value.code == pb.ERROR_CODE_NOT_FOUND
    refused = await _refused(cp, pki, revoked.token, request)
    assert (refused.code, refused.reason) == (pb.ERROR_CODE_PERMISSION_DENIED, pb.ERROR_REASON_TOKEN_REVOKED)

    assert (await join_request(cp, pki, good.token, request)).join_accepted.node_id == "gpu-1"
    _, again = csr("gpu-2")
    refused = await _refused(cp, pki, good.token, again)
    assert (refused.code, refused.reason) == (pb.ERROR_CODE_PERMISSION_DENIED, pb.ERROR_REASON_TOKEN_USED_UP)

    counted = {outcome: _attempts(cp, outcome) for outcome in ("token_invalid", "token_expired", "token_revoked")}
    assert counted == {"token_invalid": 4, "token_expired": 1, "token_revoked": 1}
    assert (_attempts(cp, "token_used_up"), _attempts(cp, "accepted")) == (1, 1)
    outcomes = [outcome for *_, outcome in await cp.joining.store.attempts()]
    assert len(outcomes) == 8 and outcomes.count("token_invalid") == 4  # every attempt audited


async def test_guessed_tokens_are_bounded_per_address(pki: Pki, tmp_path: Path) -> None:
    settings = join_settings(pki, tmp_path, join={"max_failures": 3, "failure_window": 600})
    async with build_control_plane(settings) as cp:
        good = await create_token(cp, pki)
        _, request = csr("gpu-1")
        for guess in range(3):
            refused = await _refused(cp, pki, f"iopjt-{good.info.id}.{guess:032x}", request)
            assert refused.reason == pb.ERROR_REASON_TOKEN_INVALID
        refused = await _refused(cp, pki, good.token, request)  # even the right token: nothing is checked
        assert (refused.code, refused.reason) == (pb.ERROR_CODE_RESOURCE_EXHAUSTED, pb.ERROR_REASON_TOO_MANY_ATTEMPTS)
        assert refused.retry_after is not None and refused.retry_after.total_seconds() > 0
        assert _attempts(cp, "too_many_attempts") == 1 and _attempts(cp, "token_invalid") == 3
        assert (await cp.joining.store.token(good.info.id)).used == 0  # type: ignore[union-attr]


async def test_bad_certificate_requests_are_refused_and_leave_the_token(cp: ControlPlaneApp, pki: Pki) -> None:
    token = await create_token(cp, pki, name_prefix="gpu-")
    _, admin_role = csr("gpu-1", role="admin")
    _, badly_named = csr("gpu 1!")
    _, role_name = csr("node")
    _, other_prefix = csr("cpu-1")
    cases = {
        "asks for role 'admin'": admin_role,
        "not a PEM PKCS#10": _NOT_A_CSR,
        "not a node name": badly_named,
        "starting with 'gpu-'": other_prefix,
    }
    for says, request in cases.items():
        refused = await _refused(cp, pki, token.token, request)
        assert refused.code == pb.ERROR_CODE_INVALID_ARGUMENT and says in refused.message, refused.message
    token_for_any = await create_token(cp, pki)
    refused = await _refused(cp, pki, token_for_any.token, role_name)  # a role's name is no node's name
    assert refused.code == pb.ERROR_CODE_INVALID_ARGUMENT
    assert _attempts(cp, "bad_request") == 5
    assert (await cp.joining.store.token(token.info.id)).used == 0  # type: ignore[union-attr]


async def test_a_name_held_by_a_live_node_is_taken(cp: ControlPlaneApp, pki: Pki) -> None:
    live = await register(cp, pki.config("gpu-1", Role.NODE), "gpu-1")
    token = await create_token(cp, pki)
    _, request = csr("gpu-1")
    refused = await _refused(cp, pki, token.token, request)
    assert (refused.code, refused.reason) == (pb.ERROR_CODE_PERMISSION_DENIED, pb.ERROR_REASON_NAME_TAKEN)
    assert not live.closed and _attempts(cp, "name_taken") == 1
    await live.close()


@pytest.mark.parametrize(
    "envelope",
    [
        pb.Envelope(capability_request=pb.CapabilityRequest()),
        pb.Envelope(node_register=pb.NodeRegister(node_id="sneaky")),
        pb.Envelope(nodes_list=pb.NodesList()),
        pb.Envelope(join_token_create=pb.JoinTokenCreate()),
    ],
    ids=["capability", "register", "admin", "token"],
)
async def test_a_certless_peer_may_only_join(cp: ControlPlaneApp, envelope: pb.Envelope) -> None:
    connection = await certless(cp)
    with pytest.raises(IopError) as refused:
        await connection.request(envelope)
    assert refused.value.code == pb.ERROR_CODE_PERMISSION_DENIED
    await assert_eventually(lambda: connection.closed)
    assert "sneaky" not in cp.registry.nodes


async def test_a_certless_peer_cannot_run(cp: ControlPlaneApp) -> None:
    connection = await certless(cp)
    events = [event async for event in await connection.open_run(pb.RunRequest(run_id="r", model="m"))]
    assert [event.error.code for event in events] == [pb.ERROR_CODE_PERMISSION_DENIED]
    await assert_eventually(lambda: connection.closed)


async def test_a_certless_connection_is_closed_after_the_anonymous_timeout(pki: Pki, tmp_path: Path) -> None:
    async with build_control_plane(join_settings(pki, tmp_path, join={"anonymous_timeout": 0.5})) as cp:
        connection = await certless(cp)
        await assert_eventually(lambda: connection.closed, timeout=10)
        assert connection.close_error is not None and "without a certificate" in connection.close_error.message


async def test_without_join_ca_key_no_certless_peer_gets_in_and_join_is_unavailable(pki: Pki, tmp_path: Path) -> None:
    async with build_control_plane(cp_settings(pki, tmp_path)) as cp:
        with pytest.raises((IopError, OSError)):
            await certless(cp)  # TLS itself asks for a certificate
        edge = await client(cp, pki)
        for envelope in (pb.Envelope(join_hello=pb.JoinHello()), pb.Envelope(join_tokens_list=pb.JoinTokensList())):
            with pytest.raises(IopError) as off:
                await edge.request(envelope)
            assert off.value.code == pb.ERROR_CODE_UNAVAILABLE and "join.ca_key" in off.value.message
        await edge.close()


def test_join_ca_key_is_checked_at_start(pki: Pki, tmp_path: Path) -> None:
    tls = pki.config("cp", Role.CONTROL_PLANE)
    other = tmp_path / "other"
    other.mkdir()
    type(pki.authority)("another CA").write(other)
    config = tmp_path / "cp.yaml"
    config.write_text(
        f"tls: {{enabled: true, cert: {tls.cert}, key: {tls.key}, ca: {tls.ca}}}\njoin:\n  ca_key: {other / 'ca.key'}\n"
    )
    with pytest.raises(
        ConfigError, match=r"^join\.ca_key \(line 3\): .* is not the unencrypted EC key of the CA in tls\.ca$"
    ):
        load_settings(config)
    config.write_text(f"join: {{ca_key: {other / 'ca.key'}}}\n")
    with pytest.raises(ConfigError, match=r"^join\.ca_key \(line 1\): needs tls\.enabled and tls\.ca"):
        load_settings(config)


async def test_a_node_registers_only_under_its_certificates_name(pki: Pki, tmp_path: Path) -> None:
    async with build_control_plane(join_settings(pki, tmp_path)) as cp:
        with pytest.raises(IopError) as mismatch:
            await register(cp, pki.config("gpu-1", Role.NODE), "gpu-2")
        assert (mismatch.value.code, mismatch.value.reason) == (
            pb.ERROR_CODE_PERMISSION_DENIED,
            pb.ERROR_REASON_IDENTITY_MISMATCH,
        )
        assert "gpu-2" not in cp.registry.nodes
        refused = _sample(cp, "iop_control_plane_registrations_refused_total", reason="identity_mismatch")
        assert refused == 1
        shared = await register(cp, pki.config("node", Role.NODE), "local-node")  # the development certificate
        async with await admin(cp, pki) as ops:
            (info,) = (await ops.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed.nodes
        assert (info.node_id, info.shared_certificate) == ("local-node", True)
        await shared.close()
    settings = join_settings(pki, tmp_path, identity={"shared_node_certificate": False})
    async with build_control_plane(settings) as cp:
        with pytest.raises(IopError) as not_here:
            await register(cp, pki.config("node", Role.NODE), "local-node")
        assert not_here.value.reason == pb.ERROR_REASON_IDENTITY_MISMATCH
        assert "identity.shared_node_certificate" in not_here.value.message


async def test_removing_a_node_closes_it_and_revokes_its_certificate(
    cp: ControlPlaneApp, pki: Pki, tmp_path: Path
) -> None:
    token = await create_token(cp, pki, uses=2)
    tls = await join(cp, pki, token.token, "gpu-1", tmp_path / "first")
    node = await register(cp, tls, "gpu-1")
    same_cert = await dial("127.0.0.1", port(cp), tls=tls, server_hostname="localhost")  # open, not registered
    async with await admin(cp, pki) as ops:
        remove = pb.NodesRemove(node_id="gpu-1", reason="decommissioned")
        done = (await ops.request(pb.Envelope(nodes_remove=remove))).operation_done
        assert "gpu-1 removed" in done.message and "1 certificate(s) revoked" in done.message
        await assert_eventually(lambda: node.closed)  # at once: no heartbeat timeout involved
        assert node.close_error is not None and "certificate is revoked" in node.close_error.message
        listed = (await ops.request(pb.Envelope(nodes_list=pb.NodesList()))).nodes_listed.nodes
        assert "gpu-1" not in [info.node_id for info in listed]
        with pytest.raises(IopError) as unknown:
            await ops.request(pb.Envelope(nodes_remove=pb.NodesRemove(node_id="nobody")))
        assert unknown.value.code == pb.ERROR_CODE_NOT_FOUND

    with pytest.raises(HandshakeError) as at_handshake:  # the old certificate cannot come back
        await register(cp, tls, "gpu-1")
    assert (at_handshake.value.code, at_handshake.value.reason) == (
        pb.ERROR_CODE_PERMISSION_DENIED,
        pb.ERROR_REASON_CERTIFICATE_REVOKED,
    )
    assert _sample(cp, "iop_control_plane_connections_refused_total", reason="certificate_revoked") == 1
    register_message = pb.NodeRegister(node_id="gpu-1")
    with pytest.raises(IopError) as at_register:  # a connection opened before the revocation
        await same_cert.request(pb.Envelope(node_register=register_message))
    assert at_register.value.reason == pb.ERROR_REASON_CERTIFICATE_REVOKED
    await same_cert.close()

    again = await join(cp, pki, token.token, "gpu-1", tmp_path / "again")  # joining again: a new certificate
    rejoined = await register(cp, again, "gpu-1")
    assert not rejoined.closed
    await rejoined.close()


async def test_a_node_renews_its_certificate_over_its_connection(cp: ControlPlaneApp, pki: Pki, tmp_path: Path) -> None:
    token = await create_token(cp, pki)
    tls = await join(cp, pki, token.token, "gpu-1", tmp_path / "gpu-1")
    node = await register(cp, tls, "gpu-1")
    key, request = csr("gpu-1")
    renewed = (await node.request(pb.Envelope(cert_renew=pb.CertRenew(csr_pem=request)))).cert_renewed
    facts = certificate_facts(renewed.certificate_pem.encode())
    assert tls.cert is not None
    assert facts.name == "gpu-1" and facts.serial != certificate_facts(tls.cert.read_bytes()).serial
    assert renewed.not_after.ToDatetime(datetime.UTC) == facts.not_after
    (tmp_path / "new.crt").write_text(renewed.certificate_pem)
    (tmp_path / "new.key").write_bytes(key)
    new_tls = type(tls)(enabled=True, cert=tmp_path / "new.crt", key=tmp_path / "new.key", ca=tls.ca)
    await node.close()
    with_new = await register(cp, new_tls, "gpu-1")  # the next dial uses the new certificate

    _, other = csr("gpu-2")
    with pytest.raises(IopError) as mismatch:
        await with_new.request(pb.Envelope(cert_renew=pb.CertRenew(csr_pem=other)))
    assert (mismatch.value.code, mismatch.value.reason) == (
        pb.ERROR_CODE_PERMISSION_DENIED,
        pb.ERROR_REASON_IDENTITY_MISMATCH,
    )
    with pytest.raises(IopError) as malformed:
        await with_new.request(pb.Envelope(cert_renew=pb.CertRenew(csr_pem=_NOT_A_CSR)))
    assert malformed.value.code == pb.ERROR_CODE_INVALID_ARGUMENT
    await with_new.close()

    shared = await register(cp, pki.config("node", Role.NODE), "local-node")
    _, shared_request = csr("node")
    with pytest.raises(IopError) as not_shared:
        await shared.request(pb.Envelope(cert_renew=pb.CertRenew(csr_pem=shared_request)))
    assert not_shared.value.code == pb.ERROR_CODE_PERMISSION_DENIED
    await shared.close()


def _limit_hits(limit: str) -> float:
    return REGISTRY.get_sample_value("iop_wire_limit_hits_total", {"limit": limit}) or 0.0


async def _closed_by_listener(reader: asyncio.StreamReader) -> bool:
    try:
        return await reader.read(1) == b""
    except ConnectionError:  # reset at accept
        return True


async def test_the_control_plane_keeps_serving_while_joins_are_attacked(pki: Pki, tmp_path: Path) -> None:
    listen = {"port": 0, "max_handshakes_per_address": 4, "first_byte_timeout": 1}
    settings = join_settings(pki, tmp_path, listen=listen, join={"max_failures": 2})
    async with build_control_plane(settings) as cp:
        with node_processes(pki, tmp_path, port(cp), "node-a"):
            await all_ready(cp, "node-a")
            edge = await client(cp, pki)
            running = await edge.open_run(chat(model="mock-slow"))  # streams through everything below
            assert (await anext(running)).WhichOneof("event") == "start"

            refused = _limit_hits("handshakes_per_address")
            flood = [  # a join endpoint flooded with handshakes that never say hello, from one address
                await asyncio.open_connection("127.0.0.1", port(cp), local_addr=("127.0.0.2", 0)) for _ in range(20)
            ]
            assert await asyncio.wait_for(asyncio.gather(*(_closed_by_listener(r) for r, _ in flood)), 10)
            assert _limit_hits("handshakes_per_address") - refused >= 16  # beyond the bound: closed at accept
            for _, writer in flood:
                writer.close()
            _, request = csr("gpu-1")
            for guess in range(4):  # guessed tokens, then the bound
                await _refused(cp, pki, f"iopjt-aaaaaa.{guess:032x}", request)
            for junk in (
                pb.Envelope(nodes_list=pb.NodesList()),
                pb.Envelope(capability_request=pb.CapabilityRequest()),
            ):
                certless_peer = await certless(cp)
                with pytest.raises(IopError):
                    await certless_peer.request(junk)
            with pytest.raises(IopError):
                await register(cp, pki.config("node-b", Role.NODE), "node-a")  # an identity mismatch

            assert kinds(await collect(await edge.open_run(chat())))[-1] == "complete"  # new runs go on
            await running.cancel("enough")
            assert kinds(await collect(running))[-1] == "error"  # the old one streamed until cancelled
            assert cp.registry.nodes["node-a"].state is NodeState.READY
            await edge.close()


async def test_certless_connections_count_against_the_per_peer_bound_by_address(pki: Pki, tmp_path: Path) -> None:
    settings = join_settings(pki, tmp_path, listen={"port": 0, "max_connections_per_peer": 2})
    async with build_control_plane(settings) as cp:
        held = [await certless(cp), await certless(cp)]
        with pytest.raises(HandshakeError) as third:
            await certless(cp)
        assert third.value.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED and "address 127.0.0.1" in third.value.message
        edge = await client(cp, pki)  # a certificate is its own peer: not held back by the address
        assert (await edge.capabilities()).node_id == "control-plane"
        for connection in (*held, edge):
            await connection.close()


async def test_certless_connections_in_all_are_bounded_and_never_crowd_out_certificates(
    pki: Pki, tmp_path: Path
) -> None:
    settings = join_settings(pki, tmp_path, join={"max_anonymous": 2, "max_anonymous_per_address": 4})
    async with build_control_plane(settings) as cp:
        held = [await certless(cp), await certless(cp)]
        with pytest.raises(HandshakeError) as third:
            await certless(cp)
        assert third.value.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED
        assert "2 certless connections are open here" in third.value.message
        hits = cp.metrics.registry.get_sample_value("iop_wire_limit_hits_total", {"limit": "certless_connections"})
        assert hits is not None and hits >= 1
        edge = await client(cp, pki)  # a peer with a certificate still gets in
        assert (await edge.capabilities()).node_id == "control-plane"
        await held[0].close()
        listener = cp.listener
        assert listener is not None
        await assert_eventually(lambda: sum(c.peer.certless for c in listener.connections) == 1)
        replacement = await certless(cp)  # room again once one closed
        for connection in (held[1], replacement, edge):
            await connection.close()


async def test_a_node_whose_certificate_expired_must_join_again(cp: ControlPlaneApp, pki: Pki, tmp_path: Path) -> None:
    key, request = csr("gpu-old")
    pem, _ = pki.authority.sign_request(request.encode(), role=Role.NODE, lifetime=datetime.timedelta(seconds=-30))
    (tmp_path / "old.crt").write_bytes(pem)
    (tmp_path / "old.key").write_bytes(key)
    (tmp_path / "ca.crt").write_bytes(pki.authority.cert_pem)
    expired = TlsConfig(enabled=True, cert=tmp_path / "old.crt", key=tmp_path / "old.key", ca=tmp_path / "ca.crt")
    with pytest.raises((OSError, IopError)):  # refused at the handshake: an expired certificate is no identity
        await register(cp, expired, "gpu-old")
    assert "gpu-old" not in cp.registry.nodes
    token = await create_token(cp, pki)
    joined = await register(cp, await join(cp, pki, token.token, "gpu-old", tmp_path / "again"), "gpu-old")
    assert not joined.closed
    await joined.close()
