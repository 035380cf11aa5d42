"""The scheduler on its own: spread by policy, weighted routes, session affinity, candidate filters; no sockets."""

from __future__ import annotations

import tracemalloc
from collections import Counter, deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop_control_plane.policy import load_policy
from iop_control_plane.registry import ModelLoad, NodeState, Registry, Status
from iop_control_plane.ring import HashRing
from iop_control_plane.scheduler import Decision, Scheduler


def _scheduler(policy: str = "", **capacities: int) -> Scheduler:
    """Nodes named by the keywords, each serving model "m" with that capacity."""
    registry = Registry()
    for node_id, capacity in capacities.items():
        registry.register(node_id, [ModelLoad("m", capacity=capacity)])
    return Scheduler(registry, load_policy(policy))


def _placed(decision: Decision) -> str:
    assert decision.outcome == "placed", decision
    assert decision.node_id is not None
    return decision.node_id


def _spread(scheduler: Scheduler, decisions: int, in_flight: int, model: str = "m") -> Counter[str]:
    """Runs per node over ``decisions`` placements, keeping ``in_flight`` runs going (the oldest ends first)."""
    running: deque[tuple[str, str]] = deque()
    placed: Counter[str] = Counter()
    for _ in range(decisions):
        decision = scheduler.choose(model)
        placed[_placed(decision)] += 1
        running.append((_placed(decision), decision.model))
        if len(running) >= in_flight:
            scheduler.registry.finished(*running.popleft())
    return placed


# Continuation


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin", "session-affinity", "prefix"])
def test_a_continuing_run_goes_only_to_nodes_that_can_continue_its_kind(policy: str) -> None:
    registry = Registry()
    chat, completion = 1, 2  # pb.RUN_KIND_CHAT, pb.RUN_KIND_COMPLETION
    registry.register("plain", [ModelLoad("m", capacity=100)])
    registry.register("chats", [ModelLoad("m", capacity=1)], continuable={"m": frozenset({chat})})
    registry.register("both", [ModelLoad("m", capacity=1)], continuable={"m": frozenset({chat, completion})})
    scheduler = Scheduler(registry, load_policy(f"defaults: {{policy: {policy}}}"))
    assert _placed(scheduler.choose("m", caller="c", continuing=completion)) == "both"
    assert {_placed(scheduler.choose("m", caller="c", continuing=chat, exclude={"both"}))} == {"chats"}
    busy = scheduler.choose("m", caller="c", continuing=chat)  # both continuable nodes full: the run waits
    assert busy.outcome == "all_busy"
    none = scheduler.choose("m", caller="c", continuing=completion, exclude={"both"})
    assert none.outcome == "no_candidate" and "can continue a run of its kind" in none.reason
    assert _placed(scheduler.choose("m", caller="c")) == "plain"  # a run that continues nothing: every node


def test_a_count_goes_only_to_nodes_whose_model_counts_and_is_unsupported_where_none_does() -> None:
    registry = Registry()
    chat, count = 1, 4  # pb.RUN_KIND_CHAT, pb.RUN_KIND_COUNT_TOKENS
    registry.register("cli", [ModelLoad("m", capacity=100), ModelLoad("c", capacity=9)], kinds={"m": frozenset({chat})})
    registry.register("mock", [ModelLoad("m", capacity=1)], kinds={"m": frozenset({chat, count})})
    scheduler = Scheduler(registry, load_policy(""))
    assert _placed(scheduler.choose("m", kind=count)) == "mock"
    assert scheduler.choose("m", kind=count).outcome == "all_busy", "the counting node is full: the run waits"
    assert _placed(scheduler.choose("m", kind=chat)) == "cli"  # other kinds are placed as before
    registry.mark("mock", NodeState.UNAVAILABLE, "gone a moment")
    unready = scheduler.choose("m", kind=count)
    assert unready.outcome == "no_candidate" and "can count tokens" in unready.reason, "it may come back"
    refused = scheduler.choose("c", kind=count)
    assert (refused.outcome, refused.reason) == ("unsupported_kind", "no node serving 'c' can count tokens")
    registry.set_capabilities("cli", {}, {"m": frozenset({chat}), "c": frozenset({chat, count})})  # a reload
    assert _placed(scheduler.choose("c", kind=count)) == "cli"


