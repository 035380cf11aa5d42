"""``iop``: the command-line entry point.

    iop certs init DIR [--san NAME ...]   a CA and a certificate per role, files 0600
    iop up [--dir DIR] [--port N] [--listen ADDRESS ...] [--foreground] [--backend URL | --model PATH.gguf ...]
                                          the whole platform
    iop status                            what iop up started: processes, addresses, health
    iop edge --config edge.yaml           run an edge (the OpenAI-compatible API)
    iop worker --config worker.yaml       run a worker (files and batch jobs)
    iop keys create NAME [--rpm N] [--tpm N] [--max-concurrent N] [--admin] | ls | revoke NAME   the edge's API keys
    iop chat [--model M] [PROMPT]         talk to a model through the local edge; iop models lists them
    iop node --config node.yaml [--ready-file PATH]   run a node (iop node --dev: without a config)
    iop control-plane --config cp.yaml [--ready-file PATH]   run a control-plane
    iop runs ls [--status S] [--model M] [--since 1h] [--limit N] [--json]   the node's run history
    iop runs show RUN_ID [--json]
    iop runs ls|show ... --control-plane [HOST:PORT]   the control-plane's run ledger (admin cert)
    iop nodes ls [--json] | drain NODE [--reason R] | undrain NODE | remove NODE   operate a control-plane
    iop nodes reload NODE                 the node reads its config file's routes again (as on SIGHUP)
    iop join-token create [--ttl 1h] [--uses N] [--name-prefix P] | ls [--json] | revoke ID   tokens to join with
    iop join ADDRESS --token T --ca sha256:H [--name NAME] [--backend URL | --mock | --model PATH.gguf ...]
             [--dir DIR] [--foreground]
    iop policy show | apply FILE          the control-plane's policy in force; replace it
    iop usage [--key K] [--model M] [--since 7d] [--by hour|day] [--json]   tokens per key and model (admin cert)
    iop batches ls [--limit N] [--json] | show ID [--json] | cancel ID   a worker's batches (admin cert)
    iop version, iop --version

``--log-level`` goes before or after the command; for ``iop node``, ``iop control-plane``,
``iop edge`` (and the services ``iop up`` starts) it overrides the config's ``log_level``.
Subcommands import their service lazily, so ``iop certs`` does not load a web server.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iop_cli.output import CliError

__all__ = ["console", "main"]

_LEVELS = ("debug", "info", "warning", "error")
_ONE_REQUEST = ("nodes", "policy", "join-token", "batches")
"""Commands that send one request and exit: run as such (iop_cli.oneshot)."""


def _certs_init(args: argparse.Namespace) -> int:
    from iop_wire.certs import init_dir

    directory: Path = args.dir
    if (directory / "ca.crt").exists() and not args.force:
        raise CliError(f"{directory / 'ca.crt'} exists; pass --force to replace it")
    for path in init_dir(directory, extra_sans=args.san):
        print(path)
    return 0


def _up(args: argparse.Namespace) -> int:
    from iop_cli.up import up

    return up(
        args.dir,
        args.port,
        log_level=args.log_level,
        foreground=args.foreground,
        backend=args.backend,
        listen=args.listen,
        models=args.model,
        python=args.llama_python,
    )


def _down(args: argparse.Namespace) -> int:
    from iop_cli.up import down

    return down(args.dir)


def _supervise(args: argparse.Namespace) -> int:
    from iop_cli.supervisor import supervise

    return supervise(args.dir, args.log_level)


def _status(args: argparse.Namespace) -> int:
    from iop_cli.status import status

    return status(args.dir, as_json=args.json)


def _edge(args: argparse.Namespace) -> int:
    from iop_edge.main import run

    return run(args.config, ready_file=args.ready_file, log_level=args.log_level)


def _worker(args: argparse.Namespace) -> int:
    from iop_worker.main import run

    return run(args.config, ready_file=args.ready_file, log_level=args.log_level)


def _keys(args: argparse.Namespace) -> int:
    from iop_cli import keys

    action: int = getattr(keys, args.keys_action)(args)
    return action


def _chat(args: argparse.Namespace) -> int:
    from iop_cli.chat import chat

    return chat(args)


def _models(args: argparse.Namespace) -> int:
    from iop_cli.chat import models

    return models(args)


def _node(args: argparse.Namespace) -> int:
    from iop_node.main import run

    return run(args.config, dev=args.dev, ready_file=args.ready_file, log_level=args.log_level)


def _control_plane(args: argparse.Namespace) -> int:
    from iop_control_plane.main import run

    return run(args.config, ready_file=args.ready_file, log_level=args.log_level)


def _runs_ls(args: argparse.Namespace) -> int:
    if args.control_plane is not None:
        from iop_cli.ops import runs_ls as ledger_ls

        return ledger_ls(args)
    import asyncio

    from iop_cli.runs import ls

    return asyncio.run(ls(args))


def _runs_show(args: argparse.Namespace) -> int:
    if args.control_plane is not None:
        from iop_cli.ops import runs_show as ledger_show

        return ledger_show(args)
    import asyncio

    from iop_cli.runs import show

    return asyncio.run(show(args))


def _ops(args: argparse.Namespace) -> int:
    _defer_unused_protobuf()
    from iop_cli import ops

    action = getattr(ops, args.ops_action)
    code: int = action(args)
    return code


def _usage(args: argparse.Namespace) -> int:
    _defer_unused_protobuf()
    from iop_cli.usage import usage

    return usage(args)


def _batches(args: argparse.Namespace) -> int:
    _defer_unused_protobuf()
    from iop_cli import batches

    action = getattr(batches, args.batches_action)
    code: int = action(args)
    return code


def _tokens(args: argparse.Namespace) -> int:
    _defer_unused_protobuf()
    from iop_cli import tokens

    action = getattr(tokens, args.tokens_action)
    code: int = action(args)
    return code


def _defer_unused_protobuf() -> None:
    """Before an admin request's first protobuf import: its pure-Python half stays unloaded (iop_cli.oneshot)."""
    from iop_cli.oneshot import defer_pure_python_protobuf

    defer_pure_python_protobuf()


