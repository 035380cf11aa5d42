"""``iop join ADDRESS --token T --ca sha256:H``: this machine becomes a node of the control-plane at ADDRESS.

What goes over the network, in order:

1. A TLS connection that verifies nothing and presents no certificate (this machine has no CA
   yet) carries ``join.hello``, which holds nothing; ``join.welcome`` brings the control-plane's
   CA. Its hash (``iop_wire.certs.ca_hash``) must be the one given with ``--ca``: if it is not,
   the connection closes and nothing else is sent (one line, exit 2).
2. The node's private key is made here (``DIR/certs/node.key``, 0600; it never leaves the
   machine), and a certificate request for it (CN the node's name). A second connection, which
   verifies the control-plane's certificate against that CA and ADDRESS's host, carries
   ``join.request`` (the token and the request); ``join.accepted`` brings the node's certificate
   (``DIR/certs/node.crt``, beside ``DIR/certs/ca.crt``).

Then ``DIR/node.yaml`` (the node named as its certificate, registered with ADDRESS; routes as
``iop up --backend`` or ``iop up --model`` write them, or the mock models; ``--model``'s Python
found or installed first, in DIR, before step 1) and ``DIR/joined.json`` (address, name, CA
hash, time) are written and the node starts as ``iop up`` starts the platform: under ``iop
supervise`` in the background (``--foreground``: attached), the node alone. ``join`` returns once
the node registered, printing its name, the control-plane and the models it serves. ``iop down``
and ``iop status`` in DIR handle it; ``iop up`` there starts the node again (after a reboot: no
new token). Every failure is one line, exit 2; a folder that joined already says so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import shutil
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from iop_cli.configs import backend_routes, node_config
from iop_cli.ggufs import engine_models, gguf_models, llama_routes
from iop_cli.llama import llama_python
from iop_cli.output import CliError
from iop_cli.platform import JOINED, Platform, is_joined, read_joined
from iop_cli.preflight import choosing_ports, only_up
from iop_cli.shell import iop_command
from iop_cli.up import run_attached, start_supervised
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import ca_hash, certificate_facts, certificate_request, key_pem, new_key
from iop_wire.endpoint import dial
from iop_wire.errors import IopError
from iop_wire.tls import Role, certless_context

__all__ = ["join", "start_joined"]

_TIMEOUT = 10.0
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_PIN = re.compile(r"sha256:[0-9a-f]{64}")
_ROLE_NAMES = frozenset(role.value for role in Role)


def join(args: argparse.Namespace) -> int:
    """Join the control-plane at ``args.address``; the exit code (CliError: one line, exit 2)."""
    state: Path = args.dir
    _refuse_taken(state)
    host, port = _address(args.address)
    name = _name(args.name)
    _check_token(args.token)
    if not _PIN.fullmatch(args.ca):
        raise CliError(
            f"--ca must be sha256: and 64 hex digits (as 'iop join-token create' prints it), not {args.ca!r}"
        )
    ggufs = gguf_models(args.model)  # a missing or non-GGUF file: one line, before anything
    routes = backend_routes(args.backend) if args.backend else None  # before anything is sent: nothing wasted
    created = not state.exists()
    state.mkdir(parents=True, exist_ok=True)
    ports = contextlib.ExitStack()
    try:
        with only_up(state, "join"):
            _refuse_taken(state)
            if ggufs:  # before joining: the token may expire while llama.cpp compiles, the node's certificate not
                routes = llama_routes(ggufs, llama_python(state, args.llama_python))
            asyncio.run(_join(state, (host, port), name, args.token, args.ca))
            # The node's metrics port is chosen free as its config is written: held until the node
            # listens, as `iop up` holds it, or an `iop up` starting meanwhile may choose it too.
            ports.enter_context(choosing_ports())
            _write_node(state, name, args.address, host, routes)
            (state / JOINED).write_text(json.dumps(_joined(args.address, name, args.ca), indent=2) + "\n")
    except BaseException:
        ports.close()
        if created:  # a refused join leaves no folder behind (its key was for a certificate never issued)
            shutil.rmtree(state, ignore_errors=True)
        raise
    with ports:  # attached (--foreground), released once the node is up, not for as long as it runs
        return start_joined(state, args.log_level, foreground=args.foreground, started=ports.close)


def start_joined(
    state: Path, log_level: str | None, *, foreground: bool, started: Callable[[], None] = lambda: None
) -> int:
    """Start the node of a folder that joined (by ``iop join``, or ``iop up`` there after ``iop down``
    or a reboot: the certificate it holds, renewed or not, is still its own); the exit code."""
    if foreground:
        return _foreground(Platform(state, log_level, foreground=True), started)
    try:
        running = start_supervised(state, log_level)
    except CliError as exc:
        raise CliError(str(exc), 2) from None
    _print_joined(state, running["node"])
    return 0


async def _join(state: Path, address: tuple[str, int], name: str, token: str, pin: str) -> None:
    """Steps 1 and 2: the CA checked against ``pin``, then the key, the request and the certificate."""
    host, port = address
    where = f"the control-plane at {host}:{port}"
    welcome = await _ask(host, port, certless_context(), pb.Envelope(join_hello=pb.JoinHello()), where)
    ca_pem = welcome.join_welcome.ca_pem.encode()
    try:
        presented = ca_hash(ca_pem)
    except ValueError:
        raise CliError(f"{where} sent no CA certificate in join.welcome: nothing was sent") from None
    if presented != pin:
        raise CliError(f"{where} presented CA {presented}, not the {pin} given with --ca: nothing was sent")
    certs = state / "certs"
    certs.mkdir(exist_ok=True)
    key = new_key()
    _write_private(certs / "node.key", key_pem(key))
    request = pb.JoinRequest(token=token, csr_pem=certificate_request(key, name).decode())
    accepted = (
        await _ask(host, port, certless_context(ca_pem), pb.Envelope(join_request=request), where)
    ).join_accepted
    certificate = accepted.certificate_pem.encode()
    try:
        facts = certificate_facts(certificate)
    except ValueError:
        raise CliError(f"{where} answered join.request without a certificate") from None
    if facts.name != name:
        raise CliError(f"{where} issued a certificate for {facts.name!r}, not {name!r}")
    _write_private(certs / "node.crt", certificate)
    _write_private(certs / "ca.crt", ca_pem)


async def _ask(host: str, port: int, context: ssl.SSLContext, request: pb.Envelope, where: str) -> pb.Envelope:
    """One request over a new TLS connection with ``context`` (no client certificate); its answer."""
    expect = {Role.CONTROL_PLANE} if context.verify_mode == ssl.CERT_REQUIRED else None
    try:
        connection = await dial(
            host, port, context=context, server_hostname=host, expect_roles=expect, timeout=_TIMEOUT
        )
    except ssl.SSLCertVerificationError as exc:
        raise CliError(
            f"{where} presented a certificate the pinned CA does not vouch for: {exc.verify_message}"
        ) from None
    except IopError as exc:
        raise CliError(f"{where} refused the connection: {exc.message}") from None
    except TimeoutError:
        raise CliError(f"cannot reach {where}: timed out") from None
    except ConnectionRefusedError:
        raise CliError(f"cannot reach {where}: connection refused") from None
    except OSError as exc:  # ssl.SSLError included: a listener that takes no connection without a certificate
        raise CliError(f"cannot join through {where}: {_reason(exc)}") from None
    try:
        return await connection.request(request, timeout=_TIMEOUT)
    except IopError as exc:
        raise CliError(exc.message) from None
    except TimeoutError:
        raise CliError(f"{where} did not answer in {_TIMEOUT:g} s") from None
    finally:
        await connection.close("joined")


def _reason(exc: OSError) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}" + (
            " (it takes no connection without a certificate: is joining on, join.ca_key?)"
            if "CERTIFICATE_REQUIRED" in str(exc).upper() or "CERTIFICATE REQUIRED" in str(exc).upper()
            else ""
        )
    return str(exc.strerror or exc)


# --- what the command checks, writes and prints ------------------------------------------------------


def _refuse_taken(state: Path) -> None:
    if is_joined(state):
        joined = read_joined(state)
        raise CliError(
            f"already joined {joined.get('address', '?')} as {joined.get('name', '?')} in {state} "
            f"({iop_command('down', '--dir', str(state))}, then remove {state} to join again)"
        )
    if (state / "control-plane.yaml").exists():
        raise CliError(f"{state} holds the platform 'iop up' made; join with --dir ANOTHER_FOLDER")


def _address(address: str) -> tuple[str, int]:
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CliError(f"ADDRESS must be HOST:PORT (as 'iop join-token create' prints it), not {address!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _name(name: str | None) -> str:
    """``--name``, else this machine's host name made a node name; CliError if it cannot be one."""
    if name is None:
        cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).lstrip("._-")[:63]
        if _NAME.fullmatch(cleaned) and cleaned not in _ROLE_NAMES:
            return cleaned
        raise CliError(f"this machine's host name {socket.gethostname()!r} is no node name: pass --name NAME")
    if not _NAME.fullmatch(name) or name in _ROLE_NAMES:
        raise CliError(
            f"--name {name!r}: a node name is 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit, "
            f"and none of {', '.join(sorted(_ROLE_NAMES))}"
        )
    return name