# Least-loaded


def test_least_loaded_gives_unequal_nodes_runs_in_proportion_to_their_capacity() -> None:
    spread = _spread(_scheduler(small=2, medium=4, large=8), decisions=1400, in_flight=7)
    for node_id, share in {"small": 2 / 14, "medium": 4 / 14, "large": 8 / 14}.items():
        assert spread[node_id] / 1400 == pytest.approx(share, abs=0.02)  # in practice exact: 200/400/800


def test_least_loaded_counts_the_reported_load_and_the_runs_sent_since() -> None:
    scheduler = _scheduler(a=4, b=4)
    scheduler.registry.report(Status("a", (ModelLoad("m", in_flight=2, queued=1, capacity=4),)))
    assert [_placed(scheduler.choose("m")) for _ in range(3)] == ["b", "b", "b"]  # b: 0, 1, 2 of 4; a at 3
    view = scheduler.registry.nodes["b"].models["m"]
    assert (view.sent_since_report, view.load) == (3, 3)
    scheduler.registry.report(Status("b", (ModelLoad("m", in_flight=1, capacity=4),)))
    # A report never counts fewer runs than this control-plane placed there and saw no end of.
    assert (view.sent_since_report, view.load) == (0, 3)
    for _ in range(3):
        scheduler.registry.finished("b", "m")
    assert view.load == 0  # each end takes one off: the placed runs, and the reported one with them
    assert _placed(scheduler.choose("m")) == "b"


def test_a_finished_run_frees_a_slot_taking_from_runs_sent_since_the_report_first() -> None:
    scheduler = _scheduler(a=4)
    registry = scheduler.registry
    registry.report(Status("a", (ModelLoad("m", in_flight=2, queued=1, capacity=4),)))
    registry.sent("a", "m")
    view = registry.nodes["a"].models["m"]
    loads = []
    for _ in range(5):
        registry.finished("a", "m")
        loads.append((view.in_flight, view.queued, view.sent_since_report))
    assert loads == [(2, 1, 0), (2, 0, 0), (1, 0, 0), (0, 0, 0), (0, 0, 0)]
    registry.finished("gone", "m")  # a node that left: nothing to do


def test_every_candidate_full_is_all_busy_and_sends_nothing() -> None:
    scheduler = _scheduler(a=1, b=2)
    assert sorted(_placed(scheduler.choose("m")) for _ in range(3)) == ["a", "b", "b"]
    decision = scheduler.choose("m")
    assert (decision.outcome, decision.node_id) == ("all_busy", None)
    assert "full" in decision.reason
    assert scheduler.registry.nodes["a"].models["m"].load == 1
    scheduler.registry.finished("b", "m")
    assert _placed(scheduler.choose("m")) == "b"


# Background runs yield to interactive runs awaiting their first output


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin", "session-affinity"])
def test_a_background_run_goes_to_a_node_without_interactive_runs_awaiting_output(policy: str) -> None:
    scheduler = _scheduler(f"defaults: {{policy: {policy}}}", a=4, b=4)
    scheduler.registry.nodes["a"].awaiting_first_output = 1
    placed = {_placed(scheduler.choose("m", background=True, session=f"s{i}")) for i in range(3)}
    assert placed == {"b"}
    interactive = {_placed(scheduler.choose("m", session=f"s{i}")) for i in range(5)}
    assert "a" in interactive  # interactive runs are not held back


