"""What ``iop up`` checks before it starts any process: one ``iop up`` at a time, and every file usable.

A problem found after the control-plane started would mean starting and stopping the others and
exit 1 with a log's tail; found here it is one line naming the file and key, exit 2, nothing
started. The checks are the services' own: each config is read by its service's settings loader
(``load_settings``, which also opens the certificates its ``tls`` section names), the edge's key
file by the edge's key store. Only the files that exist are checked: ``up`` writes the missing
ones itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from iop_cli.output import CliError

__all__ = ["check_files", "choosing_ports", "only_up"]

_LOCK = "up.lock"
_PORTS_WAIT = 60.0
"""How long an ``iop up`` waits for another one (of another folder) to have its services listening."""


@contextlib.contextmanager
def only_up(state: Path, command: str) -> Iterator[None]:
    """Hold ``state``'s lock while ``command`` (``up``, ``down``) changes what runs there; CliError if another does."""
    state.mkdir(parents=True, exist_ok=True)
    with (state / _LOCK).open("a") as lock:
        if not _flock(lock, wait=0.0):
            raise CliError(
                f"another 'iop up' or 'iop down' is at work in {state} (it holds {state / _LOCK}); "
                f"wait for it to finish, then run 'iop {command}' again"
            )
        yield  # the lock goes with the file's closing, also when this process dies


@contextlib.contextmanager
def choosing_ports() -> Iterator[None]:
    """Hold this user's machine-wide lock from choosing free ports until the services listen on them.

    Two ``iop up`` of two folders started at once both found 7400 free, wrote it, and the second
    control-plane to bind exited "7400 is in use". Held, the second waits until the first's
    services listen, then finds 7400 taken and chooses another. Past ``_PORTS_WAIT`` (the other
    hangs) it goes on without the lock, as before.
    """
    path = Path(tempfile.gettempdir()) / f"iop-up-ports-{os.getuid()}.lock"
    try:
        lock = path.open("a")
    except OSError:  # a temporary folder we cannot write: choose without the lock
        yield
        return
    with lock:
        _flock(lock, wait=_PORTS_WAIT)  # taken or not, go on
        yield  # the lock goes with the file's closing, also when this process dies


def _flock(file: IO[str], *, wait: float) -> bool:
    """Take ``file``'s exclusive lock, trying for up to ``wait`` seconds; whether it was taken."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def check_files(state: Path) -> None:
    """CliError naming the first file under ``state`` a service could not start with."""
    for name, loader in _loaders().items():
        config = state / f"{name}.yaml"
        if config.exists():
            settings = _load(config, loader)
            if name == "edge" and getattr(settings, "auth", None) == "keys":
                _check_keys(Path(settings.keys_path))
    _check_api_key(state / "api-key")


def _loaders() -> dict[str, Callable[[Path], Any]]:
    """Each service's settings loader, imported only when ``up`` runs."""
    from iop_control_plane.settings import load_settings as control_plane
    from iop_edge.settings import load_settings as edge
    from iop_node.settings import load_settings as node
    from iop_worker.settings import load_settings as worker

    return {"control-plane": control_plane, "node": node, "worker": worker, "edge": edge}


def _load(config: Path, loader: Callable[[Path], Any]) -> Any:
    from iop_wire.settings import ConfigError

    if not config.is_file():
        raise CliError(f"{config} is not a file: remove it to have it rewritten")
    try:
        return loader(config)
    except ConfigError as exc:
        raise CliError(f"bad config {config}: {exc}") from None
    except UnicodeDecodeError:  # the loader reads text; a binary file is not caught there
        raise CliError(f"bad config {config}: not UTF-8 text (remove it to have it rewritten)") from None


def _check_keys(keys: Path) -> None:
    from iop_edge.key_storage import SchemaTooNew
    from iop_edge.keys import list_keys

    if not keys.exists():
        return
    try:
        list_keys(keys)
    except (sqlite3.Error, OSError, SchemaTooNew) as exc:
        raise CliError(f"cannot use the key file {keys} (keys_path of edge.yaml): {exc}") from None


def _check_api_key(secret: Path) -> None:
    if not secret.exists():
        return
    try:
        value = secret.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read the API key file {secret}: {getattr(exc, 'strerror', None) or exc}") from None
    if not value:
        raise CliError(
            f"{secret} is empty: write the key's secret into it, or remove it and revoke the key 'local' "
            f"('iop keys revoke local --dir {secret.parent}') to have a new one created"
        )