def _join(args: argparse.Namespace) -> int:
    from iop_cli.join import join

    return join(args)


def _version(args: argparse.Namespace) -> int:
    print(_version_line())
    return 0


def _version_line() -> str:
    from importlib.metadata import version  # here: looking it up reads the installed files, for --version alone

    return f"iop {version('iop')}"


class _VersionAction(argparse.Action):
    """``--version``: argparse's own action takes the text when the parser is made, at every command's start."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(_version_line())
        parser.exit()


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command tree; for an admin ``command``, that command's parsers alone."""
    parser = argparse.ArgumentParser(prog="iop", description="IOP, the Inference Operations Platform.")
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    parser.add_argument(
        "--log-level", choices=_LEVELS, help="lowest level logged (default warning; the services: their config's)"
    )
    # The same option after the command: `iop node --config x --log-level debug`.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", choices=_LEVELS, default=argparse.SUPPRESS, help="as before the command")
    state_dir = Path(os.environ.get("IOP_STATE_DIR", ".iop"))
    state_help = "state folder of 'iop up' (default: $IOP_STATE_DIR, else .iop)"
    commands = parser.add_subparsers(dest="command", required=True)
    parser.set_defaults(logs=True)  # whether main() configures logging; the admin requests' parsers say False
    # `iop nodes ls` and its kin run often, a new process each time: building every other command's
    # parser took a tenth of its start (argparse looks up a translation for each help text).
    if command in ("nodes", "policy", "join-token"):
        _ops_parsers(commands, common, state_dir)
        return parser
    if command == "batches":
        _batches_parsers(commands, common, state_dir)
        return parser

    certs = commands.add_parser("certs", help="mTLS certificates").add_subparsers(dest="certs_command", required=True)
    init = certs.add_parser("init", parents=[common], help="write a CA and a certificate + key per role into DIR")
    init.add_argument("dir", type=Path)
    init.add_argument("--san", action="append", default=[], metavar="NAME", help="extra DNS name or IP (repeatable)")
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    init.set_defaults(run=_certs_init)

    _platform_parsers(commands, common, state_dir, state_help)

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

    edge = commands.add_parser("edge", parents=[common], help="run an edge: the OpenAI-compatible HTTP API")
    edge.add_argument("--config", type=Path, required=True, help="YAML settings (IOP_ variables override)")
    edge.add_argument("--ready-file", type=Path, metavar="PATH", help="written (pid, port as JSON) once it serves")
    edge.set_defaults(run=_edge)

    worker = commands.add_parser("worker", parents=[common], help="run a worker: files and batch jobs")
    worker.add_argument("--config", type=Path, required=True, help="YAML settings (IOP_ variables override)")
    worker.add_argument("--ready-file", type=Path, metavar="PATH", help="written (pid, port as JSON) once it serves")
    worker.set_defaults(run=_worker)

    _keys_parsers(commands, common, state_dir, state_help)
    _runs_parsers(commands, common, state_dir, state_help)
    _ops_parsers(commands, common, state_dir)
    _batches_parsers(commands, common, state_dir)
    _join_parser(commands, common, state_dir, state_help)

    commands.add_parser("version", help="print the version").set_defaults(run=_version)
    return parser


