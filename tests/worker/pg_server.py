"""A throwaway PostgreSQL server for tests: initdb and pg_ctl in a temporary folder, on a loopback port.

PostgreSQL refuses to run as root, so as root the server runs as the ``postgres`` user (Debian's
package creates it), else as ``nobody``, in a folder that user owns.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

PACKAGE = "postgresql"  # the Debian package with initdb and pg_ctl
_USER = "iop"


@dataclass(frozen=True)
class PgServer:
    """A running server: its port, and the URL of a database on it."""

    port: int
    data: Path | None = None
    """The server's data folder (its postmaster.pid names the server's process)."""

    def url(self, database: str = "postgres") -> str:
        """The URL of ``database`` as the trusted superuser."""
        return f"postgresql://{_USER}@127.0.0.1:{self.port}/{database}"


def find_binaries() -> Path | None:
    """The folder holding initdb and pg_ctl (PATH first, then Debian's /usr/lib/postgresql/*/bin), or None."""
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).resolve().parent
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda path: path.parent.parent.name)
    for candidate in reversed(candidates):  # the newest version
        if (candidate.parent / "pg_ctl").exists():
            return candidate.parent
    return None


def required_binaries() -> Path:
    """The binaries' folder; without them the test is skipped, naming the package (failed in CI,
    where ``IOP_BACKENDS_REQUIRED=1``)."""
    binaries = find_binaries()
    if binaries is None:
        reason = f"PostgreSQL's initdb and pg_ctl are not installed (Debian: apt-get install {PACKAGE})"
        if os.environ.get("IOP_BACKENDS_REQUIRED") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return binaries


async def create_database(server: PgServer, name: str) -> str:
    """Create the database ``name`` on ``server``; its name."""
    connection = await asyncpg.connect(server.url())
    try:
        await connection.execute(f"CREATE DATABASE {name}")
    finally:
        await connection.close()
    return name


async def end_sessions(server: PgServer, database: str) -> int:
    """End every session on ``database`` as a restart would (``pg_terminate_backend``); how many.

    The clients' pools still hold them, their end not yet read: a store's next operation meets one.
    """
    connection = await asyncpg.connect(server.url())
    sql = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()"
    try:
        ended: int = await connection.fetchval(sql, database)
    finally:
        await connection.close()
    # Blocking on purpose: the sessions' ends reach the pool's sockets while this loop, and so the
    # pool, cannot read them, as when a restart lands between two requests of a busy store. An
    # awaited pause let the pool see most ends first (100 rounds once met none).
    time.sleep(0.05)  # noqa: ASYNC251
    return ended


@contextlib.contextmanager
def pg_server(binaries: Path) -> Iterator[PgServer]:
    """Start a server in a new temporary folder; stop it and delete the folder on exit."""
    run_as = _server_user()
    folder = Path(tempfile.mkdtemp(prefix="iop-pg-"))
    data = folder / "data"
    try:
        if run_as is not None:
            os.chown(folder, run_as.pw_uid, run_as.pw_gid)
        _run(run_as, binaries / "initdb", "-D", data, "-A", "trust", "-U", _USER, "--no-sync", "-E", "UTF8")
        server = PgServer(_free_port(), data)
        start_server(server, binaries)
        try:
            yield server
        finally:
            stop_server(server, binaries, mode="fast")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def start_server(server: PgServer, binaries: Path) -> None:
    """Start ``server`` (its data folder made by :func:`pg_server`) on its port: at first, and again
    after :func:`stop_server` (tests of an outage)."""
    assert server.data is not None
    folder = server.data.parent
    options = f"-p {server.port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    log = folder / "server.log"
    _run(_server_user(), binaries / "pg_ctl", "-D", server.data, "-l", log, "-o", options, "-w", "-t", "30", "start")


def stop_server(server: PgServer, binaries: Path, *, mode: str = "immediate") -> None:
    """Stop ``server``, keeping its data: ``immediate`` (the default) as a crash would, its clients'
    connections closed at once; ``fast`` for a clean shutdown."""
    assert server.data is not None
    _run(_server_user(), binaries / "pg_ctl", "-D", server.data, "-m", mode, "-w", "stop")


def _server_user() -> pwd.struct_passwd | None:
    """The user to run the server as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root, and neither a 'postgres' nor a 'nobody' user exists to run PostgreSQL")


def _run(user: pwd.struct_passwd | None, *command: str | Path) -> None:
    """Run a PostgreSQL tool (as ``user``); RuntimeError with its output if it fails."""
    done = subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        cwd="/",  # the server user may not be allowed into ours
        user=None if user is None else user.pw_uid,
        group=None if user is None else user.pw_gid,
        extra_groups=None if user is None else [],
    )
    if done.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed ({done.returncode}): {done.stdout}{done.stderr}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
