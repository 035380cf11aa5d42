"""What the join tests share: ``iop`` as a subprocess, the ``iop join`` line a token prints, the
platform's answers (nodes, the run ledger) read through the CLI as an operator reads them.

A command runs through a :data:`Runner`: here (``local``) or on another machine (``ip netns exec``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

from .conftest import wait_for

IOP = [sys.executable, "-m", "iop_cli.main"]
# No state folder, key or address from the environment: each command names its own.
ENV = {
    k: v
    for k, v in os.environ.items()
    if k not in ("IOP_STATE_DIR", "IOP_API_KEY", "IOP_CONTROL_PLANE", "IOP_WORKER", "PYTHONPATH", "VIRTUAL_ENV")
}
Runner = Callable[..., "subprocess.CompletedProcess[str]"]
"""Runs a command (its words) with an optional ``timeout=``; the finished process, output as text."""


def local(*command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A command on this machine."""
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=ENV)


def done(result: subprocess.CompletedProcess[str]) -> str:
    """The output of a command that must have succeeded (else the failure shows what it printed)."""
    assert result.returncode == 0, (
        f"{shlex.join(result.args)}: exit {result.returncode}\n{result.stdout}{result.stderr}"
    )
    return result.stdout


def refused(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused command printed: exit 2, nothing on stdout, one line on stderr."""
    said = f"{shlex.join(result.args)}: exit {result.returncode}\n{result.stdout}{result.stderr}"
    assert result.returncode == 2, said
    assert len(result.stderr.strip().splitlines()) == 1, said
    return result.stderr.strip()


def join_line(created: subprocess.CompletedProcess[str]) -> list[str]:
    """The words of the one command line ``iop join-token create`` printed: ``iop join ADDRESS --token T --ca H``."""
    lines = done(created).strip().splitlines()
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    assert words[:2] == ["iop", "join"], words
    assert {"--token", "--ca"} <= set(words), words
    return words


def option(words: list[str], name: str) -> str:
    """The value after ``name`` in a command line's words."""
    return words[words.index(name) + 1]


def token_id(token: str) -> str:
    """The public half of a join token ``iopjt-<id>.<secret>``."""
    return token.removeprefix("iopjt-").partition(".")[0]


def nodes(run: Runner, state: Path) -> dict[str, dict[str, Any]]:
    """``iop nodes ls --json`` of the control-plane ``iop up`` started in ``state``, by node id."""
    listed = json.loads(done(run(*IOP, "nodes", "ls", "--json", "--dir", str(state))))
    return {node["node_id"]: node for node in listed}


def ledger(run: Runner, state: Path, run_ids: list[str]) -> dict[str, str]:
    """The node each run ended on, from the control-plane's run ledger (waited for: it is written as runs end)."""
    command = (*IOP, "runs", "ls", "--control-plane", "--json", "--limit", "200", "--dir", str(state))

    def read() -> dict[str, str] | None:
        found = {entry["run_id"]: entry["node_id"] for entry in json.loads(done(run(*command)))}
        return found if set(run_ids) <= found.keys() else None

    found: dict[str, str] = wait_for(read, 15, 0.2, f"runs {run_ids} in the ledger")
    return {run_id: found[run_id] for run_id in run_ids}


def chat(client: openai.OpenAI, model: str) -> str:
    """One chat completion through the edge; its run id (``x-request-id``)."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hello from another machine"}], max_tokens=4
    )
    assert raw.parse().choices[0].message.content
    return raw.headers["x-request-id"]


def client(base_url: str, state: Path) -> openai.OpenAI:
    """The official SDK with the key ``iop up`` made in ``state`` (no retries: every refusal is seen)."""
    key = (state / "api-key").read_text().strip()
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30.0)


def ready_port(state: Path, service: str) -> int:
    """The port a service ``iop up`` started in ``state`` listens on (its ready file)."""
    return int(json.loads((state / f"{service}.ready").read_text())["port"])
