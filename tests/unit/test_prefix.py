"""The prefix policy on its own: prompt hashes, the index's bounds, a node leaving, longest match, imbalance."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from iop_control_plane.bootstrap import build_control_plane
from iop_control_plane.policy import load_policy
from iop_control_plane.prefix import (
    _LANDMARKS,
    BLOCK_CHARS,
    HOLDERS,
    MAX_PREFIXES,
    Prefix,
    PrefixIndex,
    prompt_prefixes,
)
from iop_control_plane.registry import ModelLoad, NodeState, Registry, Status
from iop_control_plane.scheduler import Decision, Scheduler
from iop_control_plane.settings import Settings
from iop_gen.pb.iop import runtime_pb2 as pb


def _chat(*texts: str) -> pb.RunRequest:
    """A chat run: a system message, then user and assistant in turn."""
    roles = [pb.ROLE_SYSTEM] + [pb.ROLE_USER, pb.ROLE_ASSISTANT] * len(texts)
    messages = [
        pb.ChatMessage(role=role, content=[pb.ContentPart(text=text)]) for role, text in zip(roles, texts, strict=False)
    ]
    return pb.RunRequest(model="m", kind=pb.RUN_KIND_CHAT, messages=messages)


def _scheduler(
    policy: str = "defaults: {policy: prefix}", index: PrefixIndex | None = None, **capacities: int
) -> Scheduler:
    registry = Registry()
    for node_id, capacity in capacities.items():
        registry.register(node_id, [ModelLoad("m", capacity=capacity)])
    return Scheduler(registry, load_policy(policy), prefixes=index)


def _load(scheduler: Scheduler, node_id: str, in_flight: int, capacity: int) -> None:
    scheduler.registry.report(Status(node_id, (ModelLoad("m", in_flight=in_flight, capacity=capacity),)))


def _run(scheduler: Scheduler, request: pb.RunRequest) -> Decision:
    """Place a run of ``request`` and end it at once (loads stay as reported)."""
    decision = scheduler.choose("m", prompt=prompt_prefixes(request))
    assert decision.node_id is not None, decision
    scheduler.registry.finished(decision.node_id, "m")
    return decision


def _prefixes(*hashes: int) -> tuple[Prefix, ...]:
    return tuple(Prefix(value, 100 * (index + 1)) for index, value in enumerate(hashes))


# Prompt hashes


def test_a_chat_has_one_cumulative_hash_per_message_boundary() -> None:
    first, second = prompt_prefixes(_chat("system A", "hi", "hello")), prompt_prefixes(_chat("system A", "hi", "bye"))
    assert len(first) == 3
    assert first[:2] == second[:2]  # the same system prompt and first question
    assert first[2] != second[2]
    assert [prefix.size for prefix in first] == sorted({prefix.size for prefix in first})
    other = prompt_prefixes(_chat("system B", "hi", "hello"))
    assert not {prefix.hash for prefix in other} & {prefix.hash for prefix in first}  # a different start: none shared


def test_a_completion_prompt_is_hashed_in_blocks_and_embeddings_not_at_all() -> None:
    text = "x" * BLOCK_CHARS + "y" * BLOCK_CHARS + "z" * 10
    blocks = prompt_prefixes(pb.RunRequest(kind=pb.RUN_KIND_COMPLETION, prompt=[text]))
    longer = prompt_prefixes(pb.RunRequest(kind=pb.RUN_KIND_COMPLETION, prompt=[text[: 2 * BLOCK_CHARS] + "w" * 300]))
    assert len(blocks) == 3
    assert blocks[:2] == longer[:2]
    assert blocks[2].hash != longer[2].hash
    assert prompt_prefixes(pb.RunRequest(kind=pb.RUN_KIND_EMBEDDING, prompt=[text])) == ()
    endless = prompt_prefixes(pb.RunRequest(kind=pb.RUN_KIND_COMPLETION, prompt=["q" * BLOCK_CHARS * 100]))
    assert len(endless) == MAX_PREFIXES


# The index's bounds


def test_a_node_keeps_its_most_recently_used_prefixes_up_to_its_bound() -> None:
    index = PrefixIndex(per_node=3, limit=100)
    index.record("a", "m", _prefixes(1, 2, 3))
    index.record("a", "m", _prefixes(1))  # used again: the most recent now
    index.record("a", "m", _prefixes(4))
    assert [index.held("a", "m", _prefixes(value)) for value in (1, 2, 3, 4)] == [100, 0, 100, 100]
    assert (len(index), index.evicted) == (3, {"node": 1, "global": 0})


def test_the_global_bound_drops_the_least_recently_used_entries_of_any_node() -> None:
    index = PrefixIndex(per_node=10, limit=4)
    index.record("a", "m", _prefixes(1, 2))
    index.record("b", "m", _prefixes(3, 4))
    index.record("a", "m", _prefixes(1))  # a's 1 is now newer than b's
    index.record("c", "m", _prefixes(5, 6))
    held = {(node, value) for node in "abc" for value in range(1, 7) if index.held(node, "m", _prefixes(value))}
    assert held == {("a", 1), ("b", 4), ("c", 5), ("c", 6)}
    assert (len(index), index.evicted["global"]) == (4, 2)


def test_a_prefix_keeps_only_its_most_recent_holders() -> None:
    index = PrefixIndex()
    for node in range(HOLDERS + 3):
        index.record(f"n{node}", "m", _prefixes(7))
    ((at, holders),) = index.holders("m", _prefixes(7))
    assert (at, list(holders)) == (0, [f"n{node}" for node in range(3, HOLDERS + 3)])
    assert len(index) == HOLDERS  # the older holders' entries are gone with them
    assert index.nodes() == HOLDERS


def test_the_scheduler_keeps_the_index_it_is_given_with_its_bounds() -> None:
    index = PrefixIndex(per_node=2, limit=3)  # as the control-plane's settings make it: empty, so falsy
    scheduler = Scheduler(Registry(), prefixes=index)
    assert scheduler.prefixes is index  # the one whose bounds are configured and whose metrics are exported


def test_the_control_plane_places_with_the_index_its_settings_bound(tmp_path: Path) -> None:
    settings = Settings.model_validate(
        {"store_path": tmp_path / "cp.db", "prefix": {"entries_per_node": 5, "max_entries": 7}}
    )
    app = build_control_plane(settings)
    index = app.scheduler.prefixes
    assert (index.per_node, index.limit) == (5, 7)
    index.record("a", "m", _prefixes(*range(20)))  # 6 landmarks, past 5
    exported = generate_latest(app.metrics.registry).decode()  # the index its metrics watch is this one
    assert 'iop_control_plane_prefix_evictions_total{bound="node"} 1.0' in exported


def test_prefixes_are_per_model() -> None:
    index = PrefixIndex()
    index.record("a", "m", _prefixes(1))
    assert index.held("a", "m", _prefixes(1)) == 100
    assert index.held("a", "other", _prefixes(1)) == 0


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.lists(st.integers(0, 30), max_size=6)), max_size=60))
def test_the_bounds_hold_and_the_views_agree_whatever_is_recorded(records: list[tuple[str, list[int]]]) -> None:
    index = PrefixIndex(per_node=5, limit=12)
    for node, hashes in records:
        if hashes:
            index.record(node, "m", _prefixes(*hashes))
        else:  # an empty prompt records nothing: the node leaves instead
            index.forget(node)
        assert len(index) <= 12
        for held in index._by_node.values():
            assert 0 < len(held) <= 5
        entries = {(node_id, key) for node_id, keys in index._by_node.items() for key in keys}
        assert entries == {(node_id, key) for key, nodes in index._holders.items() for node_id in nodes}
        assert len(entries) == len(index)
        for node_id, ticks in index._by_node.items():  # used in order, and queued no later than its oldest
            assert list(ticks.values()) == sorted(ticks.values())
            assert (index._queued[node_id], node_id) in index._fronts
            assert index._queued[node_id] <= next(iter(ticks.values()))
        assert index._queued.keys() == index._by_node.keys()


def test_a_node_whose_oldest_was_used_again_is_not_taken_for_the_oldest_of_all() -> None:
    index = PrefixIndex(limit=2)
    index.record("a", "m", _prefixes(1))
    index.record("b", "m", _prefixes(3))
    index.record("a", "m", _prefixes(1))  # a's oldest is now newer than b's
    index.record("c", "m", _prefixes(5))
    assert [index.held(node, "m", _prefixes(value)) for node, value in (("a", 1), ("b", 3), ("c", 5))] == [100, 0, 100]


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.lists(st.integers(0, 30), max_size=6)), max_size=60))
def test_the_global_bound_keeps_exactly_the_most_recently_used(records: list[tuple[str, list[int]]]) -> None:
    index, used = PrefixIndex(limit=12), list[tuple[str, int]]()  # (node, prefix), the least recently used first
    for node, hashes in records:
        if hashes:
            index.record(node, "m", _prefixes(*hashes))
            for value in (hashes[at] for at in _LANDMARKS[len(hashes)]):
                used = [*(entry for entry in used if entry != (node, value)), (node, value)]
            used = used[-12:]
        else:
            index.forget(node)
            used = [entry for entry in used if entry[0] != node]
        held = {(node, value) for node in "abcd" for value in range(31) if index.held(node, "m", _prefixes(value))}
        assert held == set(used)


def test_a_node_that_leaves_loses_its_entries() -> None:
    scheduler = _scheduler(a=4, b=4, c=4)
    for node in "abc":
        scheduler.prefixes.record(node, "m", _prefixes(1, 2))
    scheduler.registry.remove("a")
    scheduler.registry.mark("b", NodeState.UNAVAILABLE, "connection closed")
    scheduler.registry.mark("c", NodeState.DRAINING, "drained by an admin")  # may be undrained: keeps them
    assert [scheduler.prefixes.held(node, "m", _prefixes(1, 2)) for node in "abc"] == [0, 0, 200]
    assert (len(scheduler.prefixes), scheduler.prefixes.nodes()) == (2, 1)
    ((_, holders), _) = scheduler.prefixes.holders("m", _prefixes(1, 2))
    assert list(holders) == ["c"]


# Placement


def test_a_conversation_sticks_to_the_node_that_saw_its_start() -> None:
    scheduler = _scheduler(a=4, b=4, c=4)
    homes = {}
    for conversation in range(6):
        system = f"you are assistant number {conversation}"
        first = _run(scheduler, _chat(system, "question 1"))
        assert (first.prefix, first.matched) == ("miss", 0)
        homes[conversation] = first.node_id
    assert set(homes.values()) == {"a", "b", "c"}  # new conversations go to the least loaded
    for conversation, home in homes.items():
        system = f"you are assistant number {conversation}"
        later = _run(scheduler, _chat(system, "question 1", "answer 1", "question 2"))
        assert (later.node_id, later.prefix) == (home, "hit")
        assert later.matched == prompt_prefixes(_chat(system, "question 1"))[-1].size


def test_the_longest_known_prefix_wins() -> None:
    scheduler = _scheduler(a=4, b=4)
    scheduler.prefixes.record("a", "m", prompt_prefixes(_chat("shared system prompt")))
    scheduler.prefixes.record("b", "m", prompt_prefixes(_chat("shared system prompt", "q1", "a1")))
    decision = _run(scheduler, _chat("shared system prompt", "q1", "a1", "q2"))
    assert decision.node_id == "b"
    assert decision.matched == prompt_prefixes(_chat("shared system prompt", "q1", "a1"))[-1].size


def test_a_holder_loaded_past_the_imbalance_gives_the_run_to_the_least_loaded() -> None:
    scheduler = _scheduler("defaults: {policy: prefix, prefix_imbalance: 0.25}", a=8, b=8)
    prompt = _chat("system", "question")
    scheduler.prefixes.record("a", "m", prompt_prefixes(prompt))
    _load(scheduler, "a", 2, 8)  # 0.25 over b: within the bound
    decision = _run(scheduler, prompt)
    assert (decision.node_id, decision.prefix) == ("a", "hit")
    _load(scheduler, "a", 3, 8)  # 0.375 over b: past it
    decision = _run(scheduler, prompt)
    assert (decision.node_id, decision.prefix, decision.matched) == ("b", "imbalance", 0)
    decision = _run(scheduler, prompt)
    assert (decision.node_id, decision.prefix) == ("b", "hit")  # b holds it now too


def test_past_the_imbalance_the_holder_of_a_shorter_prefix_is_next() -> None:
    scheduler = _scheduler(a=4, b=4, c=4)
    scheduler.prefixes.record("a", "m", prompt_prefixes(_chat("system")))
    scheduler.prefixes.record("b", "m", prompt_prefixes(_chat("system", "q1", "a1")))
    _load(scheduler, "b", 3, 4)  # 0.75 over c, the least loaded
    _load(scheduler, "a", 1, 4)
    decision = _run(scheduler, _chat("system", "q1", "a1", "q2"))
    assert (decision.node_id, decision.prefix) == ("a", "hit")
    assert decision.matched == prompt_prefixes(_chat("system"))[-1].size


def test_a_full_holder_within_the_bound_is_waited_for_and_past_it_passed_over() -> None:
    scheduler = _scheduler("defaults: {policy: prefix, prefix_imbalance: 0.5}", a=4, b=4)
    prompt = prompt_prefixes(_chat("system", "question"))
    scheduler.prefixes.record("a", "m", prompt)
    _load(scheduler, "a", 4, 4)
    _load(scheduler, "b", 2, 4)  # a's 1.0 is within 0.5 of b's 0.5: b's room is not worth the prefill
    decision = scheduler.choose("m", prompt=prompt)
    assert (decision.outcome, decision.node_id, decision.waits_for) == ("all_busy", None, "a")
    assert decision.prefix is None  # not a placement: counted when it is placed
    background = scheduler.choose("m", prompt=prompt, background=True)
    assert (background.node_id, background.prefix) == ("b", "imbalance")  # background work never waits for one
    scheduler.prefixes.forget("b")  # the background run left it there
    _load(scheduler, "b", 1, 4)  # 0.75 under a: past the bound
    decision = scheduler.choose("m", prompt=prompt)
    assert (decision.node_id, decision.prefix, decision.waits_for) == ("b", "imbalance", None)
    _load(scheduler, "a", 4, 4)
    _load(scheduler, "b", 4, 4)
    assert scheduler.choose("m", prompt=prompt).waits_for is None  # every node full: nobody has room to pass up


def test_the_runs_waiting_for_a_holder_count_in_its_load_so_a_hot_prefix_spreads() -> None:
    scheduler = _scheduler("defaults: {policy: prefix, prefix_imbalance: 1.0}", a=1, b=1)
    prompt = prompt_prefixes(_chat("one system prompt every run shares", "question"))
    scheduler.prefixes.record("a", "m", prompt)
    _load(scheduler, "a", 1, 1)  # one slot, taken; b idle: a's 1.0 is within 1.0 of b's 0
    assert scheduler.choose("m", prompt=prompt).waits_for == "a"
    scheduler.waiting["a"] += 1  # the relay counts the run now waiting for a
    assert scheduler.choose("m", prompt=prompt, waiting_for="a").waits_for == "a"  # itself is not counted
    second = scheduler.choose("m", prompt=prompt)  # a at 1 running + 1 waiting: 2.0, past the bound
    assert (second.node_id, second.prefix) == ("b", "imbalance")


def test_a_failover_skips_the_node_tried() -> None:
    scheduler = _scheduler("defaults: {policy: prefix, prefix_imbalance: 5}", a=2, b=2)
    prompt = prompt_prefixes(_chat("system", "question"))
    scheduler.prefixes.record("a", "m", prompt)
    _load(scheduler, "a", 0, 2)
    _load(scheduler, "b", 0, 2)
    scheduler.prefixes.forget("b")
    retry = scheduler.choose("m", prompt=prompt, exclude={"a"})
    assert (retry.node_id, retry.prefix) == ("b", "imbalance")


def test_every_candidate_full_is_all_busy_and_records_nothing() -> None:
    scheduler = _scheduler(a=1)
    _load(scheduler, "a", 1, 1)
    decision = scheduler.choose("m", prompt=prompt_prefixes(_chat("system")))
    assert (decision.outcome, decision.prefix) == ("all_busy", None)
    assert len(scheduler.prefixes) == 0


def test_only_the_prefix_policy_records_prefixes() -> None:
    scheduler = _scheduler("models: {m: {policy: least-loaded}, p: {policy: prefix}}", a=4)
    decision = scheduler.choose("m", prompt=prompt_prefixes(_chat("system")))
    assert (decision.node_id, decision.prefix) == ("a", None)
    assert len(scheduler.prefixes) == 0
    policy = scheduler.policy  # the relay hashes the prompts of p's runs only
    assert policy.places_by_prefix("p") and not policy.places_by_prefix("m")
    assert not load_policy("models: {m: {policy: round-robin}}").places_by_prefix("m")
    routed = load_policy("aliases: {a: p}\nroutes: {r: {m: 1, p: 1}}\nmodels: {p: {policy: prefix}}")
    assert routed.places_by_prefix("a") and routed.places_by_prefix("r") and not routed.places_by_prefix("m")
    assert load_policy("defaults: {policy: prefix}").places_by_prefix("anything")


def test_a_run_records_its_landmarks_and_a_branch_matches_the_one_before_it() -> None:
    index = PrefixIndex()
    prompt = _prefixes(*range(100, 121))  # 21 prefixes: a system prompt and 10 turns
    index.record("a", "m", prompt)
    assert len(index) == 6  # 1, 2, 4, 8, 16 and 21 long
    next_turn = (*prompt, *_prefixes(*range(200, 202)))
    assert index.held("a", "m", next_turn) == prompt[-1].size  # the whole of the last prompt
    branch = (*prompt[:12], *_prefixes(300))  # the conversation edited at message 13
    assert index.held("a", "m", branch) == prompt[7].size  # 8 messages: the landmark before the edit


def test_a_hit_uses_again_the_longest_prefix_held_not_the_landmarks_before_it() -> None:
    scheduler = _scheduler(index=PrefixIndex(limit=5), a=4, b=4)
    index = scheduler.prefixes
    index.record("a", "m", _prefixes(1, 2, 3))  # landmarks 1, 2 and the whole: 3
    index.record("b", "m", _prefixes(10))
    decision = scheduler.choose("m", prompt=_prefixes(1, 2, 3, 4, 5))  # the next turn
    assert (decision.node_id, decision.prefix, decision.matched) == ("a", "hit", 300)
    # 3, what a's backend reused, is its most recent with the new landmarks 4 and 5; 1 and 2 were
    # not used again, so past the bound of 5 the oldest, 1, goes (recording every landmark again
    # would have dropped 3, the part just reused, and kept 1 and 2)
    held = {(node, value) for node in "ab" for value in (1, 2, 3, 4, 5, 10) if index.held(node, "m", _prefixes(value))}
    assert held == {("a", 2), ("a", 3), ("a", 4), ("a", 5), ("b", 10)}