def _check_token(token: str) -> None:
    if not token.startswith("iopjt-") or "." not in token:
        raise CliError("--token must be a join token, iopjt-ID.SECRET (as 'iop join-token create' prints it)")


def _write_node(state: Path, name: str, address: str, host: str, routes: list[dict[str, Any]] | None) -> None:
    certs = (state / "certs").resolve()
    tls = {
        "enabled": True,
        "cert": str(certs / "node.crt"),
        "key": str(certs / "node.key"),
        "ca": str(certs / "ca.crt"),
    }
    config = node_config(state, node_id=name, address=address, tls=tls, routes=routes, server_name=host)
    (state / "node.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def _joined(address: str, name: str, pin: str) -> dict[str, str]:
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {"address": address, "name": name, "ca": pin, "joined_at": now}


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _print_joined(state: Path, node: dict[str, Any]) -> None:
    joined = read_joined(state)
    models = _models(state)
    dir_args = ["--dir", str(state)]
    print(f"joined {joined['address']} as node {joined['name']}, pid {node.get('pid')}")
    print(f"serves: {', '.join(models) or '(no routes)'}")
    if served := engine_models(state / "node.yaml"):
        ask = iop_command("nodes", "ls")
        print(
            f"the node starts the server of {', '.join(served)}: '{ask}' where the control-plane runs shows its state"
        )
    print(f"status: {iop_command('status', *dir_args)}")
    print(f"log: {state / 'node.log'}")
    print(f"stop: {iop_command('down', *dir_args)}")


def _models(state: Path) -> list[str]:
    with contextlib.suppress(OSError, yaml.YAMLError, TypeError, KeyError):
        return [str(route["model"]) for route in yaml.safe_load((state / "node.yaml").read_text())["routes"]]
    return []


def _foreground(platform: Platform, started: Callable[[], None]) -> int:
    """--foreground: the node attached, its output relayed; Ctrl-C or SIGTERM stop it; ``started()`` once it is up."""

    def up(services: dict[str, Any]) -> None:
        started()
        _print_joined(platform.state, services["node"])

    try:
        return run_attached(platform, up)
    except CliError as exc:
        raise CliError(str(exc), 2) from None
