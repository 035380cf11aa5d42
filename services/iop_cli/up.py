"""``iop up``: bring up what exists of the platform on this machine.

Today that is the protocol layer: ``up`` makes sure development certificates exist under
``DIR/certs``, opens an mTLS listener on 127.0.0.1 and proves it with a connection per codec
(preface, capability exchange, heartbeat), then exits. Services join here as they land.
"""

from __future__ import annotations

import time
from pathlib import Path

from iop_gen.bp import iop as bp
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import init_dir
from iop_wire.connection import Connection, EventSink
from iop_wire.endpoint import Listener, ListenerConfig, dial
from iop_wire.errors import ErrorCode, IopError
from iop_wire.tls import PeerIdentity, Role, TlsConfig


class _NoServices:
    """Answers for a platform with no node yet: no adapters, every run MODEL_NOT_FOUND."""

    async def run(self, request: bp.RunRequest, sink: EventSink) -> None:
        raise IopError(ErrorCode.MODEL_NOT_FOUND, f"no node serves {request.model!r} yet")

    async def capabilities(self) -> bp.CapabilityResponse:
        from importlib.metadata import version

        return bp.CapabilityResponse(node_id="iop-up", version=version("iop"))

    async def message(self, connection: Connection, envelope: pb.Envelope) -> None:
        return None


def _tls(certs: Path, role: Role) -> TlsConfig:
    return TlsConfig(enabled=True, cert=certs / f"{role}.crt", key=certs / f"{role}.key", ca=certs / "ca.crt")


async def up(state: Path) -> int:
    """Prepare certificates and prove the wire; returns the exit code."""
    certs = state / "certs"
    if not (certs / "ca.crt").exists():
        init_dir(certs)
        print(f"minted a development CA and per-role certificates in {certs}")

    def no_services(peer: PeerIdentity) -> _NoServices:
        return _NoServices()

    listener = await Listener(ListenerConfig(tls=_tls(certs, Role.NODE)), no_services).start()
    try:
        for codec in ("proto", "json"):
            started = time.perf_counter()
            connection = await dial("127.0.0.1", listener.port, tls=_tls(certs, Role.ADMIN), codec=codec)
            capabilities = await connection.capabilities()
            await connection.close("up check done")
            elapsed = (time.perf_counter() - started) * 1000
            print(
                f"wire ok: mTLS to 127.0.0.1:{listener.port} as {connection.peer.role}, codec {codec}, "
                f"capabilities from {capabilities.node_id} {capabilities.version} in {elapsed:.1f} ms"
            )
    finally:
        await listener.close()
    print("no services to start yet: the node, control-plane, edge and worker arrive with their issues")
    return 0
