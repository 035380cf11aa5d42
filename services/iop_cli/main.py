"""``iop``: the command-line entry point.

    iop certs init DIR [--san NAME ...]   a CA and a certificate per role, files 0600
    iop up [--dir DIR]                    start what exists of the platform (see README)
    iop version

Subcommands import their service lazily, so ``iop certs`` does not load a web server.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

__all__ = ["console", "main"]


def _certs_init(args: argparse.Namespace) -> int:
    from iop_wire.certs import init_dir

    directory: Path = args.dir
    if (directory / "ca.crt").exists() and not args.force:
        print(f"iop certs init: {directory / 'ca.crt'} exists; pass --force to replace it", file=sys.stderr)
        return 2
    for path in init_dir(directory, extra_sans=args.san):
        print(path)
    return 0


def _up(args: argparse.Namespace) -> int:
    from iop_cli.up import up

    return asyncio.run(up(args.dir))


def _version(args: argparse.Namespace) -> int:
    print(version("iop"))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iop", description="IOP, the Inference Operations Platform.")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(dest="command", required=True)

    certs = commands.add_parser("certs", help="mTLS certificates").add_subparsers(dest="certs_command", required=True)
    init = certs.add_parser("init", help="write a CA and a certificate + key per role into DIR")
    init.add_argument("dir", type=Path)
    init.add_argument("--san", action="append", default=[], metavar="NAME", help="extra DNS name or IP (repeatable)")
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    init.set_defaults(run=_certs_init)

    up = commands.add_parser("up", help="start the platform on this machine")
    up.add_argument("--dir", type=Path, default=Path(".iop"), help="state directory (certificates, databases)")
    up.set_defaults(run=_up)

    commands.add_parser("version", help="print the version").set_defaults(run=_version)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``iop`` command; returns the exit code."""
    from iop_cli.logs import configure

    args = _parser().parse_args(argv)
    configure(args.log_level)
    code: int = args.run(args)
    return code


def console() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    console()
