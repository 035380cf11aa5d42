"""``iop join-token create|ls|revoke``: the tokens other machines join the control-plane with.

Asked of the control-plane over mTLS with the admin certificate, as ``iop nodes`` asks
(``iop_cli.ops.ask``: ``--control-plane``, ``--dir``, ``--certs``, ``--server-name``). ``create``
prints exactly one line on stdout, the command to run on the new machine::

    iop join 10.0.0.5:7400 --token iopjt-abc123.<secret> --ca sha256:<hash>

HOST is the first address other machines use (``iop up --listen``, read from DIR's
``control-plane.yaml``); without one, the address asked, and a line on stderr saying that other
machines cannot reach a loopback address. The expiry and uses go to stderr. The control-plane
keeps only the secret's hash: the token is shown this once.
"""

from __future__ import annotations

import argparse
import datetime
import re
import time
from typing import Any

from iop_cli.addresses import others_use
from iop_cli.ops import ask, iso
from iop_cli.output import CliError, emit, table, warn
from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = ["join_token_create", "join_token_ls", "join_token_revoke"]

_DURATION = re.compile(r"(\d+)([smhd])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_LOOPBACK = ("127.", "localhost", "::1", "[::1]")


def join_token_create(args: argparse.Namespace) -> int:
    """Create a token; print the ``iop join`` line for it."""
    create = pb.JoinTokenCreate(uses=args.uses, name_prefix=args.name_prefix or "")
    create.ttl.FromTimedelta(datetime.timedelta(seconds=_duration(args.ttl)))
    created = ask(args, pb.Envelope(join_token_create=create)).join_token_created
    asked_host, _, port = args.control_plane.rpartition(":")
    hosts = others_use(args.dir / "control-plane.yaml")
    host = hosts[0] if hosts else asked_host
    if not hosts and host.startswith(_LOOPBACK):
        warn(
            "join-token",
            f"other machines cannot reach {host}: start the platform with 'iop up --listen ADDRESS' "
            "(an address of this machine they reach)",
        )
    print(f"iop join {_bracketed(host)}:{port} --token {created.token} --ca {created.ca_hash}")
    info = created.info
    uses = "one machine" if info.uses <= 1 else f"{info.uses} machines"
    prefix = f", names starting {info.name_prefix!r}" if info.name_prefix else ""
    warn("join-token", f"token {info.id} for {uses}{prefix}, until {_when(info.expires_at)}")
    return 0


def join_token_ls(args: argparse.Namespace) -> int:
    """Every token, newest first: id, expiry, uses, state; never a secret."""
    listed = ask(args, pb.Envelope(join_tokens_list=pb.JoinTokensList())).join_tokens_listed
    now = time.time()
    tokens = [_token_dict(token, now) for token in listed.tokens]
    emit(tokens, as_json=args.json, text=_tokens_table(tokens) if tokens else "no join tokens")
    return 0


def join_token_revoke(args: argparse.Namespace) -> int:
    """No machine may join with the token any more."""
    token_id = args.id.removeprefix("iopjt-").partition(".")[0]  # a whole token names its id too
    print(ask(args, pb.Envelope(join_token_revoke=pb.JoinTokenRevoke(id=token_id))).operation_done.message)
    return 0


def _duration(text: str) -> int:
    match = _DURATION.fullmatch(text.strip())
    if not match or int(match[1]) == 0:
        raise CliError(f"--ttl must be a duration such as 30m, 1h or 7d, not {text!r}", 2)
    return int(match[1]) * _UNIT_SECONDS[match[2]]


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _when(stamp: Any) -> str:
    return iso(stamp.ToNanoseconds() / 1e9)


def _token_dict(token: pb.JoinTokenInfo, now: float) -> dict[str, Any]:
    expires = token.expires_at.ToNanoseconds() / 1e9
    if token.revoked:
        state = "revoked"
    elif expires <= now:
        state = "expired"
    elif token.used >= max(token.uses, 1):
        state = "used up"
    else:
        state = "valid"
    return {
        "id": token.id,
        "state": state,
        "created_at": _when(token.created_at),
        "expires_at": iso(expires),
        "uses": token.uses,
        "used": token.used,
        "name_prefix": token.name_prefix,
        "created_by": token.created_by,
    }


def _tokens_table(tokens: list[dict[str, Any]]) -> str:
    header = ("ID", "STATE", "EXPIRES", "USED", "NAME PREFIX", "CREATED BY")
    rows = [
        (t["id"], t["state"], t["expires_at"], f"{t['used']}/{t['uses']}", t["name_prefix"] or "-", t["created_by"])
        for t in tokens
    ]
    return table([header, *rows], last_free=True)