def test_a_background_run_waits_while_every_node_with_room_has_interactive_runs_awaiting_output() -> None:
    scheduler = _scheduler(a=1, b=4)
    nodes = scheduler.registry.nodes
    assert _placed(scheduler.choose("m")) in {"a", "b"}
    nodes["a"].awaiting_first_output = nodes["b"].awaiting_first_output = 1
    decision = scheduler.choose("m", background=True)
    assert (decision.outcome, decision.node_id, decision.yielded) == ("all_busy", None, True)
    assert "awaiting a first output" in decision.reason
    assert sum(view.load for node in nodes.values() for view in node.models.values()) == 1  # nothing sent
    nodes["b"].awaiting_first_output = 0
    assert _placed(scheduler.choose("m", background=True)) == "b"


def test_a_background_run_is_all_busy_without_yielding_when_no_node_has_room() -> None:
    scheduler = _scheduler(a=1)
    _placed(scheduler.choose("m"))
    scheduler.registry.nodes["a"].awaiting_first_output = 1
    decision = scheduler.choose("m", background=True)
    assert (decision.outcome, decision.yielded) == ("all_busy", False)
    assert "full" in decision.reason
    scheduler.registry.nodes["a"].awaiting_first_output = 0
    assert scheduler.choose("m", background=True).outcome == "all_busy"
    assert scheduler.choose("other", background=True).outcome == "unknown_model"


def test_the_heap_stays_bounded_however_often_loads_change() -> None:
    scheduler = _scheduler(a=4, b=4, c=4)
    for _ in range(10_000):
        scheduler.registry.finished(_placed(scheduler.choose("m")), "m")
    pool = scheduler.registry.pool("m")
    assert pool is not None and len(pool._heap) <= 2 * 3 + 64


# Round-robin


def test_round_robin_takes_the_candidates_in_turn_whatever_their_load() -> None:
    scheduler = _scheduler("models: {m: {policy: round-robin}}", a=100, b=100, c=100)
    scheduler.registry.report(Status("a", (ModelLoad("m", in_flight=90, capacity=100),)))
    decisions = [scheduler.choose("m") for _ in range(7)]
    assert [_placed(decision) for decision in decisions] == ["a", "b", "c", "a", "b", "c", "a"]
    assert {decision.policy for decision in decisions} == {"round-robin"}


def test_round_robin_passes_over_full_nodes_and_nodes_that_left() -> None:
    scheduler = _scheduler("models: {m: {policy: round-robin}}", a=10, b=1, c=10, d=10)
    scheduler.registry.mark("d", NodeState.UNAVAILABLE, "connection closed")
    assert [_placed(scheduler.choose("m")) for _ in range(5)] == ["a", "b", "c", "a", "c"]


def test_round_robin_takes_the_least_loaded_when_the_free_nodes_are_far_apart_in_turn() -> None:
    scheduler = _scheduler("models: {m: {policy: round-robin}}", **{f"n{index:02}": 2 for index in range(40)})
    for index in range(39):
        scheduler.registry.report(Status(f"n{index:02}", (ModelLoad("m", in_flight=2, capacity=2),)))
    assert [_placed(scheduler.choose("m")) for _ in range(2)] == ["n39", "n39"]  # the last and only free one
    assert scheduler.choose("m").outcome == "all_busy"
    scheduler.registry.finished("n20", "m")
    assert _placed(scheduler.choose("m")) == "n20"


# Weighted routes and aliases


def test_a_weighted_route_splits_1000_decisions_90_10_within_4_percent() -> None:
    scheduler = _scheduler("routes: {chat: {m: 90, m2: 10}}", a=10_000)
    scheduler.registry.register("b", [ModelLoad("m2", capacity=10_000)])
    models = Counter(scheduler.choose("chat").model for _ in range(1000))
    assert abs(models["m"] - 900) <= 40 and abs(models["m2"] - 100) <= 40  # in practice exact: 900/100
    by_session = Counter(scheduler.choose("chat", session=f"s{index}").model for index in range(1000))
    assert abs(by_session["m"] - 900) <= 40 and abs(by_session["m2"] - 100) <= 40


