"""The control-plane's admission queue on its own (no loop, no sockets), and the relay's waiting around it."""

from __future__ import annotations

import asyncio
import datetime
import itertools
import time
from pathlib import Path
from typing import Any

import structlog

from iop_control_plane.admission import HOLD, HOLDS_PER_PASS, AdmissionQueue, Hold, Waiter
from iop_control_plane.ledger import LedgerEntry
from iop_control_plane.metrics import ControlPlaneMetrics
from iop_control_plane.nodes import NodeSessions
from iop_control_plane.policy import load_policy
from iop_control_plane.prefix import Prefix, prompt_prefixes
from iop_control_plane.registry import ModelLoad, Registry
from iop_control_plane.relay import RunRelay, _Run
from iop_control_plane.scheduler import Decision, Scheduler
from iop_control_plane.store import AuditStore
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire import IopError


class Slots:
    """``place`` for the queue: ``free`` slots, handed out in order; None once none is left."""

    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self, waiter: Waiter[str]) -> str | None:
        if not self.free:
            return None
        self.free -= 1
        return f"slot for {waiter.caller}"


def _served_order(arrivals: list[tuple[str, int]], *, queue: AdmissionQueue[str] | None = None) -> list[str]:
    """Callers in the order they get one slot each, having queued in ``arrivals`` order (caller, priority)."""
    queue = queue or AdmissionQueue[str](16)
    for caller, priority in arrivals:
        assert queue.offer(Waiter("m", caller, priority))
    order: list[str] = []
    while queue.waiting():
        served = queue.admit(Slots(1), now=0.0)
        if not served:
            break
        order += [waiter.caller for waiter in served]
    return order


def test_priority_first_then_arrival() -> None:
    arrivals = [("a", 0), ("b", 0), ("c", 5), ("d", -1), ("e", 5), ("f", 0)]
    assert _served_order(arrivals) == ["c", "e", "a", "b", "f", "d"]


def test_a_lifo_would_fail_the_order_test() -> None:
    """The same check on a queue made last-in-first-out (arrivals counted down) fails: it does test arrival."""
    arrivals = [("a", 0), ("b", 0), ("c", 5), ("d", 0)]
    assert _served_order(arrivals) == ["c", "a", "b", "d"]
    lifo = AdmissionQueue[str](16)
    lifo._arrivals = itertools.count(0, -1)  # later arrivals sort first
    assert _served_order(arrivals, queue=lifo) == ["c", "d", "b", "a"]  # != the order asserted above


def test_a_full_slot_stops_the_walk_so_nobody_overtakes() -> None:
    queue = AdmissionQueue[str](8)
    waiters = [Waiter[str]("m", name) for name in "abc"]
    for waiter in waiters:
        queue.offer(waiter)
    served = queue.admit(Slots(2), now=0.0)
    assert [waiter.caller for waiter in served] == ["a", "b"]
    assert [waiter.outcome for waiter in served] == ["slot for a", "slot for b"]
    assert waiters[2].outcome is None and queue.depth("m") == 1


def test_a_waiter_holding_for_its_node_lets_those_behind_it_go_its_callers_too() -> None:
    queue = AdmissionQueue[str](64)
    waiters = [Waiter[str]("m", caller) for caller in ("a", "a", "b", "a")]
    for waiter in waiters:
        queue.offer(waiter)
    slots = Slots(2)

    def place(waiter: Waiter[str]) -> str | Hold | None:
        return HOLD if waiter is waiters[0] else slots(waiter)  # the first waits for its full node

    served = queue.admit(place, now=0.0)
    assert served == waiters[1:3]  # then the slots ran out: the last, of a, stays behind the full one
    assert queue.depth("m") == 2 and waiters[0].outcome is None
    served = queue.admit(Slots(1), now=0.0)  # its node freed: it goes first again, in its place
    assert served == [waiters[0]]


