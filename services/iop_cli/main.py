"""``iop``: the command-line entry point.

    iop certs init DIR [--san NAME ...]   a CA and a certificate per role, files 0600
    iop up [--dir DIR] [--port N]         start the platform in the background; iop down stops it
    iop node --config node.yaml           run a node
    iop runs ls [--status S] [--model M] [--since 1h]   the run history
    iop runs show RUN_ID
    iop version

Subcommands import their service lazily, so ``iop certs`` does not load a web server.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

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

    return up(args.dir, args.port)


def _down(args: argparse.Namespace) -> int:
    from iop_cli.up import down

    return down(args.dir)


def _node(args: argparse.Namespace) -> int:
    from iop_node.main import run

    return run(args.config)


def _history_db(args: argparse.Namespace) -> Path:
    if args.db is not None:
        return Path(args.db)
    from iop_node.settings import load_settings

    return load_settings(args.config).store_path


def _runs_ls(args: argparse.Namespace) -> int:
    from iop_node.history import list_runs

    return _print_history(
        lambda db: list_runs(db, status=args.status, model=args.model, since=args.since, limit=args.limit), args
    )


def _runs_show(args: argparse.Namespace) -> int:
    from iop_node.history import show_run

    return _print_history(lambda db: show_run(db, args.run_id), args, missing=f"no run {args.run_id!r}")


def _print_history(
    query: Callable[[Path], Coroutine[Any, Any, str | None]], args: argparse.Namespace, missing: str = ""
) -> int:
    from iop_node.settings import ConfigError

    try:
        text = asyncio.run(query(_history_db(args)))
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"iop runs: {exc}", file=sys.stderr)
        return 2
    if text is None:
        print(f"iop runs: {missing}", file=sys.stderr)
        return 1
    print(text)
    return 0


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

    up = commands.add_parser("up", help="start the platform on this machine, in the background")
    up.add_argument("--dir", type=Path, default=Path(".iop"), help="state directory (certificates, config, history)")
    up.add_argument("--port", type=int, default=7401, help="node port written to a new DIR/node.yaml (0: any free)")
    up.set_defaults(run=_up)
    down = commands.add_parser("down", help="stop what 'iop up' started")
    down.add_argument("--dir", type=Path, default=Path(".iop"), help="state directory")
    down.set_defaults(run=_down)

    node = commands.add_parser("node", help="run a node")
    node.add_argument("--config", type=Path, help="YAML settings (IOP_ environment variables override)")
    node.set_defaults(run=_node)

    runs = commands.add_parser("runs", help="the run history").add_subparsers(dest="runs_command", required=True)
    for name, helptext in (("ls", "list runs, newest first"), ("show", "every field of one run")):
        sub = runs.add_parser(name, help=helptext)
        sub.add_argument("--db", type=Path, help="history file (default: the config's store_path)")
        sub.add_argument("--config", type=Path, help="node settings to take store_path from")
    ls, show = runs.choices["ls"], runs.choices["show"]
    ls.add_argument("--status", help="running, completed, failed, cancelled or interrupted")
    ls.add_argument("--model")
    ls.add_argument("--since", help="ISO time, or a duration back from now: 30s, 10m, 2h, 7d")
    ls.add_argument("--limit", type=int, default=50)
    ls.set_defaults(run=_runs_ls)
    show.add_argument("run_id")
    show.set_defaults(run=_runs_show)

    commands.add_parser("version", help="print the version").set_defaults(run=_version)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``iop`` command; returns the exit code."""
    from iop_wire.logs import configure

    args = _parser().parse_args(argv)
    configure(args.log_level)
    code: int = args.run(args)
    return code


def console() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    console()
