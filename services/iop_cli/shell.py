"""How the user runs ``iop`` from their own shell: the commands ``iop up`` prints must work as typed."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

__all__ = ["iop_command", "state_file"]


def iop_command(*args: str) -> str:
    """``iop`` with ``args`` as a command line that works in the user's shell, from the current folder.

    ``uv run`` (directly or around ``just``) puts the project's ``.venv/bin`` on PATH for its
    child only, so ``iop`` being on PATH proves nothing there: the user came in through uv, and
    goes back the same way (``python3 -m uv`` unless ``uv`` itself is on their PATH). In a
    virtual environment the user activated, ``iop`` is on their PATH. Otherwise the script is
    named by its path (``.venv/bin/iop`` from the project folder).
    """
    return " ".join([*_prefix(), *(shlex.quote(arg) for arg in args)])


def _prefix() -> list[str]:
    scripts = Path(sysconfig.get_path("scripts"))
    if uv := os.environ.get("UV"):
        own_path = os.pathsep.join(
            entry for entry in os.environ.get("PATH", "").split(os.pathsep) if not _same(entry, scripts)
        )
        return (
            ["uv", "run", "iop"]
            if _same(shutil.which("uv", path=own_path), uv)
            else ["python3", "-m", "uv", "run", "iop"]
        )
    script = scripts / "iop"
    found = shutil.which("iop")
    if found is not None and _same(found, script):
        activated = _same(os.environ.get("VIRTUAL_ENV"), sys.prefix)
        installed = not _same(Path(found).parent, scripts) or sys.prefix == sys.base_prefix
        if activated or installed:  # not just a wrapper's PATH (just's, for one)
            return ["iop"]
    if not script.exists():
        return [shlex.quote(sys.executable), "-m", "iop_cli.main"]
    relative = os.path.relpath(script)
    if relative.startswith(".."):
        return [shlex.quote(str(script))]
    return [shlex.quote(relative if os.sep in relative else f".{os.sep}{relative}")]


def _same(one: str | Path | None, other: str | Path | None) -> bool:
    """Whether both name the same existing file or folder."""
    if not one or not other:
        return False
    try:
        return os.path.samefile(one, other)
    except OSError:
        return False


def state_file(
    args: argparse.Namespace, *, config_name: str, default: str, setting: str, read: Callable[[Path], Path]
) -> tuple[Path, str]:
    """The file a command reads, and where that choice came from (for the message when it is missing).

    ``--db FILE``; else ``setting`` of ``--config`` (``read`` takes it from the config, raising
    its ConfigError); else that of ``DIR/config_name`` when the state folder has one; else
    ``DIR/default``.
    """
    if args.db is not None:
        return Path(args.db), "--db"
    config: Path | None = args.config
    if config is None and (args.dir / config_name).is_file():
        config = args.dir / config_name
    if config is None:
        return args.dir / default, f"state folder {args.dir}"
    return read(config), f"{setting} of {config}"
