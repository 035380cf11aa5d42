"""A PostgreSQL server reached through the fault proxy, to lose the reply to a COMMIT the server
carried out: the one outcome a store cannot see, and the one that tempts it to write twice."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
from fault_proxy import FaultProxy
from worker.pg_server import PgServer
from worker.test_store import eventually

__all__ = ["LostReply", "lost_reply"]

_DELAY = 0.2
"""Seconds added to every message once armed: a reply to COMMIT is still on its way when the
server's commit shows to another session."""


@dataclass
class LostReply:
    """``url``: the database through the proxy; ``proxy``: to let connections through again."""

    url: str
    proxy: FaultProxy
    admin: asyncpg.Connection

    def cut_when_committed(self, table: str) -> asyncio.Task[None]:
        """From now every message is delayed; once a row shows in ``table`` (committed) every
        connection is reset, before the reply reaches the store, and each new one too (the database
        unreachable) until ``proxy.pass_()``."""
        self.proxy.delay(_DELAY)

        async def cut() -> None:
            await eventually(lambda: self.admin.fetchval(f"SELECT count(*) FROM {table}"), bool, timeout=20.0)  # noqa: S608
            self.proxy.reset()

        return asyncio.create_task(cut())


@contextlib.asynccontextmanager
async def lost_reply(server: PgServer, url: str) -> AsyncIterator[LostReply]:
    """The database at ``url`` on ``server``, through a proxy that passes everything until armed."""
    admin = await asyncpg.connect(url)
    try:
        async with FaultProxy("127.0.0.1", server.port) as proxy:
            yield LostReply(PgServer(proxy.port).url(url.rsplit("/", 1)[1]), proxy, admin)
    finally:
        await admin.close()
