"""Fixtures for the control-plane's state store tests: one session-wide PostgreSQL server (initdb and
pg_ctl in a temporary folder, as the worker's job store tests use), a fresh database per test.

Without initdb and pg_ctl the PostgreSQL half is skipped, naming the Debian package; in CI
(``IOP_BACKENDS_REQUIRED=1``) it fails instead.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest
from worker.pg_server import PgServer, create_database, pg_server, required_binaries, start_server, stop_server

__all__ = ["fresh_database", "postgres", "start_server", "stop_server"]

_databases = itertools.count()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PgServer]:
    """A PostgreSQL server for the whole session."""
    with pg_server(required_binaries()) as server:
        yield server


async def fresh_database(server: PgServer) -> str:
    """The URL of a new, empty database on ``server``."""
    return server.url(await create_database(server, f"cp_{os.getpid()}_{next(_databases)}"))