def test_a_session_keeps_the_model_its_route_picked() -> None:
    scheduler = _scheduler("routes: {chat: {m: 50, m2: 50}}", a=10_000)
    scheduler.registry.register("b", [ModelLoad("m2", capacity=10_000)])
    for index in range(50):
        picks = {scheduler.choose("chat", session=f"s{index}").model for _ in range(5)}
        assert len(picks) == 1


def test_a_route_falls_back_to_its_other_models_when_its_pick_has_no_candidate() -> None:
    scheduler = _scheduler("routes: {chat: {canary: 90, m: 10, spare: 0}}", a=100)
    decisions = [scheduler.choose("chat") for _ in range(20)]
    assert {(decision.model, decision.route, decision.outcome) for decision in decisions} == {("m", "chat", "placed")}
    scheduler.registry.mark("a", NodeState.DRAINING, "operator")
    decision = scheduler.choose("chat")
    assert (decision.outcome, decision.model) == ("unknown_model", "canary")
    assert "the route's other models have none either" in decision.reason


def test_a_full_pick_gives_its_run_to_the_routes_other_models_and_the_run_waits_only_when_all_are_full() -> None:
    scheduler = _scheduler("routes: {chat: {m: 50, m2: 50}}", a=1)
    scheduler.registry.register("b", [ModelLoad("m2", capacity=1)])
    first, second = scheduler.choose("chat"), scheduler.choose("chat")
    assert {_placed(first), _placed(second)} == {"a", "b"}
    scheduler.registry.finished("b", "m2")  # m2 has room again, m is full
    spilled = scheduler.choose("chat")  # the rotation's turn is m's (full): the run goes to m2 at once
    assert (_placed(spilled), spilled.model) == ("b", "m2")
    waiting = scheduler.choose("chat")
    assert waiting.outcome == "all_busy" and waiting.node_id is None


def test_an_alias_places_runs_of_the_model_it_names() -> None:
    decision = _scheduler("aliases: {gpt-4o: m}", a=1).choose("gpt-4o")
    assert (decision.node_id, decision.model, decision.route) == ("a", "m", "gpt-4o")


# Session affinity


def _homes(scheduler: Scheduler, sessions: int) -> dict[str, str]:
    """Each session's node (its run finished at once, so load plays no part)."""
    homes = {}
    for index in range(sessions):
        homes[f"s{index}"] = node_id = _placed(scheduler.choose("m", session=f"s{index}"))
        scheduler.registry.finished(node_id, "m")
    return homes


def test_session_affinity_sends_a_session_to_the_same_node_while_it_is_ready() -> None:
    scheduler = _scheduler("defaults: {policy: session-affinity}", **{f"n{index}": 10 for index in range(5)})
    homes = _homes(scheduler, 500)
    assert _homes(scheduler, 500) == homes
    assert Counter(homes.values()).keys() == {f"n{index}" for index in range(5)}  # every node has sessions
    assert min(Counter(homes.values()).values()) >= 50  # of 100 each on average


def test_a_node_leaving_moves_only_its_own_sessions_and_they_return_with_it() -> None:
    scheduler = _scheduler("defaults: {policy: session-affinity}", **{f"n{index}": 10 for index in range(5)})
    before = _homes(scheduler, 1000)
    scheduler.registry.mark("n2", NodeState.UNAVAILABLE, "silent for 3 intervals")
    after = _homes(scheduler, 1000)
    moved = {session for session in before if after[session] != before[session]}
    assert moved == {session for session, node_id in before.items() if node_id == "n2"}
    assert len({after[session] for session in moved}) == 4  # spread over the others, not piled on one
    scheduler.registry.mark("n2", NodeState.READY, "heard from again")
    assert _homes(scheduler, 1000) == before


