"""The edge's admin connections: what the console asks that the edge's own certificate may not.

The edge's certificate (role edge) submits runs and reads the platform; draining, undraining and
removing nodes, and seeing every caller's batches and files, take an admin certificate. The one
named by ``console.admin_cert`` and ``console.admin_key`` (signed by ``tls.ca``) is used for them:
a connection to the control-plane(s) and one to the worker, each dialed the first time such a
request comes and then kept open (redialed by the wire's dialer when it closes). Unset, those
requests answer 503 naming the settings.
"""

from __future__ import annotations

from iop_edge.settings import Settings
from iop_wire import IopError, Role
from iop_wire.connection import Connection
from iop_wire.dialer import KeepConnected, Links
from iop_wire.openai.errors import ApiError
from iop_wire.settings import ControlPlaneAddress
from iop_wire.tls import TlsConfig

__all__ = ["CONNECT_TIMEOUT", "AdminLinks"]

CONNECT_TIMEOUT = 5.0
"""Seconds an admin request waits for its connection to come up."""
_UNSET = (
    "this edge has no admin certificate for that: set console.admin_cert and console.admin_key "
    "(an admin certificate signed by tls.ca; iop up writes them)"
)


class AdminLinks:
    """Connections with the admin certificate to the control-plane(s) and to the worker, opened on first use."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        console = settings.console
        self.configured = console.admin_cert is not None and console.admin_key is not None
        self._links: dict[str, Links] = {}

    async def control_plane(self) -> Connection:
        """A connection to a control-plane as an admin; 503 without the settings or when none comes up."""
        return await self._connected("control_plane", self.settings.control_plane, Role.CONTROL_PLANE)

    async def worker(self) -> Connection:
        """A connection to the worker as an admin; 503 without the settings, a worker, or when it is away."""
        if not self.settings.worker.all_addresses:
            raise ApiError(503, "no worker is configured: set worker.address", code="service_unavailable")
        return await self._connected("worker", self.settings.worker, Role.WORKER)

    async def aclose(self) -> None:
        """Close every admin connection opened."""
        for links in self._links.values():
            await links.stop()
        self._links.clear()

    async def _connected(self, peer: str, section: ControlPlaneAddress, role: Role) -> Connection:
        if not self.configured:
            raise ApiError(503, _UNSET, param="console.admin_cert", code="service_unavailable")
        links = self._links.get(peer)
        if links is None:
            links = self._links[peer] = self._open(section, role)
        try:
            return await links.connected(CONNECT_TIMEOUT)
        except (TimeoutError, IopError):
            message = f"the {role.value} at {', '.join(links.addresses)} did not accept the edge's admin connection"
            raise ApiError(503, message, code="service_unavailable", retry_after=1.0) from None

    def _open(self, section: ControlPlaneAddress, role: Role) -> Links:
        settings = self.settings
        console = settings.console
        tls = TlsConfig(enabled=True, cert=console.admin_cert, key=console.admin_key, ca=settings.tls.ca)
        connection = settings.connection.config(heartbeat_interval=settings.heartbeat_interval)
        targets = section.targets(tls, connection, role)
        links = Links([KeepConnected(target, backoff=section.backoff()) for target in targets])
        links.start()
        return links
