"""Fixtures for the control-plane's state store tests: one session-wide PostgreSQL server (initdb and
pg_ctl in a temporary folder, as the worker's job store tests use), a fresh database per test.

Without initdb and pg_ctl the PostgreSQL half is skipped, naming the Debian package; in CI
(``IOP_BACKENDS_REQUIRED=1``) it fails instead.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from worker.pg_server import PgServer, _run, _server_user, create_database, pg_server, required_binaries

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


def stop_server(server: PgServer, binaries: Path) -> None:
    """Stop ``server`` at once (clients see their connections closed), keeping its data."""
    assert server.data is not None
    _run(_server_user(), binaries / "pg_ctl", "-D", server.data, "-m", "immediate", "-w", "stop")


def start_server(server: PgServer, binaries: Path) -> None:
    """Start ``server`` again on its port (as :func:`worker.pg_server.pg_server` did)."""
    assert server.data is not None
    folder = server.data.parent
    options = f"-p {server.port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    log = folder / "server.log"
    _run(_server_user(), binaries / "pg_ctl", "-D", server.data, "-l", log, "-o", options, "-w", "-t", "30", "start")
