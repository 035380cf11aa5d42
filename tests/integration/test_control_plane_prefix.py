"""The prefix policy with real processes: a control-plane and three `iop node`s (mock adapter, mTLS).

The unit tests (tests/unit/test_prefix.py) prove the index and the rule on a fake registry; here
conversations sent over the wire, interleaved and concurrent, stick to the node that served their
start, and move (once) when that node leaves.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from conftest import Pki, assert_eventually
from cp_helpers import all_ready, client, cp_settings
from cp_policy_helpers import cp_port, nodes_serving, write_policy
from node_helpers import collect, kinds, text

from iop_control_plane.bootstrap import build_control_plane
from iop_control_plane.registry import NodeState
from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.connection import Connection

NODES = ("node-a", "node-b", "node-c")
MODEL = "mock-prefix"
CONVERSATIONS = 9


class _Conversation:
    """A chat with its own long system prompt; each turn sends every message so far."""

    def __init__(self, index: int) -> None:
        system = f"You are assistant {index}. " + f"Rules of conversation {index}. " * 60
        self.messages = [_message(pb.ROLE_SYSTEM, system)]
        self.turns = 0

    async def turn(self, edge: Connection) -> str:
        """Send the next user message; the node that served it."""
        self.turns += 1
        self.messages.append(_message(pb.ROLE_USER, f"question {self.turns}"))
        request = pb.RunRequest(run_id=f"{id(self)}-{self.turns}", model=MODEL, messages=self.messages, stream=True)
        events = await collect(await edge.open_run(request))
        assert kinds(events)[-1] == "complete", events[-1]
        self.messages.append(_message(pb.ROLE_ASSISTANT, text(events)))
        return events[0].start.node_id


def _message(role: pb.Role, content: str) -> pb.ChatMessage:
    return pb.ChatMessage(role=role, content=[pb.ContentPart(text=content)])


async def _all_turn(conversations: list[_Conversation], edge: Connection) -> list[str]:
    """One more turn of every conversation, all at once: the node of each."""
    return list(await asyncio.gather(*(conversation.turn(edge) for conversation in conversations)))


async def test_conversations_stick_to_their_node_and_move_once_when_it_leaves(pki: Pki, tmp_path: Path) -> None:
    policy = write_policy(tmp_path, "defaults: {policy: prefix}\n")
    async with build_control_plane(cp_settings(pki, tmp_path, policy_path=policy)) as cp:
        route = {"model": MODEL, "adapter": "mock", "max_concurrency": 64, "options": {"tokens": 3}}
        with nodes_serving(pki, tmp_path, cp_port(cp), {node: [route] for node in NODES}) as nodes:
            await all_ready(cp, *NODES)
            edge = await client(cp, pki)
            conversations = [_Conversation(index) for index in range(CONVERSATIONS)]
            homes = await _all_turn(conversations, edge)
            assert len(set(homes)) >= 2, homes  # new conversations spread (least loaded)
            for _ in range(2):
                assert await _all_turn(conversations, edge) == homes  # every later turn on its first node
            decisions = cp.metrics.prefix_decisions
            assert decisions.labels("other", "hit")._value.get() == 2 * CONVERSATIONS
            assert decisions.labels("other", "miss")._value.get() == CONVERSATIONS

            victim = Counter(homes).most_common(1)[0][0]
            nodes[victim].kill()
            await assert_eventually(lambda: cp.registry.nodes[victim].state is NodeState.UNAVAILABLE, timeout=5)
            index = cp.scheduler.prefixes
            assert victim not in index._by_node  # it lost its entries
            assert victim not in {node for holders in index._holders.values() for node in holders}
            moved = await _all_turn(conversations, edge)
            for home, now in zip(homes, moved, strict=True):
                assert now == home if home != victim else now != victim, (homes, moved)
            assert await _all_turn(conversations, edge) == moved  # the moved ones stick to their new node


async def test_a_turn_waits_for_its_busy_node_while_another_has_room(pki: Pki, tmp_path: Path) -> None:
    """One run a node (a llama.cpp server's one slot): every node is busy and turns queue in the control-plane;
    each turn waits for the node holding its conversation rather than taking whichever frees first.

    node-b runs four times slower than node-a, so in every round node-a has served both its turns
    while node-b's second waits: node-a is idle then, and the turn waits for node-b all the same.
    """
    policy = write_policy(tmp_path, "defaults: {policy: prefix, prefix_imbalance: 1.0}\n")
    async with build_control_plane(cp_settings(pki, tmp_path, policy_path=policy)) as cp:
        pace = {"node-a": 40, "node-b": 10}  # tokens a second: 0.1 s and 0.4 s a turn
        routes = {
            node: [
                {
                    "model": MODEL,
                    "adapter": "mock",
                    "max_concurrency": 1,
                    "options": {"tokens": 4, "tokens_per_second": tokens},
                }
            ]
            for node, tokens in pace.items()
        }
        with nodes_serving(pki, tmp_path, cp_port(cp), routes):
            await all_ready(cp, *pace)
            edge = await client(cp, pki)
            conversations = [_Conversation(index) for index in range(4)]
            homes = [*await _all_turn(conversations[:2], edge), *await _all_turn(conversations[2:], edge)]
            assert sorted(homes) == ["node-a", "node-a", "node-b", "node-b"]  # two at once go to both nodes
            rounds = 3
            for _ in range(rounds):
                assert await _all_turn(conversations, edge) == homes
            decisions = cp.metrics.prefix_decisions
            assert decisions.labels("other", "hit")._value.get() == rounds * len(conversations)
            waits = cp.metrics.prefix_waits.labels("other")._value.get()
            assert waits > 0  # some turn passed up a free node
            assert waits >= rounds  # node-b's second turn in every round
            assert not cp.scheduler.waiting  # every run that waited for a node stopped counting in its load