def _platform_parsers(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
    state_dir: Path,
    state_help: str,
) -> None:
    """``iop up``, ``down``, ``status``, ``chat``, ``models``: the platform on this machine."""
    up = commands.add_parser("up", parents=[common], help="start the platform on this machine, in the background")
    up.add_argument("--dir", type=Path, default=state_dir, help=state_help)
    up.add_argument(
        "--port", type=int, help="the edge's HTTP port, set in DIR/edge.yaml (new: 8000 unless given; 0: any free)"
    )
    up.add_argument("--foreground", action="store_true", help="stay attached: one log stream; Ctrl-C stops it all")
    routes = up.add_mutually_exclusive_group()
    routes.add_argument(
        "--backend",
        metavar="URL",
        help="serve an OpenAI-compatible server's models (URL) or Ollama's (ollama:URL) instead of mock models",
    )
    _model_options(up, routes)
    up.add_argument(
        "--listen",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="also listen on this IP or host name of this machine, for other machines (repeatable; "
        "named in every certificate)",
    )
    up.set_defaults(run=_up)
    # Started by `iop up` (in the background) to keep the services running; not for users.
    supervise = commands.add_parser("supervise", parents=[common], help=argparse.SUPPRESS)
    supervise.add_argument("--dir", type=Path, default=state_dir, help=state_help)
    supervise.set_defaults(run=_supervise)
    down = commands.add_parser("down", parents=[common], help="stop what 'iop up' started")
    down.add_argument("--dir", type=Path, default=state_dir, help=state_help)
    down.set_defaults(run=_down)
    status = commands.add_parser("status", parents=[common], help="what 'iop up' started: processes, addresses, health")
    status.add_argument("--dir", type=Path, default=state_dir, help=state_help)
    status.add_argument("--json", action="store_true", help="print JSON instead of text")
    status.set_defaults(run=_status)
    for name, helptext, run in (
        ("chat", "talk to a model of the local platform (stdin when no PROMPT; Ctrl-D ends)", _chat),
        ("models", "the models the local platform serves", _models),
    ):
        sub = commands.add_parser(name, parents=[common], help=helptext)
        sub.add_argument("--dir", type=Path, default=state_dir, help=f"{state_help}: its base URL and API key")
        sub.add_argument("--base-url", help="the edge's base URL (default: the state folder's)")
        sub.add_argument("--api-key", help="an API key (default: $IOP_API_KEY, else the state folder's)")
        sub.set_defaults(run=run)
    chat = commands.choices["chat"]
    chat.add_argument("--model", "-m", help="the model (default: the first one the platform lists)")
    chat.add_argument("prompt", nargs="*", help="the prompt; none: read stdin, or talk until Ctrl-D on a terminal")
    commands.choices["models"].add_argument("--json", action="store_true", help="print JSON instead of names")


