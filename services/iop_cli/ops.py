"""``iop nodes ls|drain|undrain|remove|reload``, ``iop policy show|apply`` and ``iop runs ls|show --control-plane``:
operate a control-plane over IOP.

Each command dials the control-plane (``--control-plane HOST:PORT``, default
``$IOP_CONTROL_PLANE`` or ``127.0.0.1:7400``) with mTLS as an admin: ``admin.crt``,
``admin.key`` and ``ca.crt`` from ``--certs DIR`` (default the state folder's ``certs``, where
``iop certs init`` and ``iop up`` put them), checking the server's certificate against
``--server-name`` (default ``localhost``). It sends one request and prints the answer.

Exit codes: 0 done; 1 the control-plane refused the operation (an unknown node, say);
2 it could not be asked (unreachable, certificate refused, a file missing) or, for
``policy apply``, the policy is invalid (the control-plane's one line, naming the key, is printed).

``ask`` also serves ``iop batches`` (``iop_cli.batches``), which asks a
worker the same way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import ssl
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf.duration_pb2 import Duration

from iop_cli.output import CliError, emit, table, warn
from iop_cli.readyfile import read_ready
from iop_cli.served import served_dict, served_text
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.blocking import BlockingClient
from iop_wire.contexts import mutual_tls_context
from iop_wire.errors import IopError, code_name

__all__ = [
    "DEFAULT_CONTROL_PLANE",
    "NODE_STATES",
    "ask",
    "default_address",
    "iso",
    "nodes_drain",
    "nodes_ls",
    "nodes_reload",
    "nodes_remove",
    "nodes_undrain",
    "policy_apply",
    "policy_show",
    "runs_ls",
    "runs_show",
]

DEFAULT_CONTROL_PLANE = "127.0.0.1:7400"
_DEFAULTS = {"control-plane": DEFAULT_CONTROL_PLANE, "worker": "127.0.0.1:7402"}
_TIMEOUT = 10.0
NODE_STATES = {  # a node's state as the commands show it
    pb.NODE_STATE_READY: "ready",
    pb.NODE_STATE_UNAVAILABLE: "unavailable",
    pb.NODE_STATE_DRAINING: "draining",
}
# Answers that mean "this could not be asked" rather than "the control-plane said no".
_CANNOT_ASK = frozenset({pb.ERROR_CODE_PERMISSION_DENIED, pb.ERROR_CODE_UNAUTHENTICATED})


def nodes_ls(args: argparse.Namespace) -> int:
    """Every node the control-plane knows, as a table or JSON."""
    listed = ask(args, pb.Envelope(nodes_list=pb.NodesList())).nodes_listed
    now = time.time()
    if args.json:
        emit([_node_dict(node, now) for node in listed.nodes], as_json=True, text="")
    else:
        print(_nodes_table(listed.nodes, now) if listed.nodes else "no nodes registered")
    return 0


def nodes_drain(args: argparse.Namespace) -> int:
    """No new runs to the node; its runs in flight finish."""
    drain = pb.NodesDrain(node_id=args.node, reason=args.reason or "")
    print(ask(args, pb.Envelope(nodes_drain=drain)).operation_done.message)
    return 0


def nodes_undrain(args: argparse.Namespace) -> int:
    """Runs go to the node again (once it is connected)."""
    undrain = pb.NodesUndrain(node_id=args.node, reason=args.reason or "")
    print(ask(args, pb.Envelope(nodes_undrain=undrain)).operation_done.message)
    return 0


def nodes_remove(args: argparse.Namespace) -> int:
    """Revoke the node's certificates, close its connection, forget it: it comes back only by joining again."""
    remove = pb.NodesRemove(node_id=args.node, reason=args.reason or "")
    print(ask(args, pb.Envelope(nodes_remove=remove)).operation_done.message)
    return 0


