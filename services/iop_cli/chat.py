"""``iop chat`` / ``iop models``: try the local platform's models through its edge, no code needed.

Both talk to the edge's OpenAI-compatible API: the base URL is ``--base-url``, else the one of
the state folder (``--dir``, default ``$IOP_STATE_DIR``, else ``.iop``: ``http://127.0.0.1:PORT/v1``
with the port from ``DIR/edge.ready``); the API key is ``--api-key``, else ``$IOP_API_KEY``, else
``DIR/api-key`` (the key ``iop up`` created), sent as a Bearer token.

``iop chat [--model M] [PROMPT...]`` streams the answer (``POST /chat/completions``, SSE) and
prints it as it arrives. The model is ``--model``, else the first the platform lists. The prompt
is the words given; with none, stdin when it is not a terminal; with none on a terminal, a
conversation: each line after ``> `` is sent with the whole history so far, until Ctrl-D.
``iop models`` prints each model with the runs it takes at once over the platform's nodes (its
routes' ``max_concurrency``, as the control-plane has them; ``-`` when it cannot be asked, or with
``--base-url``) and, for a model whose server a node runs (a route with an ``engine``), that
server's STATE (ready, starting, restarting, failed, stopping; over several nodes each state once,
``failed,ready``): such a model is listed also while it is not available, which the edge's list
leaves out; ``--json``: the list's objects, each with ``max_concurrency``, ``state`` and ``served``
(per node: engine, state, reason, restarts, uptime, pid, port; null for other models).

Errors are one line on stderr: an HTTP error is ``iop chat: <the API's message> (HTTP 404)``,
exit 1; a platform that cannot be reached names its URL and suggests ``iop up``, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from iop_cli.output import CliError, emit, table
from iop_cli.shell import iop_command

if TYPE_CHECKING:
    from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = ["chat", "models"]

_TIMEOUT = 600.0  # a long answer from a slow backend; the edge ends runs at its request_timeout


def chat(args: argparse.Namespace) -> int:
    """``iop chat``: stream answers to a prompt, or to a conversation on a terminal."""
    try:
        client = _Client.of(args)
        model = args.model or client.first_model()
        prompt = " ".join(args.prompt)
        if not prompt and sys.stdin.isatty():
            return _converse(client, model)
        _answer(client, model, [{"role": "user", "content": prompt or sys.stdin.read()}])
    except KeyboardInterrupt:
        print()
        return 130
    return 0


def models(args: argparse.Namespace) -> int:
    """``iop models``: what the platform serves, one id per line or JSON."""
    listed = _Client.of(args).models()
    fleet = _Fleet() if args.base_url else _Fleet.asked(args.dir)
    names = [str(model["id"]) for model in listed]
    # A served model that is starting, restarting or failed is in no list the edge gives: shown all the same.
    unlisted = [{"id": name, "object": "model"} for name in fleet.served if name not in names]
    rows = [fleet.row(model) for model in [*listed, *unlisted]]
    cells = ([str(r["id"]), str(r["max_concurrency"] or "-"), r["state"] or "-"] for r in rows)
    emit(rows, as_json=args.json, text=table([["MODEL", "MAX-CONCURRENCY", "STATE"], *cells]))
    return 0


class _Fleet:
    """What the platform's control-plane says of each model: runs at once over its nodes (its routes'
    ``max_concurrency``) and, for a model a node runs the server of, that server's state per node."""

    def __init__(self, nodes: Sequence[pb.NodeInfo] = ()) -> None:
        from iop_cli.served import served_dict, served_state

        self.capacity: dict[str, int] = {}
        self.served: dict[str, list[dict[str, Any]]] = {}
        self.states: dict[str, list[str]] = {}
        now = time.time()
        for node in nodes:
            for model in node.models:
                self.capacity[model.model] = self.capacity.get(model.model, 0) + model.capacity
                if model.HasField("served"):
                    self.served.setdefault(model.model, []).append(
                        {"node_id": node.node_id, **served_dict(model.served, now)}
                    )
                    self.states.setdefault(model.model, []).append(served_state(model.served))

    @classmethod
    def asked(cls, state: Path) -> _Fleet:
        """The control-plane of the state folder asked; empty when it cannot be."""
        from iop_cli.status import admin_ask  # the control-plane is asked only here
        from iop_gen.pb.iop import runtime_pb2 as pb

        ready = _read(state / "control-plane.ready")
        try:
            port = int(json.loads(ready or "")["port"])
            answer = admin_ask(port, state / "certs", pb.Envelope(nodes_list=pb.NodesList()))
        except Exception:  # noqa: BLE001 - the list is printed without it, whatever kept it from being asked
            return cls()
        return cls(answer.nodes_listed.nodes)

    def row(self, model: dict[str, Any]) -> dict[str, Any]:
        """``model`` (an OpenAI model object) with ``max_concurrency``, ``state`` (a served model's
        states over its nodes, e.g. ``ready`` or ``failed,ready``; None for others) and ``served``."""
        name = str(model["id"])
        states = self.states.get(name)
        return {
            **model,
            "max_concurrency": self.capacity.get(name),
            "state": ",".join(sorted(set(states))) if states else None,
            "served": self.served.get(name),
        }


