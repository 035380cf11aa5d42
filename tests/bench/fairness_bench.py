"""Fair share between callers: a flood against a light caller, and two backlogged callers, FIFO against fair.

``iop control-plane`` runs as its own process on core 0; two ``iop node`` processes (mock adapter)
on core 1 with this client: first with 8 slots each (a llama.cpp-class server), then 32 (a server
that batches many runs, vLLM-class). Every run simulates a real one through the mock's
per-request options: a prefill (``mock.ttft``) of its prompt's length at PREFILL_RATE tokens/s,
then an output of 10-100 tokens (``max_tokens``) at PACE tokens/s, so runs end at staggered
times. Arrivals are open-loop (Poisson); a refused run is not retried. Each phase has callers of
its own, so counters never carry over; the policy's ``fairness`` is switched between phases.

(a) A floods at 10x the model's capacity, B sends 20% of it: B's TTFT against B alone, the share
of B's runs that got output, A's and the total output tokens/s; beside the fair row, the best TTFT
any non-preemptive scheduler could have given B from that phase's own run endings (each B run takes
the first slot that freed after it arrived and no earlier B run took, plus its prefill).
(b) A at 10x capacity, B at 2x an equal share (both backlogged): the weighted service (prompt + 2x
completion tokens, as they arrive) each received per 10 s window, and its difference.

Prints a table; asserts nothing.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from control_plane_bench import _spawn, _until_registered, _wait_ready, stop
from table import print_table

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.certs import init_dir, tls_section
from iop_wire.connection import Connection
from iop_wire.endpoint import dial
from iop_wire.logs import configure
from iop_wire.tls import TlsConfig

MODEL, NODES = "m", ("node-0", "node-1")
SLOTS = {"llama.cpp-class": 8, "vLLM-class": 32}
"""Runs a node takes at once: a llama.cpp server's few slots, and a server that batches many (vLLM's
default is 256). B's wait for a slot is the time to the next run's end, about 1 / capacity: with 8
slots no scheduler that does not interrupt runs can hold B's p99 within 1.5x of alone; with 32 it can."""
PREFILL_RATE, PACE = 4000, 50
PROMPTS, OUTPUTS = (200, 1000), (10, 100)
MEAN_RUN = sum(PROMPTS) / 2 / PREFILL_RATE + sum(OUTPUTS) / 2 / PACE
ALONE_SECONDS, FLOOD_SECONDS, WINDOW, WINDOWS, WARM_UP = 10.0, 15.0, 10.0, 2, 3.0


@dataclass
class Run:
    """One run as the client saw it."""

    caller: str
    sent: float
    prompt: int
    prefill: float
    first: float | None = None
    ended: float | None = None
    completed: bool = False
    error: str = ""
    """The error's code and reason, if it ended with one."""
    deltas: list[float] = field(default_factory=list)


def _cp_config(state: Path) -> Path:
    data = {
        "listen": {"port": 0},
        "tls": tls_section(state / "certs", "control-plane"),
        "store_path": str(state / "cp.db"),
        "log_level": "warning",
    }
    path = state / "cp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _capacity(slots: int) -> float:
    """Runs per second the model serves with ``slots`` per node."""
    return len(NODES) * slots / MEAN_RUN


def _node_config(state: Path, node_id: str, cp_port: int, slots: int) -> Path:
    route = {"model": MODEL, "adapter": "mock", "max_concurrency": slots, "options": {"tokens_per_second": PACE}}
    data = {
        "node_id": node_id,
        "listen": {"enabled": False},
        "tls": tls_section(state / "certs", "node"),
        "store_path": str(state / f"{node_id}.db"),
        "log_level": "warning",
        "control_plane": {"address": f"127.0.0.1:{cp_port}", "server_name": "localhost"},
        "routes": [route],
    }
    path = state / f"{node_id}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@contextmanager
def _platform(state: Path, slots: int) -> Iterator[int]:
    """Control-plane on core 0, the nodes (``slots`` each) on core 1: the control-plane's port."""
    state.mkdir(parents=True)
    init_dir(state / "certs")
    processes = []
    try:
        ready = state / "cp.ready"
        cp = _spawn(0, "control-plane", "--config", str(_cp_config(state)), "--ready-file", str(ready))
        processes.append(cp)
        port = int(_wait_ready(ready, cp)["port"])
        for node_id in NODES:
            ready = state / f"{node_id}.ready"
            config = _node_config(state, node_id, port, slots)
            node = _spawn(1, "node", "--config", str(config), "--ready-file", str(ready))
            processes.append(node)
            _wait_ready(ready, node)
        yield port
    finally:
        stop(processes)


