"""``iop status``: what ``iop up`` (or ``iop join``) started in a state folder, and how it is doing.

One row per service: SERVICE, PID, ADDRESS, HEALTH, RESTARTS, LAST EXIT (``--json``: a list of
objects). The control-plane is healthy once its ready file is written, the node when the
control-plane (asked over mTLS with the admin certificate) lists it ready, the worker when it
answers a ``batches.list`` (asked the same way), the edge when ``GET /health`` answers 200;
restarts and the last exit are the supervisor's. Below the table, one line per model whose server
the node runs (a route with an ``engine``), as the control-plane last heard from the node:
``model smol: llama.cpp: ready, up 3m, pid 1234, port 40123`` (``--json``: the node's ``served``).
Exit 0 if every service is up and no served model failed, else 1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from iop_cli.addresses import others_use
from iop_cli.configs import HTTP_TIMEOUT, reason
from iop_cli.ops import NODE_STATES
from iop_cli.output import emit, table
from iop_cli.platform import (
    Service,
    http_status,
    is_joined,
    last_dial_refused,
    read_joined,
    running_pid,
    services,
)
from iop_cli.readyfile import read_ready
from iop_cli.served import served_dict, served_text
from iop_cli.supervisor import read_state
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.blocking import BlockingClient
from iop_wire.tls import TlsConfig, client_context

__all__ = ["admin_ask", "status"]


def status(state: Path, *, as_json: bool = False) -> int:
    """What ``up`` started: process, address, health and restarts of each service; 0 if all are up."""
    supervised = (read_state(state) or {}).get("services", {})
    rows = [{**_status_row(service), **_restarts(supervised.get(service.name))} for service in services(state)]
    header = ["SERVICE", "PID", "ADDRESS", "HEALTH", "RESTARTS", "LAST EXIT"]
    reached = [f"{r['service']} {', '.join(r['others_use'])}" for r in rows if r.get("others_use")]
    cells = [
        [
            r["service"],
            str(r["pid"] or "-"),
            r["address"] or "-",
            r["health"],
            str(r["restarts"]),
            r["last_exit"] or "-",
        ]
        for r in rows
    ]
    text = table([header, *cells]) + (f"\nfrom other machines: {'; '.join(reached)}" if reached else "")
    served = [line for r in rows for line in r.get("served_lines", ())]
    emit([_public(r) for r in rows], as_json=as_json, text="\n".join([text, *served]))
    failed = any(model["state"] == "failed" for r in rows for model in r.get("served") or ())
    return 0 if all(r["up"] for r in rows) and not failed else 1


def _restarts(supervised: dict[str, Any] | None) -> dict[str, Any]:
    """What the supervisor counted for a service: restarts, how it last exited, whether it was given up."""
    seen = supervised or {}
    row: dict[str, Any] = {"restarts": int(seen.get("restarts", 0)), "last_exit": seen.get("last_exit")}
    if seen.get("state") == "given up":
        row["health"] = "given up (crash loop; see its log)"
    elif seen.get("state") == "restarting":
        row["health"] = "restarting"
    return row


def _status_row(service: Service) -> dict[str, Any]:
    pid = running_pid(service)
    ready = read_ready(service.file(".ready")) if pid is not None else None
    row: dict[str, Any] = {"service": service.name, "pid": pid, "address": None, "health": "stopped", "up": False}
    if pid is None:
        return row
    if ready is None:
        return {**row, "health": "starting"}
    return {**row, **_health(service, ready), **_others_use(service, ready.get("port"))}


def _health(service: Service, ready: dict[str, Any]) -> dict[str, Any]:
    """Address, health and whether it is up, of a service that wrote its ready file."""
    port = ready.get("port")
    match service.name:
        case "control-plane":
            return {"address": f"127.0.0.1:{port}", "health": "ok", "up": True}
        case "node" if is_joined(service.state):
            return _joined_node(service.state, ready)
        case "node":
            state, node = _node_state(service.state, str(ready.get("node_id", "")))
            row = {"address": f"registered as {ready.get('node_id')}", "health": state, "up": state == "ready"}
            return {**row, **_served(node)}
        case "worker":
            health = _worker_health(int(ready["port"]), service.state / "certs")
            return {"address": f"127.0.0.1:{port}", "health": health, "up": health == "ok"}
        case _:
            code = http_status(f"http://127.0.0.1:{port}/health")
            health = "ok" if code == 200 else f"HTTP {code}" if code else "not answering"
            return {"address": f"http://127.0.0.1:{port}/v1", "health": health, "up": code == 200}


def _others_use(service: Service, port: object) -> dict[str, Any]:
    """The addresses other machines reach a listening service at (``iop up --listen``)."""
    if service.name == "node":
        return {}
    if service.name == "edge":
        return {"others_use": [f"http://{host}:{port}/v1" for host in others_use(service.file(".yaml"), "http")]}
    return {"others_use": [f"{host}:{port}" for host in others_use(service.file(".yaml"))]}


def _joined_node(state: Path, ready: dict[str, Any]) -> dict[str, Any]:
    """A joined node's row: registered with the control-plane ``iop join`` named, once it said so."""
    joined = read_joined(state)
    address = f"registered as {ready.get('node_id')} with {joined.get('address', '?')}"
    if not ready.get("registered"):
        return {"address": address, "health": "not registered", "up": False}
    if refused := last_dial_refused(state / "node.log"):  # removed since, or the control-plane is away
        return {"address": address, "health": f"not registered: {refused}", "up": False}
    return {"address": address, "health": "ready", "up": True}


