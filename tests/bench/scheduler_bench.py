"""Scheduler benchmark: the time of one decision with 1,000 registered nodes, per policy.

Pure Python, one process, no sockets: 1,000 nodes serving 20 models (3 each, capacities 4-32,
half full, zones and GPU labels), status reports arriving meanwhile, and every placed run
finished some decisions later, so loads stay steady. Prints p50 and p99 in microseconds;
asserts nothing (target in README: p99 <= 100 us).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from functools import partial

from table import print_table

from iop_control_plane.policy import load_policy
from iop_control_plane.registry import ModelLoad, Registry, Status
from iop_control_plane.scheduler import Decision, Scheduler

NODES = 1000
MODELS = [f"model-{index:02}" for index in range(20)]
DECISIONS = 20_000
IN_FLIGHT = 200  # placed runs not yet finished (a tenth of the free slots of a model with labels)
REPORT_EVERY = 10  # decisions between two status reports (1,000 nodes x 1 report / 30 s ~ 33/s)

POLICY = """
models:
  model-01: {policy: round-robin}
  model-02: {policy: session-affinity}
  model-03: {labels: {gpu: h100}}
routes:
  chat: {model-04: 90, model-05: 10}
"""


def _loads(rng: random.Random, models: list[str]) -> list[ModelLoad]:
    loads = []
    for model in models:
        capacity = rng.choice((4, 8, 16, 32))
        loads.append(ModelLoad(model, in_flight=rng.randint(0, capacity // 2), capacity=capacity))
    return loads


def _cluster(rng: random.Random, models_per_node: int = 3, model_names: list[str] = MODELS) -> Scheduler:
    registry = Registry()
    for index in range(NODES):
        labels = {"zone": rng.choice("abc"), "gpu": rng.choice(("h100", "a100", "l4"))}
        registry.register(f"node-{index:04}", _loads(rng, rng.sample(model_names, models_per_node)), labels=labels)
    return Scheduler(registry, load_policy(POLICY))


def _timed(scheduler: Scheduler, decide: Callable[[int], Decision], *, reports: bool = True) -> tuple[float, ...]:
    """(p50, p99) of ``decide`` in us, and how many were placed; runs finish and nodes report meanwhile."""
    rng, registry = random.Random(1), scheduler.registry
    node_ids, running = list(registry.nodes), deque[tuple[str, str]]()
    samples, placed = [], 0
    for index in range(DECISIONS):
        start = time.perf_counter_ns()
        decision = decide(index)
        samples.append(time.perf_counter_ns() - start)
        if decision.node_id is not None:
            placed += 1
            running.append((decision.node_id, decision.model))
        if len(running) > IN_FLIGHT:
            registry.finished(*running.popleft())
        if reports and index % REPORT_EVERY == 0:
            node = registry.nodes[rng.choice(node_ids)]
            registry.report(Status(node.node_id, tuple(_loads(rng, list(node.models)))))
    samples.sort()
    return samples[len(samples) // 2] / 1000, samples[len(samples) * 99 // 100] / 1000, placed


def main() -> None:
    rng = random.Random(7)
    start = time.perf_counter()
    scheduler = _cluster(rng)
    setup = time.perf_counter() - start
    cases: list[tuple[str, Callable[[int], Decision]]] = [
        ("least-loaded", lambda i: scheduler.choose("model-00")),
        ("round-robin", lambda i: scheduler.choose("model-01")),
        ("session-affinity, 5,000 sessions", lambda i: scheduler.choose("model-02", session=f"s-{i % 5000}")),
        ("least-loaded, policy labels gpu=h100", lambda i: scheduler.choose("model-03")),
        ("weighted route 90/10 over least-loaded", lambda i: scheduler.choose("chat")),
        ("least-loaded, call labels zone=a", lambda i: scheduler.choose("model-06", labels={"zone": "a"})),
        ("failover: least-loaded excluding 2 tried", lambda i: _failover(scheduler, "model-07")),
        ("any of 20 models, policy of each", lambda i: scheduler.choose(MODELS[i % 20], session=f"s-{i % 997}")),
    ]
    rows = [(f"register {NODES:,} nodes x 3 models (all of them)", f"{setup * 1000:.0f} ms")]
    for name, decide in cases:
        p50, p99, placed = _timed(scheduler, decide)
        rows.append((f"decision p50 / p99, {name}", f"{p50:.1f} / {p99:.1f} us ({placed * 100 // DECISIONS}% placed)"))
    everywhere = _cluster(random.Random(8), models_per_node=1, model_names=["one"])
    p50, p99, _ = _timed(everywhere, lambda i: everywhere.choose("one"))
    rows.append((f"decision p50 / p99, least-loaded, one model on all {NODES:,} nodes", f"{p50:.1f} / {p99:.1f} us"))
    rows += _overloaded()
    print_table(rows, unit=f"{NODES:,} nodes")


def _overloaded() -> list[tuple[str, str]]:
    """Every candidate full: the decision is all_busy (the run waits); the cost of finding that out."""
    rows = []
    for policy in ("least-loaded", "round-robin", "session-affinity"):
        registry = Registry()
        for index in range(NODES):
            registry.register(f"node-{index:04}", [ModelLoad("m", in_flight=8, capacity=8)])
        scheduler = Scheduler(registry, load_policy(f"defaults: {{policy: {policy}}}"))
        p50, p99, placed = _timed(scheduler, partial(_session_run, scheduler), reports=False)
        assert placed == 0
        rows.append((f"decision p50 / p99, {policy}, all {NODES:,} candidates full", f"{p50:.1f} / {p99:.1f} us"))
    return rows


def _session_run(scheduler: Scheduler, index: int) -> Decision:
    return scheduler.choose("m", session=f"s-{index}")


def _failover(scheduler: Scheduler, model: str) -> Decision:
    """A third attempt: the two nodes tried are the two least loaded now."""
    pool = scheduler.registry.pool(model)
    assert pool is not None
    tried = frozenset(list(pool.views)[:2])
    return scheduler.choose(model, exclude=tried)


if __name__ == "__main__":
    main()