def _request(caller: str, run_id: str, rng: random.Random) -> tuple[pb.RunRequest, Run]:
    prompt, output = rng.randint(*PROMPTS), rng.randint(*OUTPUTS)
    prefill = prompt / PREFILL_RATE
    request = pb.RunRequest(
        run_id=run_id,
        model=MODEL,
        stream=True,
        caller=pb.Caller(id=caller),
        sampling=pb.Sampling(max_tokens=output),
        messages=[pb.ChatMessage(role=pb.ROLE_USER, content=[pb.ContentPart(text="tok " * prompt)])],
        metadata={"mock.ttft": f"{prefill:.4f}", "mock.tokens": str(output)},
    )
    return request, Run(caller, time.monotonic(), prompt, prefill)


async def _one(connection: Connection, request: pb.RunRequest, run: Run) -> None:
    """Read one run to its end (or until cancelled at the end of the phase), noting what arrived when."""
    async with await connection.open_run(request) as stream:
        async for event in stream:
            now = time.monotonic()
            kind = event.WhichOneof("event")
            if kind == "delta":
                run.first = run.first or now
                run.deltas.append(now)
            elif kind in ("complete", "error"):
                run.ended, run.completed = now, kind == "complete"
                if kind == "error":
                    run.error = f"{pb.ErrorCode.Name(event.error.code)} {pb.ErrorReason.Name(event.error.reason)}"


async def _phase(port: int, tls: TlsConfig, rates: dict[str, float], seconds: float) -> tuple[list[Run], float]:
    """Send each caller's runs at its rate (Poisson) for ``seconds``: every run, and when the phase began."""
    runs: list[Run] = []
    tasks: set[asyncio.Task[None]] = set()
    began = time.monotonic()

    async def arrivals(connection: Connection, caller: str, rate: float, rng: random.Random) -> None:
        for index in range(1_000_000):
            await asyncio.sleep(rng.expovariate(rate))
            if time.monotonic() - began >= seconds:
                return
            request, run = _request(caller, f"{caller}-{index}", rng)
            runs.append(run)
            task = asyncio.create_task(_one(connection, request, run))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    connections = [await dial("127.0.0.1", port, tls=tls, server_hostname="localhost") for _ in rates]
    try:
        callers = zip(connections, rates.items(), strict=True)
        await asyncio.gather(*(arrivals(c, caller, rate, _rng(caller)) for c, (caller, rate) in callers))
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for connection in connections:
            await connection.close()
    await asyncio.sleep(1.0)  # the cancelled runs leave the nodes
    return runs, began


def _rng(caller: str) -> random.Random:
    """The same arrivals and runs for a role (``a``, ``b``) in every phase: FIFO and fair see one workload."""
    return random.Random(caller.split("-", maxsplit=1)[0])


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _ttfts(runs: list[Run], caller: str) -> list[float]:
    return [run.first - run.sent for run in runs if run.caller == caller and run.first is not None]


def _best_ttfts(runs: list[Run], caller: str, overhead: float) -> list[float]:
    """TTFTs ``caller`` would have had taking, in arrival order, the first slot freed after each arrival that
    no earlier run of its took (every slot is busy under the flood), plus its prefill and the hop's overhead."""
    ends = sorted(run.ended for run in runs if run.completed and run.ended is not None)
    best, taken = [], 0
    for run in sorted((run for run in runs if run.caller == caller), key=lambda run: run.sent):
        while taken < len(ends) and ends[taken] < run.sent:
            taken += 1
        if taken == len(ends):
            break
        best.append(ends[taken] - run.sent + run.prefill + overhead)
        taken += 1
    return best


def _tokens_per_second(runs: list[Run], began: float, seconds: float, caller: str | None = None) -> float:
    window = (began, began + seconds)
    picked = [run for run in runs if caller is None or run.caller == caller]
    return sum(window[0] <= at < window[1] for run in picked for at in run.deltas) / seconds


def _served_share(runs: list[Run], caller: str) -> float:
    mine = [run for run in runs if run.caller == caller]
    return sum(run.first is not None for run in mine) / len(mine)


def _refused(runs: list[Run], caller: str) -> int:
    return sum(run.caller == caller and run.error.endswith("QUEUE_FULL") for run in runs)


def _service_gaps(runs: list[Run], began: float, callers: tuple[str, str]) -> list[float]:
    """|service of one - service of the other| per window after the warm-up: prompt tokens at the first
    delta, 2 per completion token as it arrives."""
    gaps = []
    for index in range(WINDOWS):
        start = began + WARM_UP + index * WINDOW
        service = dict.fromkeys(callers, 0.0)
        for run in runs:
            if run.first is not None and start <= run.first < start + WINDOW:
                service[run.caller] += run.prompt
            service[run.caller] += 2 * sum(start <= at < start + WINDOW for at in run.deltas)
        gaps.append(abs(service[callers[0]] - service[callers[1]]))
    return gaps


async def _fairness(admin: Connection, fairness: str) -> None:
    await admin.request(pb.Envelope(policy_apply=pb.PolicyApply(yaml=f"defaults: {{fairness: {fairness}}}\n")))


