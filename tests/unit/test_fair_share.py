"""Fair share in the admission queue on its own (no loop, no sockets): token counters, weights, the lift
rule, arrival order within a caller, fifo unchanged, and a full queue that makes room for a caller under
its share."""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry

from iop_control_plane.admission import AdmissionQueue, Waiter
from iop_control_plane.fairness import FairShare, ServiceCounters, TokenWeights, estimated_prompt_tokens
from iop_control_plane.policy import Fairness, load_policy
from iop_control_plane.settings import FairnessSettings
from iop_gen.pb.iop import runtime_pb2 as pb


def _one_slot(waiter: Waiter[str]) -> str:
    return f"slot for {waiter.caller}"


def _admit_one(queue: AdmissionQueue[str]) -> Waiter[str]:
    """Admit the one waiter due the next slot."""
    given: list[Waiter[str]] = []

    def place(waiter: Waiter[str]) -> str | None:
        if given:
            return None
        given.append(waiter)
        return "slot"

    served = queue.admit(place, now=0.0)
    assert len(served) == 1
    return served[0]


def _queue(
    fairness: Fairness = "tokens", *, size: int = 64, weights: dict[str, float] | None = None
) -> AdmissionQueue[str]:
    shares = weights or {}
    counters = ServiceCounters(TokenWeights(1.0, 2.0), caller_weight=lambda caller: shares.get(caller, 1.0))
    return AdmissionQueue[str](size, fairness=lambda _: fairness, counters=counters)


def _backlog(queue: AdmissionQueue[str], caller: str, runs: int, prompt_tokens: int = 100) -> list[Waiter[str]]:
    waiters = [Waiter[str]("m", caller, prompt_tokens=prompt_tokens) for _ in range(runs)]
    for waiter in waiters:
        assert queue.offer(waiter)
    return waiters


def test_the_least_served_caller_goes_first_in_proportion_to_its_weight() -> None:
    queue = _queue(weights={"b": 2.0})
    _backlog(queue, "a", 30)  # a arrived first, with all its runs
    _backlog(queue, "b", 30)
    order = [_admit_one(queue).caller for _ in range(30)]
    assert Counter(order) == {"a": 10, "b": 20}  # each admission charges 100 tokens / weight
    assert queue.counters.of("m", "a") == queue.counters.of("m", "b") == 1000


def test_completion_tokens_count_twice_and_the_weights_are_settings() -> None:
    counters = ServiceCounters(TokenWeights(1.0, 2.0))
    counters.charge("m", "a", prompt=10, completion=5)
    assert counters.of("m", "a") == 20
    even = ServiceCounters(TokenWeights(prompt=0.5, completion=1.0), caller_weight=lambda _: 4.0)
    even.charge("m", "a", prompt=10, completion=5)
    assert even.of("m", "a") == (5 + 5) / 4
    assert counters.of("other-model", "a") == 0  # service is counted per model


def test_arrival_order_within_one_caller() -> None:
    queue = _queue()
    mine = _backlog(queue, "a", 3)
    _backlog(queue, "b", 3)
    served = [_admit_one(queue) for _ in range(6)]
    assert [waiter for waiter in served if waiter.caller == "a"] == mine
    assert [waiter.caller for waiter in served] == ["a", "b", "a", "b", "a", "b"]  # equal service: they alternate


def test_a_caller_that_becomes_backlogged_is_lifted_to_the_least_backlogged_counter() -> None:
    queue = _queue()
    _backlog(queue, "a", 10)
    for _ in range(5):
        _admit_one(queue)  # a alone: served 500 tokens
    assert queue.counters.of("m", "a") == 500
    _backlog(queue, "b", 5)  # b was idle meanwhile: no credit banked
    assert queue.counters.of("m", "b") == 500
    order = [_admit_one(queue).caller for _ in range(6)]
    assert order.count("b") == 3  # shared from now on; without the lift b would take all six