def _converse(client: _Client, model: str) -> int:
    """Line by line until Ctrl-D, each question sent with the conversation so far."""
    history: list[dict[str, str]] = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        history.append({"role": "assistant", "content": _answer(client, model, history)})


def _answer(client: _Client, model: str, messages: list[dict[str, str]]) -> str:
    """Print the answer as it streams in; returns it whole."""
    parts: list[str] = []
    for delta in client.stream(model, messages):
        parts.append(delta)
        sys.stdout.write(delta)
        sys.stdout.flush()
    text = "".join(parts)
    if not text.endswith("\n"):
        print()
    return text


class _Client:
    """The edge's OpenAI-compatible API at ``base`` with ``key``."""

    def __init__(self, base: str, key: str | None, up: str) -> None:
        self.base, self.key, self.up = base.rstrip("/"), key, up

    @classmethod
    def of(cls, args: argparse.Namespace) -> _Client:
        state: Path = args.dir
        key = args.api_key or os.environ.get("IOP_API_KEY") or _read(state / "api-key")
        default = Path(os.environ.get("IOP_STATE_DIR", ".iop"))
        up = iop_command("up", *([] if state == default else ["--dir", str(state)]))
        if args.base_url:
            return cls(args.base_url, key, up)
        try:
            port = json.loads((state / "edge.ready").read_text())["port"]
        except (OSError, ValueError, KeyError, TypeError):
            raise CliError(f"no platform running in {state} (no edge.ready); start it with '{up}'", 2) from None
        return cls(f"http://127.0.0.1:{port}/v1", key, up)

    def models(self) -> list[dict[str, Any]]:
        with self._open("GET", "/models") as answer:
            listed: list[dict[str, Any]] = json.loads(answer.read())["data"]
        return listed

    def first_model(self) -> str:
        listed = self.models()
        if not listed:
            raise CliError(f"the platform at {self.base} serves no models", 1)
        return str(listed[0]["id"])

    def stream(self, model: str, messages: list[dict[str, str]]) -> Iterator[str]:
        """The content deltas of a streamed chat completion, as they arrive."""
        body = {"model": model, "messages": messages, "stream": True}
        with self._open("POST", "/chat/completions", body) as answer:
            for raw in answer:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line.removeprefix("data:").strip()
                if payload == "[DONE]":
                    return
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise CliError(_message(chunk), 1)
                for choice in chunk.get("choices") or ():
                    if content := (choice.get("delta") or {}).get("content"):
                        yield str(content)

    def _open(self, method: str, path: str, body: object = None) -> Any:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {})}
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)  # noqa: S310 - http(s) only
        try:
            return urllib.request.urlopen(request, timeout=_TIMEOUT)  # noqa: S310 - see above
        except urllib.error.HTTPError as exc:
            raise CliError(f"{_message(_json(exc.read()))} (HTTP {exc.code})", 1) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CliError(
                f"cannot reach the platform at {self.base}: {getattr(reason, 'strerror', None) or reason}; "
                f"is it running? start it with '{self.up}'",
                2,
            ) from None


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace").strip()[:200]


def _message(answer: Any) -> str:
    """The OpenAI-style error's message, on one line."""
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else error or answer
    return " ".join(str(message or "no message").split())


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
