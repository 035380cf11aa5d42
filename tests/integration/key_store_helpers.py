"""Key stores for tests: a SQLite file or a database of its own on a real PostgreSQL server
(``worker.pg_server``: initdb and pg_ctl in a temporary folder), and that server stopped and
started again in place for outage tests."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path

from worker import pg_server as pg
from worker.pg_server import PgServer, create_database, find_binaries

from iop_edge.key_storage import KeyStorage
from iop_edge.pg_keys import PgKeyStorage
from iop_edge.sqlite_keys import SqliteKeyStorage

_databases = itertools.count()

StorageFactory = Callable[[], KeyStorage]


async def new_database(server: PgServer) -> str:
    """The URL of a new, empty database on ``server``."""
    return server.url(await create_database(server, f"keys_{os.getpid()}_{next(_databases)}"))


def factory(kind: str, where: str | Path) -> StorageFactory:
    """Builds unopened stores on one file (``sqlite``) or database URL (``postgres``)."""
    if kind == "sqlite":
        return lambda: SqliteKeyStorage(Path(where))
    return lambda: PgKeyStorage(str(where), max_connections=4)


def stop_server(server: PgServer) -> None:
    """Stop the server (fast shutdown: clients are disconnected)."""
    binaries = find_binaries()
    assert binaries is not None
    pg.stop_server(server, binaries, mode="fast")


def start_server(server: PgServer) -> None:
    """Start a stopped server again on its port."""
    binaries = find_binaries()
    assert binaries is not None
    pg.start_server(server, binaries)