def test_a_caller_lifted_level_goes_before_one_with_more_runs_in_progress() -> None:
    queue = _queue()
    _backlog(queue, "a", 10)
    for _ in range(4):
        queue.started(_admit_one(queue).caller)  # a's runs in progress: their output is not charged yet
    _backlog(queue, "b", 2)
    assert queue.counters.of("m", "b") == queue.counters.of("m", "a")  # lifted level, a's head arrived first
    assert _admit_one(queue).caller == "b"  # a's counter lags by four runs' output, b's by none
    queue.started("b")
    assert _admit_one(queue).caller == "a"  # b was charged its prompt: a is the less served now


def test_equal_callers_with_as_many_runs_in_progress_keep_arrival_order() -> None:
    queue = _queue()
    _backlog(queue, "a", 2)
    _backlog(queue, "b", 2)
    queue.started("a")
    queue.started("b")
    assert _admit_one(queue).caller == "a"


def test_an_idle_caller_is_lifted_to_the_models_greatest_counter_when_nobody_waits() -> None:
    queue = _queue()
    queue.counters.charge("m", "a", prompt=800)  # a was served while nobody waited
    queue.counters.charge("m", "c", prompt=200)
    _backlog(queue, "b", 2)  # a busy period starts: level with the most served
    assert queue.counters.of("m", "b") == 800
    queue.counters.charge("m", "b", prompt=50)
    _backlog(queue, "c", 1)
    assert queue.counters.of("m", "c") == 850  # the least backlogged: b's


def test_a_lift_never_lowers_a_counter() -> None:
    queue = _queue()
    queue.counters.charge("m", "a", prompt=300)
    _backlog(queue, "b", 1)  # lifted to a's 300
    queue.counters.charge("m", "c", prompt=900)
    _backlog(queue, "c", 1)
    assert queue.counters.of("m", "c") == 900


def test_fifo_ignores_service() -> None:
    queue = _queue("fifo")
    queue.counters.charge("m", "a", prompt=10_000)
    _backlog(queue, "a", 3)
    _backlog(queue, "b", 3)
    assert [_admit_one(queue).caller for _ in range(6)] == ["a", "a", "a", "b", "b", "b"]


def test_priority_still_comes_first() -> None:
    queue = _queue()
    queue.counters.charge("m", "vip", prompt=10_000)
    _backlog(queue, "a", 2)
    assert queue.offer(Waiter("m", "vip", priority=5))
    assert _admit_one(queue).caller == "vip"  # the most served, but of a higher priority


def test_a_full_queue_makes_room_for_a_caller_under_its_share() -> None:
    queue = _queue(size=4)
    displaced: list[Waiter[str]] = []
    queue.on_displaced = displaced.append
    flood = _backlog(queue, "a", 4)
    newcomer = Waiter[str]("m", "b", prompt_tokens=100)
    assert queue.offer(newcomer)
    assert displaced == [flood[-1]] and flood[-1].displaced  # a's newest gave its place
    assert queue.depth("m") == 4
    assert _admit_one(queue).caller == "a"  # a arrived first at equal service; b next
    assert _admit_one(queue) is newcomer


def test_a_full_queue_still_refuses_when_nobody_holds_more_than_a_share() -> None:
    queue = _queue(size=4)
    _backlog(queue, "a", 2)
    _backlog(queue, "b", 2)
    assert not queue.offer(Waiter("m", "a"))  # b holds no more places than a
    assert not queue.offer(Waiter("m", "c", priority=-1))  # only waiters of no higher priority give way
    queue.counters.charge("m", "a", prompt=1000)
    assert not queue.offer(Waiter("m", "a"))


