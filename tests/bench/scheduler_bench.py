"""Scheduler benchmark: the time of one decision with 1,000 registered nodes, per policy.

Pure Python, one process, no sockets: 1,000 nodes serving 20 models (3 each, capacities 4-32,
half full, zones and GPU labels), status reports arriving meanwhile, and every placed run
finished some decisions later, so loads stay steady. The prefix policy's section: 1,000 nodes
serving one model, 20,000 conversations coming back turn after turn (a tenth new), the index
at its bound of 100,000 prefixes, each prompt made just before its decision (the relay hashes
it just before); beside it, the garbage collections during the decisions and least-loaded on the
same nodes and prompts. Prints p50 and p99 in microseconds;
asserts nothing (target in README: p99 <= 100 us). `python scheduler_bench.py prefix` runs the
prefix policy's section alone.
"""

from __future__ import annotations

import gc
import random
import sys
import time
import tracemalloc
from collections import Counter, deque
from collections.abc import Callable
from functools import partial

from table import print_table

from iop_control_plane.policy import load_policy
from iop_control_plane.prefix import MAX_PREFIXES, Prefix, prompt_prefixes
from iop_control_plane.registry import ModelLoad, Registry, Status
from iop_control_plane.scheduler import Decision, Scheduler
from iop_gen.pb.iop import runtime_pb2 as pb

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
        loads = _loads(rng, rng.sample(model_names, models_per_node))
        continuable = {load.model: frozenset({pb.RUN_KIND_CHAT}) for load in loads} if index % 2 else {}
        registry.register(f"node-{index:04}", loads, labels=labels, continuable=continuable)  # half continue chat
    return Scheduler(registry, load_policy(POLICY))


def _timed(
    scheduler: Scheduler,
    decide: Callable[[int], Decision],
    *,
    reports: bool = True,
    clock: Callable[[], int] = time.perf_counter_ns,
    prepare: Callable[[int], object] | None = None,
    off_core: list[int] | None = None,
) -> tuple[float, ...]:
    """(p50, p99) of ``decide`` in us by ``clock``, and how many were placed; runs finish and nodes report meanwhile.

    ``prepare`` runs before each decision, untimed; ``off_core`` gets each decision's time by
    ``clock`` less its CPU time: the time it waited for a core (read outside the timed span)."""
    rng, registry = random.Random(1), scheduler.registry
    node_ids, running = list(registry.nodes), deque[tuple[str, str]]()
    samples, placed = [], 0
    for index in range(DECISIONS):
        if prepare is not None:
            prepare(index)
        cpu_start = time.thread_time_ns() if off_core is not None else 0
        start = clock()
        decision = decide(index)
        samples.append(clock() - start)
        if off_core is not None:
            off_core.append(samples[-1] - (time.thread_time_ns() - cpu_start))
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
        ("migration: a continuing run, half the nodes continue", lambda i: _continuing(scheduler, "model-08")),
    ]
    rows = [(f"register {NODES:,} nodes x 3 models (all of them)", f"{setup * 1000:.0f} ms")]
    for name, decide in cases:
        p50, p99, placed = _timed(scheduler, decide)
        rows.append((f"decision p50 / p99, {name}", f"{p50:.1f} / {p99:.1f} us ({placed * 100 // DECISIONS}% placed)"))
    everywhere = _cluster(random.Random(8), models_per_node=1, model_names=["one"])
    p50, p99, _ = _timed(everywhere, lambda i: everywhere.choose("one"))
    rows.append((f"decision p50 / p99, least-loaded, one model on all {NODES:,} nodes", f"{p50:.1f} / {p99:.1f} us"))
    rows += _overloaded()
    rows += _prefix_rows()
    print_table(rows, unit=f"{NODES:,} nodes")


def _continuing(scheduler: Scheduler, model: str) -> Decision:
    """A run cut after output, placed again on a node that can continue chat (not the one it was on)."""
    return scheduler.choose(model, exclude={"node-0001"}, continuing=pb.RUN_KIND_CHAT)


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


# The prefix policy: 1,000 nodes, 100,000 remembered prefixes, conversations that come back

CONVERSATIONS = 20_000
NEW_SHARE = 0.1  # decisions that start a conversation never seen
PREFIX_MEMORY = 100_000