def nodes_reload(args: argparse.Namespace) -> int:
    """The node reads its config file's routes again: prints what changed (or, exit 1, why nothing did)."""
    reload = pb.NodesReload(node_id=args.node)
    print(ask(args, pb.Envelope(nodes_reload=reload)).operation_done.message)
    return 0


def policy_show(args: argparse.Namespace) -> int:
    """The policy in force: a comment line (version, source, time), then its YAML."""
    shown = ask(args, pb.Envelope(policy_show=pb.PolicyShow())).policy_shown
    loaded = iso(shown.loaded_at.ToNanoseconds() / 1e9) if shown.HasField("loaded_at") else "-"
    print(f"# policy version {shown.version}, from {shown.source or '-'}, in force since {loaded}")
    if shown.yaml:
        print(shown.yaml, end="" if shown.yaml.endswith("\n") else "\n")
    else:
        print("# no policy file: the defaults are in force")
    return 0


def policy_apply(args: argparse.Namespace) -> int:
    """Send a policy file; prints the version now in force."""
    path: Path = args.file
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise CliError(f"cannot read {path}: {reason}", 2) from None
    apply = pb.PolicyApply(yaml=text, source=str(path))
    try:
        applied = ask(args, pb.Envelope(policy_apply=apply)).policy_applied
    except CliError as exc:
        if exc.error != pb.ERROR_CODE_INVALID_ARGUMENT:
            raise
        raise CliError(f"{path} refused: {exc}", 2) from None
    print(f"policy {applied.version} in force (from {path})")
    return 0


def runs_ls(args: argparse.Namespace) -> int:
    """Runs from the control-plane's ledger, newest first, as a table or JSON."""
    from iop_control_plane.ledger import MAX_LIST, STATUSES  # here: the other commands start without the services'
    from iop_node.history import parse_since

    if args.status and args.status not in STATUSES:
        raise CliError(f"unknown status {args.status!r}; valid: {', '.join(STATUSES)}", 2)
    if not 1 <= args.limit <= MAX_LIST:
        raise CliError(f"--limit must be from 1 to {MAX_LIST}, not {args.limit}", 2)
    query = pb.RunsList(status=args.status or "", model=args.model or "", node_id=args.node or "", limit=args.limit)
    if args.since:
        try:
            query.since.FromDatetime(parse_since(args.since))
        except ValueError as exc:
            raise CliError(str(exc), 2) from None
    listed = ask(args, pb.Envelope(runs_list=query)).runs_listed
    runs = [_run_dict(run) for run in listed.runs]
    emit(runs, as_json=args.json, text=_runs_table(runs))
    if listed.more:
        warn("runs", f"showing the newest {args.limit} runs; more match (--limit N shows more)")
    return 0


def runs_show(args: argparse.Namespace) -> int:
    """Every field of one run from the control-plane's ledger, with its attempts."""
    listed = ask(args, pb.Envelope(runs_list=pb.RunsList(run_id=args.run_id, limit=1))).runs_listed
    if not listed.runs:
        raise CliError(f"no run {args.run_id!r} in the control-plane's ledger", 1)
    run = _run_dict(listed.runs[0])
    if args.json:
        print(json.dumps(run, indent=2))
    else:
        print("\n".join(f"{key}: {_text(value)}" for key, value in run.items() if key != "attempts"))
        print("attempts:")
        for number, attempt in enumerate(run["attempts"], 1):
            print(f"  {number}. " + ", ".join(f"{key}={_text(value)}" for key, value in attempt.items()))
    if listed.more:
        warn("runs", f"other requesters also used the id {args.run_id!r}; this is the newest")
    return 0


