"""The edge's keys put together: the store (``keys_path`` or ``store.url``), the in-memory view,
the limits (this edge's alone, or shared through ``store.url``), the usage writer, and the
background tasks that keep them current. :func:`open_keyring` fills them into an :class:`Edge`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from collections.abc import Awaitable, Callable

import structlog

from iop_edge.edge import Edge
from iop_edge.key_storage import KeyStorage
from iop_edge.keys import KeyStore
from iop_edge.metrics import KeyCollector
from iop_edge.pg_keys import PgKeyStorage
from iop_edge.settings import Settings
from iop_edge.shared import SharedLimits
from iop_edge.sqlite_keys import SqliteKeyStorage
from iop_edge.usage import UsageRecorder

__all__ = ["Keyring", "edge_name", "open_keyring", "storage_of"]

_log = structlog.get_logger("iop.edge.keys")


def edge_name() -> str:
    """This edge in the store: host, process and a random part (a restarted edge is a new one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def storage_of(settings: Settings) -> KeyStorage:
    """The store the settings name: PostgreSQL with ``store.url``, else the key file."""
    if settings.store.url is not None:
        return PgKeyStorage(settings.store.url)
    return SqliteKeyStorage(settings.keys_path)


class Keyring:
    """The keys' background tasks; :meth:`aclose` stops them, writes the usage left and closes the store."""

    def __init__(self, edge: Edge, keys: KeyStore) -> None:
        self.edge = edge
        self.keys = keys
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, name: str, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work()`` until :meth:`aclose`; a failure is logged and the work restarted a second later."""
        task = asyncio.create_task(_supervised(name, work), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Stop the tasks, give back shared limits, write the usage left (once), close the store."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                if self.edge.limits is not None:
                    await self.edge.limits.aclose()
                if self.edge.usage is not None:
                    await self.edge.usage.flush()
        await self.keys.aclose()


async def _supervised(name: str, work: Callable[[], Awaitable[None]]) -> None:
    while True:
        try:
            await work()
        except Exception:  # noqa: BLE001 - a background loop logs and carries on, whatever broke
            _log.exception("key task failed: restarting it", task=name)
        await asyncio.sleep(1.0)


async def open_keyring(edge: Edge) -> Keyring:
    """Open the store, load the keys, and start the work that keeps them, their limits and usage.

    StartError naming ``keys_path`` or ``store.url`` when the store cannot be used.
    """
    settings = edge.settings
    keys = KeyStore(storage_of(settings), refresh=settings.store.refresh)
    await keys.open()
    edge.keys = keys
    name = edge_name()
    edge.usage = UsageRecorder(keys.storage, name, backlog=settings.store.usage_backlog)
    ring = Keyring(edge, keys)
    edge.metrics.registry.register(KeyCollector(edge))
    ring.start("iop-edge-usage", edge.usage.run)
    if settings.store.url is not None:
        edge.limits = SharedLimits(keys.storage, name)
        await edge.limits.heartbeat()
        ring.start("iop-edge-limits", edge.limits.run)
    return ring
