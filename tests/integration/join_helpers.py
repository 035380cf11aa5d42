"""Helpers for the join tests: a control-plane that lets machines join, and a joining machine's two
connections (unverified for join.hello, verifying the CA for join.request), written with the wire."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from conftest import Pki
from cp_helpers import cp_settings

from iop_control_plane.bootstrap import ControlPlaneApp
from iop_control_plane.settings import Settings
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import certificate_request, key_pem, new_key
from iop_wire.connection import Connection, ConnectionConfig, Handler
from iop_wire.endpoint import dial
from iop_wire.tls import Role, TlsConfig, certless_context

FAST = ConnectionConfig(heartbeat_interval=0.5)


def join_settings(pki: Pki, tmp_path: Path, **extra: Any) -> Settings:
    """:func:`cp_settings` with joining on: ``join.ca_key`` is the key of the test CA."""
    ca_dir = tmp_path / "ca"
    ca_dir.mkdir(exist_ok=True)
    pki.authority.write(ca_dir)
    join = {"ca_key": ca_dir / "ca.key", **extra.pop("join", {})}
    return cp_settings(pki, tmp_path, join=join, **extra)


def port(app: ControlPlaneApp) -> int:
    assert app.listener is not None
    return app.listener.port


async def certless(app: ControlPlaneApp, pki: Pki | None = None, handler: Handler | None = None) -> Connection:
    """A connection without a client certificate: verifying nothing, or the control-plane against ``pki``'s CA."""
    context = certless_context(pki.authority.cert_pem if pki is not None else None)
    return await dial(
        "127.0.0.1", port(app), context=context, server_hostname="localhost", config=FAST, handler=handler
    )


async def admin(app: ControlPlaneApp, pki: Pki) -> Connection:
    return await dial(
        "127.0.0.1", port(app), tls=pki.config("ops", Role.ADMIN), server_hostname="localhost", config=FAST
    )


async def create_token(app: ControlPlaneApp, pki: Pki, **fields: Any) -> pb.JoinTokenCreated:
    """A token made by an admin (``uses``, ``name_prefix``, ``ttl`` seconds)."""
    ttl = fields.pop("ttl", None)
    message = pb.JoinTokenCreate(**fields)
    if ttl is not None:
        message.ttl.FromTimedelta(datetime.timedelta(seconds=ttl))
    async with dial("127.0.0.1", port(app), tls=pki.config("ops", Role.ADMIN), server_hostname="localhost") as ops:
        return (await ops.request(pb.Envelope(join_token_create=message))).join_token_created


def csr(name: str, role: str = "node") -> tuple[bytes, str]:
    """A new key (PEM) and a certificate request for it (CN ``name``, OU ``role``)."""
    key = new_key()
    return key_pem(key), certificate_request(key, name, role).decode()


async def join_request(app: ControlPlaneApp, pki: Pki, token: str, csr_pem: str) -> pb.Envelope:
    """join.request over a fresh certless connection that verifies the control-plane."""
    async with dial(
        "127.0.0.1", port(app), context=certless_context(pki.authority.cert_pem), server_hostname="localhost"
    ) as connection:
        return await connection.request(pb.Envelope(join_request=pb.JoinRequest(token=token, csr_pem=csr_pem)))


async def join(app: ControlPlaneApp, pki: Pki, token: str, name: str, directory: Path) -> TlsConfig:
    """Join as ``name`` and return the TLS config of the node certificate received."""
    key, request = csr(name)
    accepted = (await join_request(app, pki, token, request)).join_accepted
    assert accepted.node_id == name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.key").write_bytes(key)
    (directory / f"{name}.crt").write_text(accepted.certificate_pem)
    (directory / "ca.crt").write_bytes(pki.authority.cert_pem)
    return TlsConfig(
        enabled=True, cert=directory / f"{name}.crt", key=directory / f"{name}.key", ca=directory / "ca.crt"
    )


async def register(app: ControlPlaneApp, tls: TlsConfig, node_id: str) -> Connection:
    """A node connection with ``tls`` that registered as ``node_id`` (the registration's error raised)."""
    connection = await dial("127.0.0.1", port(app), tls=tls, server_hostname="localhost", config=FAST)
    model = pb.ModelInfo(name="m", max_concurrency=1, available=True)
    capabilities = pb.CapabilityResponse(node_id=node_id, adapters=[pb.AdapterInfo(name="fake", models=[model])])
    status = pb.NodeStatus(models=[pb.ModelLoad(model="m", capacity=1, available=True)])
    try:
        await connection.request(
            pb.Envelope(node_register=pb.NodeRegister(node_id=node_id, capabilities=capabilities, status=status))
        )
    except BaseException:
        await connection.close()
        raise
    return connection