def ask(args: argparse.Namespace, envelope: pb.Envelope, *, service: str = "control-plane") -> pb.Envelope:
    """Dial ``service`` (at its ``--SERVICE HOST:PORT`` option) as an admin, send one request, return its answer.

    A blocking client, not asyncio: these commands start a new process each time, and the asyncio
    connection's imports were most of their time."""
    option = service.replace("-", "_")
    if not getattr(args, option):
        setattr(args, option, default_address(service, args.dir))
    host, port = _address(getattr(args, option), f"--{service}")
    context = _admin_context(args.certs or args.dir / "certs")
    where = f"the {service} at {host}:{port}"
    try:
        client = BlockingClient.connect(host, port, context=context, server_hostname=args.server_name, timeout=_TIMEOUT)
    except IopError as exc:
        raise CliError(f"{where} refused the connection: {exc.message}", 2) from None
    except TimeoutError:
        raise CliError(f"cannot reach {where}: timed out", 2) from None
    except ConnectionRefusedError:
        raise CliError(f"cannot reach {where}: connection refused", 2) from None
    except OSError as exc:
        raise CliError(f"cannot reach {where}: {exc.strerror or exc}", 2) from None
    with client:
        try:
            return client.request(envelope, timeout=_TIMEOUT)
        except IopError as exc:
            raise CliError(exc.message, 2 if exc.code in _CANNOT_ASK else 1, error=exc.code) from None
        except TimeoutError:
            raise CliError(f"{where} did not answer in {_TIMEOUT:g}s", 2) from None


def default_address(service: str, state: Path) -> str:
    """``$IOP_CONTROL_PLANE`` / ``$IOP_WORKER``, else the port ``iop up`` started under ``state``, else the default."""
    if address := os.environ.get(f"IOP_{service.replace('-', '_').upper()}"):
        return address
    ready = read_ready(state / f"{service}.ready")
    return f"127.0.0.1:{ready['port']}" if ready and ready.get("port") else _DEFAULTS[service]


