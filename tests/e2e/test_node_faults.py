"""A node killed (SIGKILL) under a run before its first token: the run is retried elsewhere and
succeeds. Killed mid-stream, a run is continued on another node, or ends with node_lost when its
adapter cannot continue it: test_migration.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from openai.types.chat import ChatCompletionMessageParam

from .conftest import Stack, wait_for
from .openai_schema import validate

GO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "go"}]


def test_node_killed_before_the_first_token_is_retried(two_nodes: Stack) -> None:
    client = two_nodes.client()
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(client.chat.completions.with_raw_response.create, model="mock-ttft", messages=GO)
        doomed = wait_for(lambda: two_nodes.running("mock-ttft"), 5, 0.01, "the run to start on a node")
        two_nodes.nodes[doomed].kill()
        raw = asked.result(timeout=30)
    validate("CreateChatCompletionResponse", raw.http_response.json())
    completion = raw.parse()
    assert len((completion.choices[0].message.content or "").split()) == 5
    survivor = next(node_id for node_id in two_nodes.nodes if node_id != doomed)
    record = two_nodes.run(survivor, raw.headers["x-request-id"])
    assert record is not None and record["status"] == "completed"
    assert not record["run_id"].endswith(".1"), "the run on the survivor is a second attempt"