async def _flood_rows(port: int, tls: TlsConfig, admin: Connection, slots: int) -> list[tuple[str, str]]:
    capacity = _capacity(slots)
    alone, _ = await _phase(port, tls, {"b-alone": 0.2 * capacity}, ALONE_SECONDS)
    alone_ttft = _ttfts(alone, "b-alone")
    overhead = statistics.median(run.first - run.sent - run.prefill for run in alone if run.first is not None)
    alone_p50, alone_p99 = _percentile(alone_ttft, 0.5), _percentile(alone_ttft, 0.99)
    rows = [
        (f"(a) B alone at 20% of capacity ({len(alone)} runs): TTFT p50 / p99", f"{alone_p50:.3f} / {alone_p99:.3f} s")
    ]
    throughput = {}
    for fairness in ("fifo", "tokens"):
        await _fairness(admin, fairness)
        a, b = f"a-{fairness}", f"b-{fairness}"
        runs, began = await _phase(port, tls, {a: 10 * capacity, b: 0.2 * capacity}, FLOOD_SECONDS)
        ttft, best = _ttfts(runs, b), _best_ttfts(runs, b, overhead)
        p50, p99 = _percentile(ttft, 0.5), _percentile(ttft, 0.99)
        total = _tokens_per_second(runs, began, FLOOD_SECONDS)
        throughput[fairness] = total
        name = f"(a) {fairness}: A at 10x capacity, B at 20%"
        rows += [
            (
                f"{name}: B TTFT p50 / p99 of {len(ttft)} runs served (p99 / alone p99)",
                f"{p50:.3f} / {p99:.3f} s ({p99 / alone_p99:.1f}x)",
            ),
            (
                f"{name}: best non-preemptive B TTFT p50 / p99 from the phase's run endings (p99 / alone p99)",
                f"{_percentile(best, 0.5):.3f} / {_percentile(best, 0.99):.3f} s"
                f" ({_percentile(best, 0.99) / alone_p99:.1f}x)",
            ),
            (
                f"{name}: B's runs given output (share of its demand); refused QUEUE_FULL",
                f"{_served_share(runs, b):.0%}; {_refused(runs, b)} of {sum(run.caller == b for run in runs)}",
            ),
            (
                f"{name}: output tokens/s, A / total",
                f"{_tokens_per_second(runs, began, FLOOD_SECONDS, a):.0f} / {total:.0f}",
            ),
        ]
    rows.append(("(a) fair total throughput / fifo's", f"{throughput['tokens'] / throughput['fifo']:.1%}"))
    return rows


async def _backlogged_rows(port: int, tls: TlsConfig, admin: Connection, slots: int) -> list[tuple[str, str]]:
    capacity = _capacity(slots)
    rows, gaps = [], {}
    for fairness in ("fifo", "tokens"):
        await _fairness(admin, fairness)
        a, b = f"a2-{fairness}", f"b2-{fairness}"
        seconds = WARM_UP + WINDOWS * WINDOW
        runs, began = await _phase(port, tls, {a: 10 * capacity, b: 2 * capacity / 2}, seconds)
        gaps[fairness] = statistics.mean(_service_gaps(runs, began, (a, b)))
        rows.append(
            (
                f"(b) {fairness}: A at 10x, B at 2x an equal share: service difference per {WINDOW:.0f} s window",
                f"{gaps[fairness]:,.0f} tokens",
            )
        )
    rows.append(("(b) fifo's difference / fair's", f"{gaps['fifo'] / max(gaps['tokens'], 1):.1f}x"))
    return rows


async def _bench(port: int, certs: Path, name: str, slots: int) -> list[tuple[str, str]]:
    def tls(name: str) -> TlsConfig:
        return TlsConfig(enabled=True, cert=certs / f"{name}.crt", key=certs / f"{name}.key", ca=certs / "ca.crt")

    async with dial("127.0.0.1", port, tls=tls("admin"), server_hostname="localhost") as admin:
        await asyncio.wait_for(_until_registered(admin, len(NODES)), 60)
        rows = [
            (
                f"{name} nodes: {len(NODES)} x {slots} slots, runs of {MEAN_RUN:.2f} s on average: capacity",
                f"{_capacity(slots):.1f} runs/s",
            )
        ]
        rows += await _flood_rows(port, tls("edge"), admin, slots)
        if slots == SLOTS["llama.cpp-class"]:  # (b) once: its figure does not hang on a slot's wait
            rows += await _backlogged_rows(port, tls("edge"), admin, slots)
    return rows


def main() -> None:
    configure("warning")
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        for name, slots in SLOTS.items():
            with _platform(state / name, slots) as port:
                rows += asyncio.run(_bench(port, state / name / "certs", name, slots))
    print_table(rows)


if __name__ == "__main__":
    main()