def _address(value: str, option: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CliError(f"{option} must be HOST:PORT, not {value!r}", 2)
    return host.strip("[]"), int(port)


def _admin_context(certs: Path) -> ssl.SSLContext:
    files = {name: certs / name for name in ("admin.crt", "admin.key", "ca.crt")}
    for path in files.values():
        if not path.is_file():
            raise CliError(f"no {path} (pass --certs DIR, or create it with 'iop certs init {certs}')", 2)
    # From the files, not a TlsConfig: iop_wire.tls's dataclasses would cost a tenth of the command's start.
    return mutual_tls_context(ssl.Purpose.SERVER_AUTH, files["admin.crt"], files["admin.key"], files["ca.crt"])


def _node_dict(node: pb.NodeInfo, now: float) -> dict[str, Any]:
    heartbeat = node.last_heartbeat.ToNanoseconds() / 1e9 if node.HasField("last_heartbeat") else None
    first_seen = node.first_seen.ToNanoseconds() / 1e9 if node.HasField("first_seen") else None
    return {
        "node_id": node.node_id,
        "state": NODE_STATES.get(node.state, "unspecified"),
        "reason": node.reason,
        "models": [
            {
                "model": model.model,
                "in_flight": model.in_flight,
                "queued": model.queued,
                "capacity": model.capacity,
                "available": model.available,
                "served": served_dict(model.served, now) if model.HasField("served") else None,
            }
            for model in node.models
        ],
        "labels": dict(node.labels),
        "in_flight": node.in_flight,
        "capacity": node.capacity,
        "last_heartbeat": iso(heartbeat) if heartbeat is not None else None,
        "last_heartbeat_age_s": round(max(0.0, now - heartbeat), 3) if heartbeat is not None else None,
        "address": node.address,
        "first_seen": iso(first_seen) if first_seen is not None else None,
        "certificate_serial": node.certificate_serial,
        "certificate_not_after": iso(node.certificate_not_after.ToNanoseconds() / 1e9)
        if node.HasField("certificate_not_after")
        else None,
        "shared_certificate": node.shared_certificate,
    }


def _nodes_table(nodes: Sequence[pb.NodeInfo], now: float) -> str:
    """The table, read from the answer itself: the JSON's dates (three per node) are not shown, and
    making them took 1,000 nodes longer than the rest of the listing."""
    rows = [("NODE", "STATE", "MODELS", "IN-FLIGHT", "HEARTBEAT", "ADDRESS", "REASON")]
    for node in nodes:
        models = ",".join([_model_cell(model, now) for model in node.models])
        beat = node.last_heartbeat  # its fields, not ToNanoseconds(): that checks the range in Python, per node
        heartbeat = now - (beat.seconds + beat.nanos / 1e9) if node.HasField("last_heartbeat") else None
        rows.append(
            (
                node.node_id,
                NODE_STATES.get(node.state, "unspecified"),
                models or "-",
                f"{node.in_flight}/{node.capacity}",
                "-" if heartbeat is None else f"{max(0.0, heartbeat):.1f}s ago",
                node.address or "-",
                node.reason or "-",
            )
        )
    return table(rows, last_free=True)


def _model_cell(model: pb.ModelLoad, now: float) -> str:
    """A model in the MODELS column: a served one with its server's state, else whether it is available."""
    if model.HasField("served"):
        return f"{model.model} ({served_text(model.served, now)})"
    return model.model if model.available else f"{model.model}(unavailable)"


def _run_dict(run: pb.LedgerRun) -> dict[str, Any]:
    return {
        "run_id": run.run_id,
        "received_at": iso(run.received_at.ToNanoseconds() / 1e9, "milliseconds"),
        "requester": run.requester,
        "connection": run.connection,
        "caller": run.caller,
        "model": run.model,
        "node_id": run.node_id,
        "status": run.status,
        "error_code": code_name(run.error_code) if run.error_code else "",
        "error_message": run.error_message,
        "ttft_ms": _ms(run.ttft) if run.HasField("ttft") else None,
        "duration_ms": _ms(run.duration),
        "prompt_tokens": run.usage.prompt_tokens,
        "completion_tokens": run.usage.completion_tokens,
        "usage_estimated": run.usage.estimated,
        "finish_reason": pb.FinishReason.Name(run.finish_reason).removeprefix("FINISH_REASON_").lower()
        if run.finish_reason
        else "",
        "outputs": run.outputs,
        "migrations": run.migrations,
        "attempts": [
            {
                "node_id": attempt.node_id,
                "model": attempt.model,
                "outcome": attempt.outcome,
                "reason": attempt.reason,
                "started_after_ms": _ms(attempt.started_after),
                "duration_ms": _ms(attempt.duration),
                "outputs": attempt.outputs,
                "continued": attempt.continued,
                "continuation_prompt_tokens": attempt.continuation_prompt_tokens,
                "gap_ms": _ms(attempt.gap) if attempt.HasField("gap") else None,
            }
            for attempt in run.attempts
        ],
    }


def _runs_table(runs: list[dict[str, Any]]) -> str:
    if not runs:
        return "no runs"
    # MOVED: times the run was continued on another node after output (a migration)
    header = ("RECEIVED", "RUN", "CALLER", "MODEL", "NODE", "STATUS", "TRIES", "MOVED", "TTFT-MS", "MS", "TOKENS")
    rows = [(*header, "ERROR")]
    for run in runs:
        tokens = f"{run['prompt_tokens']}/{run['completion_tokens']}" + ("~" if run["usage_estimated"] else "")
        rows.append(
            (
                run["received_at"][:19] + "Z",
                run["run_id"],
                run["caller"] or "-",
                run["model"],
                run["node_id"] or "-",
                run["status"],
                str(len(run["attempts"])),
                str(run["migrations"]),
                _text(run["ttft_ms"]),
                _text(run["duration_ms"]),
                tokens,
                run["error_code"] or "-",
            )
        )
    return table(rows)


def _ms(duration: Duration) -> float:
    return round(duration.ToNanoseconds() / 1e6, 3)


def _text(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def iso(seconds: float, timespec: str = "seconds") -> str:
    """``seconds`` since the epoch as ISO 8601 in UTC."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec=timespec)