def test_affinity_keys_on_the_caller_without_a_session_and_falls_back_to_least_loaded_without_either() -> None:
    scheduler = _scheduler("defaults: {policy: session-affinity}", a=100, b=100, c=100)
    by_caller = {_placed(scheduler.choose("m", caller="alice")) for _ in range(10)}
    assert len(by_caller) == 1
    decision = scheduler.choose("m")
    assert (decision.policy, decision.reason.split(":")[0]) == ("least-loaded", "no session or caller; least loaded")


def test_a_full_session_node_spills_to_the_least_loaded() -> None:
    scheduler = _scheduler("defaults: {policy: session-affinity}", a=1, b=1, c=1)
    home = _placed(scheduler.choose("m", session="s"))
    spill = scheduler.choose("m", session="s")
    assert _placed(spill) != home and "session's node full" in spill.reason


@given(st.sets(st.text(min_size=1, max_size=8), min_size=2, max_size=12), st.data())
def test_the_ring_moves_only_the_keys_of_a_member_that_leaves(members: set[str], data: st.DataObject) -> None:
    ring = HashRing(vnodes=16)
    for member in members:
        ring.add(member)
    leaving = data.draw(st.sampled_from(sorted(members)))
    keys = [f"key-{index}" for index in range(200)]
    before = {key: next(ring.walk(key)) for key in keys}
    ring.remove(leaving)
    after = {key: next(ring.walk(key)) for key in keys}
    assert {key for key in keys if before[key] != after[key]} == {key for key in keys if before[key] == leaving}
    walked = list(ring.walk("any"))
    assert len(walked) == len(set(walked)) == len(members) - 1  # every member, each once


@given(st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=12), st.data())
def test_members_added_together_or_one_by_one_make_the_same_ring(members: list[str], data: st.DataObject) -> None:
    together, one_by_one = HashRing(vnodes=16), HashRing(vnodes=16)
    together.add(*members)
    for member in data.draw(st.permutations(members)):
        one_by_one.add(member)
    one_by_one.add(members[0])  # already there: nothing changes
    keys = [f"key-{index}" for index in range(100)]
    assert [list(together.walk(key)) for key in keys] == [list(one_by_one.walk(key)) for key in keys]
    assert len(together) == len(set(members))


# Candidates


def _filtered() -> Scheduler:
    registry, fits = Registry(), {"gpu": "h100", "zone": "a"}
    registry.register("good", [ModelLoad("m", capacity=100)], labels=fits)
    registry.register("other-zone", [ModelLoad("m", capacity=100)], labels={"gpu": "h100", "zone": "b"})
    registry.register("no-gpu", [ModelLoad("m", capacity=100)], labels={"zone": "a"})
    registry.register("down", [ModelLoad("m", capacity=100)], labels=fits)
    registry.register("draining", [ModelLoad("m", capacity=100)], labels=fits)
    registry.register("backend-down", [ModelLoad("m", capacity=100, available=False)], labels=fits)
    registry.register("no-capacity", [ModelLoad("m", capacity=0)], labels=fits)
    registry.register("other-model", [ModelLoad("x", capacity=100)], labels=fits)
    registry.mark("down", NodeState.UNAVAILABLE, "connection closed")
    registry.report(Status("draining", (ModelLoad("m", capacity=4),), draining=True))
    return Scheduler(registry, load_policy("models: {m: {labels: {gpu: h100}}}"))


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin", "session-affinity"])
def test_candidates_are_ready_serve_the_model_available_with_the_labels_and_not_yet_tried(policy: str) -> None:
    scheduler = _filtered()
    scheduler.apply(load_policy(f"models: {{m: {{labels: {{gpu: h100}}, policy: {policy}}}}}"))
    chosen = {_placed(scheduler.choose("m", labels={"zone": "a"}, session=f"s{index}")) for index in range(8)}
    assert chosen == {"good"}
    assert _placed(scheduler.choose("m", exclude={"good"}, session="s")) == "other-zone"
    assert scheduler.registry.nodes["draining"].state is NodeState.DRAINING