def _prefix_rows() -> list[tuple[str, str]]:
    """Decision time and hits with the index at its bound; what hashing a prompt and the index's memory cost."""
    rng = random.Random(9)
    scheduler = _cluster(rng, models_per_node=1, model_names=["chat"])
    scheduler.apply(load_policy("defaults: {policy: prefix}"))
    assert scheduler.prefixes.limit == PREFIX_MEMORY  # the default bound
    conversations = _Conversations(rng)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    while len(scheduler.prefixes) < PREFIX_MEMORY:  # fill: conversations placed as they would be
        decision = scheduler.choose("chat", prompt=conversations.next_turn())
        assert decision.node_id is not None
        scheduler.registry.finished(decision.node_id, decision.model)
    memory = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    reasons: Counter[str] = Counter()
    prompt: list[tuple[Prefix, ...]] = [()]

    def next_prompt(index: int) -> None:  # hashed just before the decision, as the relay does
        prompt[0] = conversations.next_turn()

    def decide(index: int) -> Decision:
        decision = scheduler.choose("chat", prompt=prompt[0])
        reasons[decision.prefix or decision.outcome] += 1
        return decision

    pauses, off_core = _Collections(), list[int]()
    gc.callbacks.append(pauses)
    p50, p99, placed = _timed(scheduler, decide, prepare=next_prompt, off_core=off_core)
    gc.callbacks.remove(pauses)
    hits, imbalance = (reasons[reason] * 100 // max(1, placed) for reason in ("hit", "imbalance"))
    name = f"decision p50 / p99, prefix, {len(scheduler.prefixes):,} remembered prefixes"
    rows = [(name, f"{p50:.1f} / {p99:.1f} us ({hits}% hits, {imbalance}% imbalance)")]
    rows.append((f"{name}: garbage collections meanwhile", pauses.summary()))
    waited = sum(wait > 500_000 for wait in off_core)  # past 1% of them, the p99 is the machine's, not the work's
    rows.append((f"{name}: decisions that waited > 0.5 ms for a core", f"{waited} ({waited * 100 / DECISIONS:.1f}%)"))
    cpu50, cpu99, _ = _timed(scheduler, decide, clock=time.thread_time_ns, prepare=next_prompt)  # no core waits
    rows.append((f"{name}: CPU time of the decision", f"{cpu50:.1f} / {cpu99:.1f} us"))
    scheduler.apply(load_policy("defaults: {policy: least-loaded}"))  # the same cluster, prompts and run
    p50, p99, _ = _timed(scheduler, decide, prepare=next_prompt)
    cpu50, cpu99, _ = _timed(scheduler, decide, clock=time.thread_time_ns, prepare=next_prompt)
    same = f"decision p50 / p99, least-loaded on the same {NODES:,} nodes: wall; CPU time"
    rows.append((same, f"{p50:.1f} / {p99:.1f}; {cpu50:.1f} / {cpu99:.1f} us"))
    rows.append((f"prefix index memory, {len(scheduler.prefixes):,} entries", f"{memory / 2**20:.1f} MiB"))
    return rows + _hashing_rows()


class _Collections:
    """A ``gc.callbacks`` entry: how many collections ran and how long each took."""

    def __init__(self) -> None:
        self.took: list[int] = []
        self._start = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        else:
            self.took.append(time.perf_counter_ns() - self._start)

    def summary(self) -> str:
        longest = max(self.took, default=0) / 1000
        return f"{len(self.took)} in {DECISIONS:,} decisions, the longest {longest:.0f} us"


class _Conversations:
    """20,000 chats, each a system prompt (~2,000 bytes) and turns of two ~300-byte messages."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._turns = [rng.randint(0, 10) for _ in range(CONVERSATIONS)]
        self._starts = [rng.getrandbits(60) for _ in range(CONVERSATIONS)]

    def next_turn(self) -> tuple[Prefix, ...]:
        """The prompt of the next turn of a random conversation (a tenth of the time: a new one in its place)."""
        rng, which = self._rng, self._rng.randrange(CONVERSATIONS)
        if rng.random() < NEW_SHARE:
            self._starts[which], self._turns[which] = rng.getrandbits(60), 0
        self._turns[which] += 1
        messages = min(1 + 2 * self._turns[which], MAX_PREFIXES)
        return tuple(Prefix(self._starts[which] + index, 2000 + 300 * index) for index in range(messages))


def _hashing_rows() -> list[tuple[str, str]]:
    """What the relay spends once per run hashing a prompt (not part of a decision)."""
    system = pb.ChatMessage(role=pb.ROLE_SYSTEM, content=[pb.ContentPart(text="s" * 2000)])
    turn = [
        pb.ChatMessage(role=role, content=[pb.ContentPart(text="t" * 300)])
        for role in (pb.ROLE_USER, pb.ROLE_ASSISTANT)
    ]
    chat = pb.RunRequest(kind=pb.RUN_KIND_CHAT, messages=[system, *turn * 10])
    completion = pb.RunRequest(kind=pb.RUN_KIND_COMPLETION, prompt=["c" * 16_384])
    rows = []
    for name, request in (("chat of 21 messages, 8 kB", chat), ("completion prompt of 16,384 characters", completion)):
        start = time.perf_counter_ns()
        for _ in range(1000):
            prompt_prefixes(request)
        rows.append((f"hashing a run's prompt prefixes, {name}", f"{(time.perf_counter_ns() - start) / 1e6:.1f} us"))
    return rows


if __name__ == "__main__":
    if sys.argv[1:] == ["prefix"]:  # the prefix policy's section alone
        print_table(_prefix_rows(), unit=f"{NODES:,} nodes")
    else:
        main()