def test_a_pick_passes_over_a_bounded_number_of_holding_waiters() -> None:
    queue = AdmissionQueue[str](64)
    bound: list[str] = []
    queue.on_holds_bound = bound.append
    holding = [Waiter[str]("m", f"c{index}") for index in range(HOLDS_PER_PASS + 4)]
    for waiter in [*holding, Waiter[str]("m", "late")]:
        queue.offer(waiter)
    asked: list[Waiter[str]] = []

    def place(waiter: Waiter[str]) -> str | Hold | None:
        asked.append(waiter)
        return HOLD if waiter in holding else "slot"

    assert queue.admit(place, now=0.0) == []
    assert asked == holding[:HOLDS_PER_PASS] and bound == ["m"]  # the rest wait for the next pick


def test_bounded_per_model() -> None:
    queue = AdmissionQueue[str](2)
    assert queue.offer(Waiter("m", "a")) and queue.offer(Waiter("m", "b"))
    assert not queue.offer(Waiter("m", "c"))  # full
    assert queue.offer(Waiter("other", "c"))  # another model has a queue of its own
    assert queue.depths() == {"m": 2, "other": 1}
    assert not AdmissionQueue[str](0).offer(Waiter("m", "a"))


def test_a_withdrawn_waiter_leaves_at_once() -> None:
    queue = AdmissionQueue[str](4)
    waiters = [Waiter[str]("m", name) for name in "abc"]
    for waiter in waiters:
        queue.offer(waiter)
    assert queue.withdraw(waiters[0])  # cancelled, or its deadline passed
    assert not queue.withdraw(waiters[0])
    assert queue.depth("m") == 2
    assert [waiter.caller for waiter in queue.admit(Slots(1), now=0.0)] == ["b"]
    queue.withdraw(waiters[2])
    assert not queue.waiting() and queue.depths() == {}


def test_a_caller_at_its_limit_waits_without_blocking_others() -> None:
    limits: dict[str, int | None] = {"batch": 1}
    queue = AdmissionQueue[str](8, limits.get)
    queue.started("batch")  # batch has its one run in progress
    for caller in ("batch", "chat", "batch"):
        queue.offer(Waiter("m", caller))
    served = queue.admit(Slots(5), now=0.0)
    assert [waiter.caller for waiter in served] == ["chat"]  # batch's waiters are skipped
    assert queue.depth("m") == 2
    queue.ended("batch")

    def place(waiter: Waiter[str]) -> str:
        queue.started(waiter.caller)
        return "slot"

    served = queue.admit(place, now=0.0)
    assert [waiter.caller for waiter in served] == ["batch"]  # one, then it is at its limit again
    assert queue.running["batch"] == 1 and queue.depth("m") == 1


def test_retry_after_follows_the_drain_rate() -> None:
    queue = AdmissionQueue[str](16)
    assert queue.retry_after("m", now=0.0) == 1.0  # nothing drained yet
    for index in range(5):
        queue.offer(Waiter("m", f"c{index}"))
    for second in range(4):  # one admitted per second
        queue.admit(Slots(1), now=float(second))
    assert queue.depth("m") == 1
    assert 1.0 <= queue.retry_after("m", now=3.0) <= 3.0  # (1 waiting + 1) / ~1.3 per second
    assert queue.retry_after("m", now=100.0) == 1.0  # the window has passed


# The relay's waiting, with a registry and no node: a placed run is ended by hand.


def _relay(
    *, size: int = 4, timeout: float = 5.0, policy: str = "", background_yield: float = 1.0
) -> tuple[RunRelay, Registry]:
    registry = Registry()
    registry.register("n1", [ModelLoad("m", capacity=1)])
    scheduler = Scheduler(registry, load_policy(policy))
    sessions = NodeSessions(registry, AuditStore(Path("unused.db")), heartbeat_interval=1.0)
    metrics = ControlPlaneMetrics(registry)
    relay = RunRelay(
        scheduler, sessions, metrics, queue_size=size, queue_timeout=timeout, background_yield=background_yield
    )
    return relay, registry


