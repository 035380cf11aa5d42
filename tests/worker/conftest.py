"""Fixtures for the job store suite: each test runs against SQLite and against a real PostgreSQL.

The PostgreSQL server is started once per session (``pg_server``); each test gets a database of
its own. Without initdb and pg_ctl the PostgreSQL half is skipped, naming the Debian package;
in CI (``IOP_BACKENDS_REQUIRED=1``) it fails instead.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from iop_worker.pg_store import PgJobStore
from iop_worker.sqlite_store import SqliteJobStore
from iop_worker.store import JobStore
from worker.pg_server import PgServer, create_database, pg_server, required_binaries

StoreFactory = Callable[[], Awaitable[JobStore]]
_databases = itertools.count()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PgServer]:
    """A PostgreSQL server for the whole session."""
    with pg_server(required_binaries()) as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres"])
async def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreFactory]:
    """Opens store instances on one fresh SQLite file or PostgreSQL database; closes them after the test."""
    if request.param == "sqlite":
        path = tmp_path / "state" / "jobs.sqlite3"

        def build() -> JobStore:
            return SqliteJobStore(path)

    else:
        server: PgServer = request.getfixturevalue("postgres")
        url = server.url(await create_database(server, f"t_{os.getpid()}_{next(_databases)}"))

        def build() -> JobStore:
            return PgJobStore(url, max_connections=4)

    opened: list[JobStore] = []

    async def make() -> JobStore:
        store = build()
        await store.open()
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.aclose()


@pytest.fixture
async def store(make_store: StoreFactory) -> JobStore:
    """One open store on a fresh file or database."""
    return await make_store()