def _keys_parsers(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
    state_dir: Path,
    state_help: str,
) -> None:
    """``iop keys create|ls|revoke``: the edge's API keys."""
    keys = commands.add_parser("keys", help="the edge's API keys").add_subparsers(dest="keys_command", required=True)
    for name, helptext in (
        ("create", "create a key and print it (once: only its hash is kept)"),
        ("ls", "list keys, their limits and whether they are revoked"),
        ("revoke", "revoke a key: its requests get 401 from then on"),
    ):
        sub = keys.add_parser(name, parents=[common], help=helptext)
        sub.add_argument("--db", type=Path, help="the key file (default: keys_path of the config)")
        sub.add_argument("--store-url", help="the edges' shared PostgreSQL store (default: store.url of the config)")
        sub.add_argument("--config", type=Path, help="edge settings to take keys_path from")
        sub.add_argument("--dir", type=Path, default=state_dir, help=f"{state_help}: its edge.yaml's keys_path")
        sub.set_defaults(run=_keys, keys_action=name)
    create, revoke = keys.choices["create"], keys.choices["revoke"]
    create.add_argument("name", metavar="NAME", help="who the key is for; runs are attributed to it")
    create.add_argument("--rpm", type=int, help="requests per minute")
    create.add_argument("--tpm", type=int, help="tokens (prompt + completion) per minute")
    create.add_argument("--max-concurrent", type=int, help="requests in progress at once")
    admin_help = "an admin key: the console's platform pages and actions, every caller's records"
    create.add_argument("--admin", action="store_true", help=admin_help)
    revoke.add_argument("name", metavar="NAME")
    keys.choices["ls"].add_argument("--json", action="store_true", help="print JSON instead of a table")


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
            const="",
            metavar="HOST:PORT",
            help="read the control-plane's run ledger instead, over IOP with the admin certificate "
            "(default address: $IOP_CONTROL_PLANE, else the one iop up started in --dir, else 127.0.0.1:7400)",
        )
        sub.add_argument("--certs", type=Path, metavar="DIR", help="with --control-plane: admin.crt, admin.key, ca.crt")
        sub.add_argument("--server-name", default="localhost", metavar="NAME", help="with --control-plane: its name")
    ls, show = runs.choices["ls"], runs.choices["show"]
    ls.add_argument(
        "--status", help="running, completed, failed, cancelled or interrupted (the ledger has all but running)"
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
        default="",
        metavar="HOST:PORT",
        help="the control-plane (default: $IOP_CONTROL_PLANE, else the one iop up started in --dir, "
        "else 127.0.0.1:7400)",
    )
    admin.add_argument("--dir", type=Path, default=state_dir, help="state folder (default: $IOP_STATE_DIR, else .iop)")
    admin.add_argument("--certs", type=Path, metavar="DIR", help="admin.crt, admin.key, ca.crt (default: STATE/certs)")
    admin.add_argument(
        "--server-name", default="localhost", metavar="NAME", help="its certificate name (default localhost)"
    )
    admin.set_defaults(logs=False)

    nodes = commands.add_parser("nodes", help="a control-plane's nodes (admin certificate)")
    nodes_commands = nodes.add_subparsers(dest="nodes_command", required=True)
    ls = nodes_commands.add_parser("ls", parents=[admin], help="every registered node, its state and load")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(run=_ops, ops_action="nodes_ls")
    drain = nodes_commands.add_parser("drain", parents=[admin], help="no new runs to NODE; in-flight ones finish")
    undrain = nodes_commands.add_parser("undrain", parents=[admin], help="runs go to NODE again")
    remove = nodes_commands.add_parser(
        "remove", parents=[admin], help="revoke NODE's certificates and forget it: it returns only by joining again"
    )
    for sub, action in ((drain, "nodes_drain"), (undrain, "nodes_undrain"), (remove, "nodes_remove")):
        sub.add_argument("node", metavar="NODE")
        sub.add_argument("--reason", help="recorded as the reason of the state change")
        sub.set_defaults(run=_ops, ops_action=action)
    reload = nodes_commands.add_parser(
        "reload", parents=[admin], help="NODE reads its config file's routes again (as on SIGHUP): prints what changed"
    )
    reload.add_argument("node", metavar="NODE")
    reload.set_defaults(run=_ops, ops_action="nodes_reload")

    tokens = commands.add_parser("join-token", help="tokens other machines join with (admin certificate)")
    tokens_commands = tokens.add_subparsers(dest="tokens_command", required=True)
    create = tokens_commands.add_parser(
        "create", parents=[admin], help="a new token: prints the 'iop join' line to run on the new machine"
    )
    create.add_argument("--ttl", default="1h", help="how long it is valid: 30m, 1h, 7d (default 1h)")
    create.add_argument("--uses", type=int, default=1, help="how many machines may join with it (default 1)")
    create.add_argument("--name-prefix", metavar="P", help="names joining with it must start with P")
    create.set_defaults(run=_tokens, tokens_action="join_token_create")
    token_ls = tokens_commands.add_parser("ls", parents=[admin], help="every token: expiry, uses, state (no secrets)")
    token_ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    token_ls.set_defaults(run=_tokens, tokens_action="join_token_ls")
    revoke = tokens_commands.add_parser("revoke", parents=[admin], help="no machine may join with the token any more")
    revoke.add_argument("id", metavar="ID", help="the token's id (the part after iopjt- and before the dot)")
    revoke.set_defaults(run=_tokens, tokens_action="join_token_revoke")

    policy = commands.add_parser("policy", help="a control-plane's policy (admin certificate)")
    policy_commands = policy.add_subparsers(dest="policy_command", required=True)
    show = policy_commands.add_parser("show", parents=[admin], help="print the policy in force")
    show.set_defaults(run=_ops, ops_action="policy_show")
    apply = policy_commands.add_parser("apply", parents=[admin], help="validate FILE and put it in force")
    apply.add_argument("file", type=Path, metavar="FILE")
    apply.set_defaults(run=_ops, ops_action="policy_apply")

    usage = commands.add_parser(
        "usage", parents=[admin], help="tokens used per API key and model, per hour or day (admin certificate)"
    )
    usage.add_argument("--key", metavar="K", help="only this API key's runs (the caller's name)")
    usage.add_argument("--model", metavar="M", help="only runs of this model, as requested")
    usage.add_argument(
        "--since", help="ISO time, or a duration back from now: 12h, 7d (default 24h by hour, 7d by day)"
    )
    usage.add_argument("--by", choices=("hour", "day"), default="hour", help="the bucket (default hour)")
    usage.add_argument("--json", action="store_true", help="print JSON instead of a table")
    usage.set_defaults(run=_usage)


