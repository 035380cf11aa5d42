"""What the control-plane's relay keeps of a run to continue it: delta bodies kept undecoded, decoded in order."""

from __future__ import annotations

import pytest

from iop_control_plane import relay
from iop_gen.pb.iop import runtime_pb2 as pb


def _delta(text: str, *, tool: bool = False) -> tuple[pb.RunEvent, bytes]:
    envelope = pb.Envelope(id="e", run_id="c.r.1")
    envelope.run_event.delta.text = text
    if tool:
        envelope.run_event.delta.tool_calls.add(index=0)
    return envelope.run_event, envelope.SerializeToString()


@pytest.mark.parametrize("held", [1 << 20, 300])  # kept until the migration; decoded as they go past the bound
def test_the_continuation_holds_every_delta_in_order_whatever_the_codec(
    monkeypatch: pytest.MonkeyPatch, held: int
) -> None:
    monkeypatch.setattr(relay, "_HELD_BYTES", held)
    output = relay._Output(pb.RunRequest(model="m"))
    words = [f"w{n} " for n in range(100)]
    for n, word in enumerate(words):
        event, body = _delta(word)
        output.add(event, body if n % 7 else b"")  # every 7th as a JSON relay gives it: no protobuf body
    continuation = output.continuation()
    assert continuation is not None
    assert (continuation.text, continuation.completion_tokens, continuation.migration) == ("".join(words), 100, 1)


def test_a_tool_call_kept_undecoded_still_makes_the_run_not_continuable() -> None:
    output = relay._Output(pb.RunRequest(model="m"))
    output.add(*_delta("a "))
    output.add(*_delta("", tool=True))
    assert output.continuation() is None and output.delivered.why_not == "tool calls are not continued"