def _node_state(state: Path, node_id: str) -> tuple[str, pb.NodeInfo | None]:
    """The node's state as the control-plane sees it (asked over mTLS as an admin), and what it listed."""
    control_plane = read_ready(state / "control-plane.ready")
    if not control_plane:
        return "no control-plane", None
    try:
        listed = admin_ask(int(control_plane["port"]), state / "certs", pb.Envelope(nodes_list=pb.NodesList()))
    except Exception as exc:  # noqa: BLE001 - any failure to ask is shown, not raised
        return f"unknown ({reason(exc)})", None
    for node in listed.nodes_listed.nodes:
        if node.node_id == node_id:
            return NODE_STATES.get(node.state, "unspecified"), node
    return "not registered", None


def _served(node: pb.NodeInfo | None) -> dict[str, Any]:
    """The node's served models: ``served`` for --json, one line each for the text."""
    if node is None:
        return {}
    now = time.time()
    models = [model for model in node.models if model.HasField("served")]
    return {
        "served": [{"model": model.model, **served_dict(model.served, now)} for model in models],
        "served_lines": [f"model {model.model}: {served_text(model.served, now)}" for model in models],
    }


def _public(row: dict[str, Any]) -> dict[str, Any]:
    """A row as --json shows it: without the lines the text prints."""
    return {key: value for key, value in row.items() if key != "served_lines"}


def _worker_health(port: int, certs: Path) -> str:
    """ "ok" once the worker answers a batches.list (asked over mTLS as an admin)."""
    try:
        admin_ask(port, certs, pb.Envelope(batches_list=pb.BatchesList(limit=1)))
    except Exception as exc:  # noqa: BLE001 - any failure to ask is shown, not raised
        return f"not answering ({reason(exc)})"
    return "ok"


def admin_ask(port: int, certs: Path, request: pb.Envelope) -> pb.Envelope:
    """One request to a service on 127.0.0.1:``port``, over mTLS as an admin; its answer (the blocking
    client, as ``iop nodes`` uses: no event loop for one question)."""
    tls = TlsConfig(enabled=True, cert=certs / "admin.crt", key=certs / "admin.key", ca=certs / "ca.crt")
    context = client_context(tls)
    with BlockingClient.connect(
        "127.0.0.1", port, context=context, server_hostname="localhost", timeout=HTTP_TIMEOUT
    ) as client:
        return client.request(request, timeout=HTTP_TIMEOUT)