def _batches_parsers(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser, state_dir: Path
) -> None:
    """``iop batches ls|show|cancel``: admin requests to a worker."""
    admin = argparse.ArgumentParser(add_help=False, parents=[common])
    admin.add_argument(
        "--worker",
        default=os.environ.get("IOP_WORKER"),
        metavar="HOST:PORT",
        help="the worker (default: $IOP_WORKER, else the one 'iop up' started in --dir, else 127.0.0.1:7402)",
    )
    admin.add_argument("--dir", type=Path, default=state_dir, help="state folder (default: $IOP_STATE_DIR, else .iop)")
    admin.add_argument("--certs", type=Path, metavar="DIR", help="admin.crt, admin.key, ca.crt (default: STATE/certs)")
    admin.add_argument(
        "--server-name", default="localhost", metavar="NAME", help="its certificate name (default localhost)"
    )
    admin.set_defaults(logs=False)
    batches = commands.add_parser("batches", help="a worker's batch jobs (admin certificate)")
    batches_commands = batches.add_subparsers(dest="batches_command", required=True)
    ls = batches_commands.add_parser("ls", parents=[admin], help="the newest batches, their status and progress")
    ls.add_argument("--limit", type=int, default=20, help="at most this many, newest first (default 20, at most 100)")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(run=_batches, batches_action="batches_ls")
    show = batches_commands.add_parser("show", parents=[admin], help="one batch: status, counts, progress")
    show.add_argument("batch_id", metavar="ID")
    show.add_argument("--json", action="store_true", help="print JSON instead of text")
    show.set_defaults(run=_batches, batches_action="batches_show")
    cancel = batches_commands.add_parser("cancel", parents=[admin], help="stop a batch; lines done so far are kept")
    cancel.add_argument("batch_id", metavar="ID")
    cancel.set_defaults(run=_batches, batches_action="batches_cancel")