def _admit(
    relay: RunRelay, caller: str = "c", prompt: tuple[Prefix, ...] = (), **fields: object
) -> asyncio.Task[Decision | IopError]:
    request = pb.RunRequest(run_id="r", model="m", **fields)  # type: ignore[arg-type]
    entry, log = LedgerEntry("r", "edge", "c1", caller, "m"), structlog.get_logger("test")
    no_sink: Any = None  # admission sends nothing
    run = _Run(request, no_sink, caller, None, relay.priority(request, caller), entry, log, prompt=prompt)
    return asyncio.create_task(relay._admit(run))


async def _end(relay: RunRelay, registry: Registry, decision: Decision, caller: str = "c") -> None:
    assert decision.node_id is not None
    registry.finished(decision.node_id, decision.model)
    relay.queue.ended(caller)
    relay.wake()
    await asyncio.sleep(0)


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def _placed(result: Decision | IopError) -> Decision:
    assert isinstance(result, Decision) and result.outcome == "placed", result
    return result


async def test_relay_waits_for_a_slot_then_places() -> None:
    relay, registry = _relay()
    first = _placed(await _admit(relay))
    second = _admit(relay)
    await _settle()
    assert not second.done() and relay.queue.depth("m") == 1
    await _end(relay, registry, first)
    assert _placed(await second).node_id == "n1" and relay.queue.depth("m") == 0
    wait = relay.metrics.registry.get_sample_value(
        "iop_control_plane_queue_wait_seconds_count", {"outcome": "admitted"}
    )
    assert wait == 1


async def test_relay_overflow_and_deadline_are_resource_exhausted() -> None:
    relay, _ = _relay(size=1, timeout=0.05)
    _placed(await _admit(relay))
    waiting = _admit(relay)
    await _settle()
    overflow = await _admit(relay)
    assert isinstance(overflow, IopError) and overflow.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED
    assert overflow.retryable and overflow.retry_after == datetime.timedelta(seconds=1)
    timed_out = await waiting  # queue_timeout 0.05 s
    assert isinstance(timed_out, IopError) and timed_out.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED
    assert timed_out.retryable and timed_out.retry_after is not None
    assert relay.queue.depth("m") == 0


async def test_relay_cancelled_waiter_leaves_the_queue() -> None:
    relay, registry = _relay()
    first = _placed(await _admit(relay))
    waiting = _admit(relay)
    await _settle()
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert relay.queue.depth("m") == 0
    await _end(relay, registry, first)
    assert registry.nodes["n1"].models["m"].load == 0  # nobody took the slot


async def test_relay_priority_and_default_priority_from_policy() -> None:
    relay, registry = _relay(policy="callers: {vip: {priority: 10}}\n")
    first = _placed(await _admit(relay))
    low = _admit(relay, "c")
    high = _admit(relay, "vip")  # no priority in the request: the policy's 10
    await _settle()
    await _end(relay, registry, first)
    await _settle()
    assert high.done() and not low.done()
    low.cancel()
    await asyncio.gather(low, return_exceptions=True)


async def test_relay_a_caller_over_its_limit_waits_while_others_run() -> None:
    relay, registry = _relay(policy="callers: {c: {max_concurrency: 1}}\n")
    registry.register("n1", [ModelLoad("m", capacity=3)])
    first = _placed(await _admit(relay, "c"))
    second = _admit(relay, "c")
    await _settle()
    assert not second.done() and relay.queue.depth("m") == 1  # a slot is free, but c is at its limit
    _placed(await _admit(relay, "d"))  # another caller is not held up
    await _end(relay, registry, first)
    assert _placed(await second).node_id == "n1"
    assert relay.queue.running == {"c": 1, "d": 1}