@pytest.mark.parametrize(
    ("model", "labels", "exclude", "outcome", "reason"),
    [
        ("y", None, frozenset(), "unknown_model", "no registered node serves 'y'"),
        ("x", {"gpu": "l4"}, frozenset(), "no_candidate", "none of 1 candidate(s) for 'x' has labels gpu=l4"),
        ("m", {"zone": "c"}, frozenset(), "no_candidate", "none of 3 candidate(s) for 'm' has labels gpu=h100, zone=c"),
        ("m", {"gpu": "a100"}, frozenset(), "no_candidate", "has labels gpu=a100, gpu=h100"),  # against the policy
        ("m", None, {"good", "other-zone"}, "no_candidate", "all 2 candidate(s) for 'm' that fit already tried"),
    ],
)
def test_a_decision_without_a_node_says_why(
    model: str, labels: dict[str, str] | None, exclude: frozenset[str], outcome: str, reason: str
) -> None:
    decision = _filtered().choose(model, labels=labels, exclude=exclude)
    assert (decision.node_id, decision.outcome) == (None, outcome)
    assert reason in decision.reason


def test_no_ready_node_with_the_model_available_is_no_candidate() -> None:
    scheduler = _scheduler(a=4)
    scheduler.registry.report(Status("a", (ModelLoad("m", capacity=4, available=False),)))
    assert scheduler.choose("m").reason == "1 node(s) serve 'm', none ready with it available"
    scheduler.registry.report(Status("a", (ModelLoad("m", capacity=4),)))
    assert _placed(scheduler.choose("m")) == "a"


def test_a_model_left_out_of_a_report_is_no_longer_served() -> None:
    scheduler = _scheduler(a=4)
    scheduler.registry.report(Status("a", (ModelLoad("x", capacity=4),)))
    assert scheduler.choose("m").outcome == "unknown_model"
    assert _placed(scheduler.choose("x")) == "a"


def test_registering_again_replaces_the_node_and_removing_forgets_it() -> None:
    scheduler = _scheduler(a=4, b=4)
    scheduler.registry.register("a", [ModelLoad("x", capacity=100)], labels={"zone": "b"})
    assert (scheduler.choose("x").node_id, scheduler.choose("m").node_id) == ("a", "b")
    scheduler.registry.remove("b")
    assert scheduler.choose("m").outcome == "unknown_model"
    assert set(scheduler.registry.nodes) == {"a"}


def test_pools_for_label_sets_are_kept_for_the_most_recently_used_only() -> None:
    scheduler = _scheduler(a=100)
    for index in range(40):
        scheduler.choose("m", labels={"zone": str(index)})
    assert len(scheduler.registry._pools["m"]) == 1 + 16  # the model's own pool, and 16 for labels
    scheduler.registry.register("b", [ModelLoad("m", capacity=100)], labels={"zone": "39"})
    assert _placed(scheduler.choose("m", labels={"zone": "39"})) == "b"  # kept current after it was made


def test_a_report_older_than_a_run_does_not_free_its_slot() -> None:
    registry = Registry()
    registry.register("n1", [ModelLoad("m", in_flight=0, queued=0, capacity=1, available=True)])
    scheduler = Scheduler(registry)
    assert scheduler.choose("m").node_id == "n1"
    # The node's report was written before the run reached it: it still says 0 in flight.
    registry.report(Status("n1", [ModelLoad("m", in_flight=0, queued=0, capacity=1, available=True)]))
    assert scheduler.choose("m").outcome == "all_busy"
    registry.finished("n1", "m")
    assert scheduler.choose("m").node_id == "n1"


def test_runs_of_models_no_node_serves_leave_nothing_behind() -> None:
    scheduler = _scheduler("models: {m: {labels: {zone: a}}}\n", a=1)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for number in range(2000):  # 20 MB of names, were any of them kept
            assert scheduler.choose(f"{number:010}" * 1000).outcome == "unknown_model"
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 1_000_000
