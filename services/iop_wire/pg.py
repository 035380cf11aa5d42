"""Sessions the PostgreSQL server ended, for the services' stores on asyncpg (imported by its full
path, and only by a store that uses PostgreSQL: asyncpg is loaded with it).

A session the server ended (a restart, a failover, ``pg_terminate_backend``) stays in asyncpg's
pool until used, and then fails, at times with ``InternalClientError`` ("cannot switch to state
15; another operation (2) is in progress", asyncpg issues 784 and 1069) rather than a lost
connection. All the pool's sessions went together, so all are replaced and the operation runs once
more, when running it again applies nothing twice:

- :func:`on_fresh_sessions` wraps an operation whose second run changes nothing the first did not
  (a read, an upsert to a value, a delete, a conditional update that finds its work done).
- :func:`commit_once` runs one transaction that must not apply twice (an increment, an insert of a
  new row). Nothing is committed unless COMMIT was sent, and its reply may be what was lost: the
  transaction notes its id first, and after a lost session the server says whether it committed
  (``txid_status``). Committed: its result stands; aborted, or never given an id: it runs again;
  otherwise the error goes up and the caller's own retry decides.

Each time, the store's ``sessions_lost`` counts one and a warning names the operation.
"""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeAlias, TypeVar, cast

import asyncpg

from iop_wire.logs import library_logger

__all__ = ["SESSION_LOST", "Connection", "PgPool", "commit_once", "on_fresh_sessions", "shown_url"]

_log = library_logger("iop.pg")

SESSION_LOST = (
    asyncpg.exceptions.InternalClientError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InterfaceError,
    ConnectionResetError,
)
"""What an operation on a session the server had ended raises."""

Connection: TypeAlias = "asyncpg.pool.PoolConnectionProxy[asyncpg.Record]"  # subscripted for types only
"""A session taken from the pool, as a transaction's work is given it."""

_Result = TypeVar("_Result")
_Operation = TypeVar("_Operation", bound=Callable[..., Awaitable[Any]])


def shown_url(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class PgPool(Protocol):
    """A store on an asyncpg pool."""

    name: str
    """The store, for logs (its URL without password)."""
    sessions_lost: int
    """Operations that met sessions the server had ended."""

    @property
    def pool(self) -> asyncpg.Pool[asyncpg.Record]:
        """The open pool (raises when the store is not open)."""
        ...


async def _renew(store: PgPool, pool: asyncpg.Pool[asyncpg.Record], operation: str, lost: BaseException) -> None:
    store.sessions_lost += 1
    _log.warning(
        "store sessions ended by the server; renewing them",
        store=store.name,
        operation=operation,
        error=repr(lost),
        sessions_lost=store.sessions_lost,
    )
    await pool.expire_connections()


def on_fresh_sessions(operation: _Operation) -> _Operation:
    """Run ``operation`` (a method of a :class:`PgPool`) once more on new sessions if the server had
    ended the pool's; only for operations that running twice applies nothing twice (say why where
    it is used)."""

    @functools.wraps(operation)
    async def again(store: PgPool, *args: Any, **kwargs: Any) -> Any:
        pool = store.pool  # a store not open raises here, not as a lost session
        try:
            return await operation(store, *args, **kwargs)
        except SESSION_LOST as lost:
            await _renew(store, pool, operation.__name__, lost)
        return await operation(store, *args, **kwargs)

    return cast("_Operation", again)


async def commit_once(store: PgPool, operation: str, work: Callable[[Connection], Awaitable[_Result]]) -> _Result:
    """``work`` in one transaction, run once more on new sessions only when the server says the
    first did not commit; what ``work`` returned."""
    pool = store.pool
    done: list[_Result] = []  # work's result, kept in case COMMIT's reply is what goes missing
    transaction_id: int | None = None
    try:
        async with pool.acquire() as conn, conn.transaction():
            transaction_id = await conn.fetchval("SELECT txid_current()")
            done.append(await work(conn))
        return done[0]
    except SESSION_LOST as lost:
        await _renew(store, pool, operation, lost)
        if transaction_id is not None:
            status = await pool.fetchval("SELECT txid_status($1)", transaction_id)
            if status == "committed" and done:
                return done[0]
            if status != "aborted":  # in progress (its session not yet gone) or forgotten: unknown
                raise
    async with pool.acquire() as conn, conn.transaction():
        return await work(conn)
