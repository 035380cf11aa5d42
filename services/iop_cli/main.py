"""``iop``: the command-line entry point.

    iop certs init DIR [--san NAME ...]   a CA and a certificate per role, files 0600
    iop up [--dir DIR] [--port N]         start the platform in the background; iop down stops it
    iop node --config node.yaml [--ready-file PATH]   run a node (iop node --dev: without a config)
    iop control-plane --config cp.yaml [--ready-file PATH]   run a control-plane
    iop runs ls [--status S] [--model M] [--since 1h] [--limit N] [--json]   the node's run history
    iop runs show RUN_ID [--json]
    iop runs ls|show ... --control-plane [HOST:PORT]   the control-plane's run ledger (admin cert)
    iop nodes ls [--json] | drain NODE [--reason R] | undrain NODE   operate a control-plane (admin cert)
    iop policy show | apply FILE          the control-plane's policy in force; replace it
    iop version, iop --version

``--log-level`` goes before or after the command; for ``iop node`` (and the node ``iop up``
starts) it overrides the config's ``log_level``. Subcommands import their service lazily, so
``iop certs`` does not load a web server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

__all__ = ["console", "main"]

_LEVELS = ("debug", "info", "warning", "error")


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

    return up(args.dir, args.port, log_level=args.log_level)


def _down(args: argparse.Namespace) -> int:
    from iop_cli.up import down

    return down(args.dir)


def _node(args: argparse.Namespace) -> int:
    from iop_node.main import run

    return run(args.config, dev=args.dev, ready_file=args.ready_file, log_level=args.log_level)


def _control_plane(args: argparse.Namespace) -> int:
    from iop_control_plane.main import run

    return run(args.config, ready_file=args.ready_file, log_level=args.log_level)


def _runs_ls(args: argparse.Namespace) -> int:
    if args.control_plane is not None:
        from iop_cli.ops import runs_ls as ledger_ls

        return asyncio.run(ledger_ls(args))
    from iop_cli.runs import ls

    return asyncio.run(ls(args))


def _runs_show(args: argparse.Namespace) -> int:
    if args.control_plane is not None:
        from iop_cli.ops import runs_show as ledger_show

        return asyncio.run(ledger_show(args))
    from iop_cli.runs import show

    return asyncio.run(show(args))


def _ops(args: argparse.Namespace) -> int:
    from iop_cli import ops

    action = getattr(ops, args.ops_action)
    code: int = asyncio.run(action(args))
    return code


def _version(args: argparse.Namespace) -> int:
    print(f"iop {version('iop')}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iop", description="IOP, the Inference Operations Platform.")
    parser.add_argument("--version", action="version", version=f"iop {version('iop')}")
    parser.add_argument(
        "--log-level", choices=_LEVELS, help="lowest level logged (default warning; node, control-plane: config's)"
    )
    # The same option after the command: `iop node --config x --log-level debug`.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", choices=_LEVELS, default=argparse.SUPPRESS, help="as before the command")
    state_dir = Path(os.environ.get("IOP_STATE_DIR", ".iop"))
    state_help = "state folder of 'iop up' (default: $IOP_STATE_DIR, else .iop)"
    commands = parser.add_subparsers(dest="command", required=True)

    certs = commands.add_parser("certs", help="mTLS certificates").add_subparsers(dest="certs_command", required=True)
    init = certs.add_parser("init", parents=[common], help="write a CA and a certificate + key per role into DIR")
    init.add_argument("dir", type=Path)
    init.add_argument("--san", action="append", default=[], metavar="NAME", help="extra DNS name or IP (repeatable)")
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    init.set_defaults(run=_certs_init)

    up = commands.add_parser("up", parents=[common], help="start the platform on this machine, in the background")
    up.add_argument("--dir", type=Path, default=state_dir, help=state_help)
    up.add_argument("--port", type=int, help="node port, set in DIR/node.yaml (new: 7401 unless given; 0: any free)")
    up.set_defaults(run=_up)
    down = commands.add_parser("down", parents=[common], help="stop what 'iop up' started")
    down.add_argument("--dir", type=Path, default=state_dir, help=state_help)
    down.set_defaults(run=_down)

    node = commands.add_parser("node", parents=[common], help="run a node")
    config = node.add_mutually_exclusive_group()
    config.add_argument("--config", type=Path, help="YAML settings (IOP_ environment variables override)")
    config.add_argument("--dev", action="store_true", help="no config file: TLS off, a mock model; not for production")
    node.add_argument(
        "--ready-file", type=Path, metavar="PATH", help="written (pid, ports as JSON) once the node serves"
    )
    node.set_defaults(run=_node)

    control_plane = commands.add_parser("control-plane", parents=[common], help="run a control-plane")
    control_plane.add_argument("--config", type=Path, required=True, help="YAML settings (IOP_ variables override)")
    control_plane.add_argument(
        "--ready-file", type=Path, metavar="PATH", help="written (pid, port as JSON) once it serves"
    )
    control_plane.set_defaults(run=_control_plane)

    _runs_parsers(commands, common, state_dir, state_help)
    _ops_parsers(commands, common, state_dir)

    commands.add_parser("version", help="print the version").set_defaults(run=_version)
    return parser


def _runs_parsers(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
    state_dir: Path,
    state_help: str,
) -> None:
    """``iop runs ls|show``: a node's run history, or with ``--control-plane`` the control-plane's ledger."""
    runs = commands.add_parser("runs", help="the run history").add_subparsers(dest="runs_command", required=True)
    for name, helptext in (("ls", "list runs, newest first"), ("show", "every field of one run")):
        sub = runs.add_parser(name, parents=[common], help=helptext)
        sub.add_argument("--db", type=Path, help="history file (default: store_path of the config)")
        sub.add_argument("--config", type=Path, help="node settings to take store_path from")
        sub.add_argument("--dir", type=Path, default=state_dir, help=f"{state_help}: its node.yaml's store_path")
        sub.add_argument("--json", action="store_true", help="print JSON instead of text")
        sub.add_argument(
            "--control-plane",
            nargs="?",
            const=os.environ.get("IOP_CONTROL_PLANE", "127.0.0.1:7400"),
            metavar="HOST:PORT",
            help="read the control-plane's run ledger instead, over IOP with the admin certificate "
            "(default address: $IOP_CONTROL_PLANE, else 127.0.0.1:7400)",
        )
        sub.add_argument("--certs", type=Path, metavar="DIR", help="with --control-plane: admin.crt, admin.key, ca.crt")
        sub.add_argument("--server-name", default="localhost", metavar="NAME", help="with --control-plane: its name")
    ls, show = runs.choices["ls"], runs.choices["show"]
    ls.add_argument(
        "--status", help="running, completed, failed, cancelled or interrupted (ledger: completed, failed, cancelled)"
    )
    ls.add_argument("--model")
    ls.add_argument("--node", help="with --control-plane: only runs tried on this node")
    ls.add_argument("--since", help="ISO time, or a duration back from now: 30s, 10m, 2h, 7d")
    ls.add_argument("--limit", type=int, default=50, help="at most this many runs, newest first (default 50)")
    ls.set_defaults(run=_runs_ls)
    show.add_argument("run_id")
    show.set_defaults(run=_runs_show)


def _ops_parsers(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser, state_dir: Path
) -> None:
    """``iop nodes ...`` and ``iop policy ...``: admin requests to a control-plane."""
    admin = argparse.ArgumentParser(add_help=False, parents=[common])
    admin.add_argument(
        "--control-plane",
        default=os.environ.get("IOP_CONTROL_PLANE", "127.0.0.1:7400"),
        metavar="HOST:PORT",
        help="the control-plane (default: $IOP_CONTROL_PLANE, else 127.0.0.1:7400)",
    )
    admin.add_argument("--dir", type=Path, default=state_dir, help="state folder (default: $IOP_STATE_DIR, else .iop)")
    admin.add_argument("--certs", type=Path, metavar="DIR", help="admin.crt, admin.key, ca.crt (default: STATE/certs)")
    admin.add_argument(
        "--server-name", default="localhost", metavar="NAME", help="its certificate name (default localhost)"
    )

    nodes = commands.add_parser("nodes", help="a control-plane's nodes (admin certificate)")
    nodes_commands = nodes.add_subparsers(dest="nodes_command", required=True)
    ls = nodes_commands.add_parser("ls", parents=[admin], help="every registered node, its state and load")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(run=_ops, ops_action="nodes_ls")
    drain = nodes_commands.add_parser("drain", parents=[admin], help="no new runs to NODE; in-flight ones finish")
    undrain = nodes_commands.add_parser("undrain", parents=[admin], help="runs go to NODE again")
    for sub, action in ((drain, "nodes_drain"), (undrain, "nodes_undrain")):
        sub.add_argument("node", metavar="NODE")
        sub.add_argument("--reason", help="recorded as the reason of the state change")
        sub.set_defaults(run=_ops, ops_action=action)

    policy = commands.add_parser("policy", help="a control-plane's policy (admin certificate)")
    policy_commands = policy.add_subparsers(dest="policy_command", required=True)
    show = policy_commands.add_parser("show", parents=[admin], help="print the policy in force")
    show.set_defaults(run=_ops, ops_action="policy_show")
    apply = policy_commands.add_parser("apply", parents=[admin], help="validate FILE and put it in force")
    apply.add_argument("file", type=Path, metavar="FILE")
    apply.set_defaults(run=_ops, ops_action="policy_apply")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``iop`` command; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command not in ("node", "control-plane"):  # these configure logging from their settings
        from iop_wire.logs import configure

        configure(args.log_level or "warning")
    code: int = args.run(args)
    return code


def console() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    console()