async def test_relay_a_background_run_waits_for_interactive_first_outputs_on_its_node() -> None:
    relay, registry = _relay()
    registry.register("n1", [ModelLoad("m", capacity=4)])
    interactive = _placed(await _admit(relay))
    arrived = relay._awaiting_first_output("n1")  # as _attempt counts an interactive run until its first output
    background = _admit(relay, priority=-10)
    also = _admit(relay, priority=-10)
    await _settle()
    assert not background.done() and relay.queue.depth("m") == 2  # slots are free, yet they wait
    assert _placed(await _admit(relay)).node_id == "n1"  # an interactive run does not wait behind them
    yields = relay.metrics.registry.get_sample_value("iop_control_plane_background_yields_total")
    assert yields == 1  # the first found every node with room prompted; the second queued behind it
    arrived()
    arrived()  # counted once, however often called
    assert registry.nodes["n1"].awaiting_first_output == 0
    assert _placed(await background).node_id == "n1" and _placed(await also).node_id == "n1"
    await _end(relay, registry, interactive)


async def test_relay_a_background_run_is_held_back_for_background_yield_at_most() -> None:
    relay, registry = _relay(background_yield=0.1)
    registry.register("n1", [ModelLoad("m", capacity=4)])
    relay._awaiting_first_output("n1")  # an interactive run that never sends output
    started = time.monotonic()
    held = await asyncio.wait_for(_admit(relay, priority=-10), 2.0)
    assert _placed(held).node_id == "n1"
    assert 0.09 <= time.monotonic() - started < 1.0
    never, _ = _relay(background_yield=0)  # 0: never held back
    never.scheduler.registry.register("n1", [ModelLoad("m", capacity=4)])
    never._awaiting_first_output("n1")
    assert _placed(await asyncio.wait_for(_admit(never, priority=-10), 0.5)).node_id == "n1"


async def test_relay_a_full_queue_refuses_the_flooders_newest_for_a_caller_under_its_share() -> None:
    relay, registry = _relay(size=2)
    first = _placed(await _admit(relay, "flood"))
    older, newer = _admit(relay, "flood"), _admit(relay, "flood")
    await _settle()
    assert relay.queue.depth("m") == 2  # full
    fair = _admit(relay, "b")
    refused = await asyncio.wait_for(newer, 1.0)
    assert isinstance(refused, IopError) and refused.code == pb.ERROR_CODE_RESOURCE_EXHAUSTED
    assert refused.reason == pb.ERROR_REASON_QUEUE_FULL and refused.retryable
    assert relay.metrics.registry.get_sample_value("iop_control_plane_queue_displaced_total") == 1
    await _end(relay, registry, first, "flood")
    assert _placed(await older).node_id == "n1"  # equal service, earlier: the flood's older run goes first
    assert not fair.done()
    fifo, _ = _relay(size=1, policy="defaults: {fairness: fifo}\n")
    _placed(await _admit(fifo, "flood"))
    waiting = _admit(fifo, "flood")
    await _settle()
    assert isinstance(await _admit(fifo, "b"), IopError)  # fifo: a full queue refuses, as before
    waiting.cancel()
    fair.cancel()
    await asyncio.gather(waiting, fair, return_exceptions=True)


async def test_relay_a_run_waiting_for_its_prefix_node_counts_in_that_nodes_load_until_it_leaves() -> None:
    relay, registry = _relay(policy="defaults: {policy: prefix, prefix_imbalance: 1.0}")
    registry.register("n2", [ModelLoad("m", capacity=1)])
    system = pb.ChatMessage(role=pb.ROLE_SYSTEM, content=[pb.ContentPart(text="a long system prompt")])
    prompt = prompt_prefixes(pb.RunRequest(messages=[system]))
    relay.scheduler.prefixes.record("n1", "m", prompt)
    registry.sent("n1", "m")  # n1's one slot is taken; n2 is idle
    held = _admit(relay, prompt=prompt)
    await _settle()
    assert not held.done() and relay.scheduler.waiting == {"n1": 1}
    assert relay.metrics.prefix_waits.labels("other")._value.get() == 1
    spilled = _placed(await _admit(relay, caller="d", prompt=prompt))  # n1: 1 running + 1 waiting, past 1.0
    assert spilled.node_id == "n2"
    held.cancel()
    await _settle()
    assert relay.scheduler.waiting == {} and relay.queue.depth("m") == 0