def _join_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
    state_dir: Path,
    state_help: str,
) -> None:
    """``iop join``: this machine becomes a node of a control-plane elsewhere."""
    join = commands.add_parser(
        "join", parents=[common], help="make this machine a node of the control-plane at ADDRESS, and start it"
    )
    join.add_argument(
        "address", metavar="ADDRESS", help="the control-plane's HOST:PORT, as 'iop join-token create' printed"
    )
    join.add_argument("--token", required=True, help="the join token (iopjt-...)")
    join.add_argument("--ca", required=True, metavar="sha256:HASH", help="the control-plane's CA hash, checked first")
    join.add_argument("--name", help="the node's name (default: this machine's host name)")
    backend = join.add_mutually_exclusive_group()
    backend.add_argument(
        "--backend",
        metavar="URL",
        help="serve an OpenAI-compatible server's models (URL) or Ollama's (ollama:URL)",
    )
    backend.add_argument("--mock", action="store_true", help="serve the mock models (the default)")
    _model_options(join, backend)
    join.add_argument("--dir", type=Path, default=state_dir, help=state_help)
    join.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the node")
    join.set_defaults(run=_join)


def _model_options(command: argparse.ArgumentParser, routes: argparse._MutuallyExclusiveGroup) -> None:
    """``--model PATH.gguf[=NAME]`` and ``--llama-python PY`` of ``iop up`` and ``iop join``."""
    routes.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="PATH.gguf[=NAME]",
        help="serve a GGUF file with llama-cpp-python's server, run by the node (repeatable; NAME default: "
        "the file's name, lower-case, without .gguf and its quantisation)",
    )
    command.add_argument(
        "--llama-python",
        metavar="PY",
        help="with --model: the Python that has llama-cpp-python[server] (default: $IOP_LLAMA_PYTHON, else the "
        "state folder's engines/llama, else this one's, else installed into the state folder)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``iop`` command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(_command(argv)).parse_args(argv)
    # node and control-plane configure logging from their settings; an admin request logs nothing
    # of its own, and leaves structlog unloaded (a new process each time: imports are its cost).
    if args.command not in ("node", "control-plane") and args.logs:
        from iop_wire.logs import configure

        configure(args.log_level or "warning")
    try:
        code: int = args.run(args)
    except CliError as exc:
        print(f"iop {args.command}: {exc}", file=sys.stderr)
        return exc.code
    return code


def _command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names when nothing but ``--log-level LEVEL`` comes before it."""
    rest = list(argv[2:] if argv[:1] == ["--log-level"] else argv)
    return rest[0] if rest and not rest[0].startswith("-") else None


def console() -> None:
    """Console-script entry point."""
    # structlog imports rich whenever it is installed (here only the development tools bring it, for
    # import-linter) for console tracebacks IOP never renders: its log lines are JSON. Kept out, every
    # command starts as it does where IOP is installed alone (rich, pygments and attrs were a quarter of
    # what `iop nodes ls` imported, by `python -X importtime`).
    sys.modules.setdefault("rich", None)  # type: ignore[arg-type]  # None: "import rich" raises ImportError
    if _command(sys.argv[1:]) not in _ONE_REQUEST:
        sys.exit(main())
    from iop_cli.oneshot import run_without_collector

    sys.exit(run_without_collector(main))


if __name__ == "__main__":
    console()