def test_places_not_service_decide_who_gives_way() -> None:
    queue = _queue(size=4)
    displaced: list[Waiter[str]] = []
    queue.on_displaced = displaced.append
    queue.counters.charge("m", "a", prompt=10_000)  # a was just served far more, yet it holds no place
    flood = _backlog(queue, "b", 4)
    assert queue.offer(Waiter("m", "a"))
    assert displaced == [flood[-1]]
    assert queue.offer(Waiter("m", "a"))  # 2 of 4 places: an equal share
    assert not queue.offer(Waiter("m", "a"))  # a third would be more than its share


def test_fifo_refuses_when_full_as_before() -> None:
    queue = _queue("fifo", size=4)
    _backlog(queue, "a", 4)
    assert not queue.offer(Waiter("m", "b"))


def test_counters_are_bounded_forgetting_the_caller_idle_longest_but_never_a_backlogged_one() -> None:
    forgotten: list[tuple[str, str]] = []
    counters = ServiceCounters(max_callers=3, forgotten=lambda model, caller: forgotten.append((model, caller)))
    queue = AdmissionQueue[str](8, counters=counters)
    assert queue.offer(Waiter("m", "waiting"))  # touched first, but backlogged
    for caller in ("x", "y", "z"):
        counters.charge("m", caller, prompt=10)
    assert forgotten == [("m", "x")] and counters.remembered == 3
    assert counters.of("m", "x") == 0 and counters.of("m", "z") == 10


def test_prompt_tokens_are_estimated_from_the_text() -> None:
    chat = pb.RunRequest(messages=[pb.ChatMessage(content=[pb.ContentPart(text="x" * 40)])])
    assert estimated_prompt_tokens(chat) == 10
    assert estimated_prompt_tokens(pb.RunRequest(prompt=["abcde", "fgh"])) == 2
    assert estimated_prompt_tokens(pb.RunRequest()) == 0


def test_policy_fairness_per_model_and_caller_weights() -> None:
    policy = load_policy("aliases: {big: llama}\nmodels: {llama: {fairness: fifo}}\ncallers: {batch: {weight: 0.5}}\n")
    assert policy.fairness_for("llama") == "fifo" and policy.fairness_for("big") == "fifo"
    assert policy.fairness_for("other") == "tokens"
    assert policy.caller_weight("batch") == 0.5 and policy.caller_weight("anyone") == 1.0


def test_usage_corrects_the_estimate_and_is_counted_by_a_bounded_set_of_labels() -> None:
    registry = CollectorRegistry()
    policy = load_policy("callers: {named: {weight: 2}}\n")
    share = FairShare(FairnessSettings(caller_labels=1), lambda: policy, registry)
    share.counters.charge("m", "a", prompt=10)  # the estimate, at admission
    served = share.charge_served(
        "m", "a", estimate=10, usage=pb.Usage(prompt_tokens=12, completion_tokens=5), outputs=5
    )
    assert served and share.counters.of("m", "a") == 12 + 2 * 5
    # A failover's second attempt that served: its whole prompt, the estimate being corrected already.
    share.charge_served("m", "a", estimate=0, usage=pb.Usage(prompt_tokens=12, completion_tokens=1), outputs=1)
    assert share.counters.of("m", "a") == 12 + 2 * 5 + 12 + 2 * 1
    share.charge_served("m", "b", estimate=3, usage=None, outputs=4)  # no usage: the deltas relayed
    share.charge_served("m", "named", estimate=0, usage=None, outputs=4)
    assert not share.charge_served("m", "failed", estimate=7, usage=None, outputs=0)  # the estimate stands
    assert share.counters.of("m", "named") == 4  # 2 x 4 / weight 2
    assert share.counters.of("m", "failed") == 0

    def tokens(caller: str, kind: str) -> float | None:
        return registry.get_sample_value("iop_control_plane_caller_tokens_total", {"caller": caller, "kind": kind})

    assert tokens("a", "prompt") == 12 + 12 and tokens("a", "completion") == 5 + 1
    assert tokens("other", "completion") == 4  # b: past the one label for callers the policy does not name
    assert tokens("named", "completion") == 4
