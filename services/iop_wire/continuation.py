"""What a relay keeps of a run's delivered output, to continue the run elsewhere if its source is lost.

A relay (the control-plane between a requester and a node, an edge between a client and
control-planes) feeds every delta it forwards to :meth:`Delivered.add`. When the source is lost
after output, :meth:`Delivered.continuation` is the ``Continuation`` to send with the run to
another source: everything the requester has, from the run's first token (a run that arrived
with a continuation of its own starts from it), so a second migration carries the first one's
output too. A run whose output cannot be handed on (tool-call fragments, embeddings, more text
than ``limit``) is not continuable; :attr:`Delivered.why_not` says why.

    delivered = Delivered(request)
    ... delivered.add(event.delta) for each delta forwarded ...
    continuation = delivered.continuation()  # None: delivered.why_not
    retry.continuation.CopyFrom(continuation); delivered.sent(continuation)
"""

from __future__ import annotations

from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = ["DEFAULT_LIMIT", "SHAPING_FIELDS", "STOPPED_CODES", "Delivered"]

DEFAULT_LIMIT = 512 * 1024
"""Characters of delivered text kept per run (about 128,000 tokens): a longer run ends NODE_LOST
rather than hold more. At most 2 MiB of UTF-8, so a continuation fits the 4 MiB frame beside its
prompt."""

STOPPED_CODES = frozenset({pb.ERROR_CODE_UNAVAILABLE, pb.ERROR_CODE_SHUTTING_DOWN})
"""Retryable errors by which a source (a node, a control-plane) says it stopped serving a run: a relay
opens the run elsewhere before its output, and continues it after, as for a lost connection."""

_MAX_COUNT = 2**32 - 1
"""Largest token count a Continuation carries (uint32)."""

_IDS_OVER_CHARS = 64
"""Token ids held beyond one per delivered character (tokens of no text: special tokens, a character
split over several): more, and the ids are dropped and the count becomes an estimate."""

SHAPING_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "format")
"""Request fields that constrain the output's shape: the backend would start a new document after the
delivered half of one, so such runs are not continued."""


class Delivered:
    """The output of one run relayed so far, and how to continue the run from it."""

    __slots__ = ("_chars", "_count", "_ids", "_last", "_limit", "_sent", "_texts", "_tools", "why_not")

    def __init__(self, request: pb.RunRequest, *, limit: int = DEFAULT_LIMIT) -> None:
        self._limit = limit
        self._last: pb.Continuation | None = None
        self._sent: list[pb.Continuation | None] = []  # the _last before each sent(), for refused()
        self._texts: list[str] = []
        self._ids: list[int] | None = []  # None once a delta's text came without its ids
        self._chars = self._count = 0
        self.why_not = ""
        """Empty while the run can be continued; else why not, for the requester's NODE_LOST message."""
        if request.kind == pb.RUN_KIND_EMBEDDING:
            self.why_not = "embeddings are not continued"
        elif request.kind == pb.RUN_KIND_COMPLETION and len(request.prompt) != 1:
            self.why_not = f"a completion of {len(request.prompt)} prompts is not continued"
        # Only a run offered tools streams tool calls beside text: for the others a text delta's
        # tool calls are not read (a microsecond a delta); deltas without text are checked always.
        fields = request.openai_fields.fields
        self._tools = "tools" in fields or "functions" in fields
        if not self.why_not and (shaped := _structured(request)):
            self.why_not = f"output constrained by {shaped} is not continued (it would start anew)"
        if request.HasField("continuation"):
            base = request.continuation
            self._last = base
            self._texts.append(base.text)
            self._chars, self._count = len(base.text), base.completion_tokens
            ids_cover_text = bool(base.token_ids) or not base.text
            self._ids = (
                list(base.token_ids) if ids_cover_text and len(base.token_ids) == base.completion_tokens else None
            )

    def add(self, delta: pb.RunDelta) -> None:
        """Keep ``delta``, forwarded to the requester."""
        if self.why_not:
            return
        text = delta.text
        if not text or self._tools:  # a text delta of a run offered no tools carries no tool calls
            if delta.tool_calls or delta.embeddings:
                self._give_up("tool calls are not continued" if delta.tool_calls else "embeddings are not continued")
                return
            if not text:
                return
        self._chars += len(text)
        if self._chars > self._limit:
            self._give_up(f"its output is over the {self._limit} characters a relay keeps to continue it")
            return
        self._texts.append(text)
        if self._ids is not None:  # once one delta came without ids, the count is an estimate: not read again
            ids = delta.token_ids
            if len(self._ids) + len(ids) > self._chars + _IDS_OVER_CHARS:  # a peer's ids are not held unbounded
                self._ids = None
            elif ids:
                self._count += len(ids)
                self._ids.extend(ids)
                return
            self._ids = None
        self._count += 1  # a backend streams about one token per delta; an estimate, said so by the empty ids

    @property
    def text(self) -> str:
        """Every text delivered, from the run's first token."""
        if len(self._texts) > 1:
            self._texts[:] = ["".join(self._texts)]
        return self._texts[0] if self._texts else ""

    def continuation(self) -> pb.Continuation | None:
        """The continuation for the run's next attempt; None if it cannot be continued (``why_not``)."""
        if self.why_not:
            return None
        last = self._last
        return pb.Continuation(
            text=self.text,
            token_ids=self._ids or [],
            completion_tokens=min(self._count, _MAX_COUNT),
            migration=last.migration + 1 if last is not None else 1,
            # the lost attempt re-read what it was sent: about its delivered tokens
            continuation_prompt_tokens=min(last.continuation_prompt_tokens + last.completion_tokens, _MAX_COUNT)
            if last
            else 0,
        )

    def sent(self, continuation: pb.Continuation) -> None:
        """``continuation`` went out with the run's next attempt: the one after it counts its cost."""
        self._sent.append(self._last)
        self._last = continuation

    def refused(self) -> None:
        """The last continuation sent was refused before it was read: the next one neither counts its
        cost nor its number."""
        if self._sent:
            self._last = self._sent.pop()

    def _give_up(self, why: str) -> None:
        self.why_not = why
        self._texts.clear()
        self._ids = None


def _structured(request: pb.RunRequest) -> str:
    """The field that constrains the run's output to a shape, if one does ("" for plain text)."""
    fields = request.openai_fields.fields
    for name in SHAPING_FIELDS:
        if name not in fields:
            continue
        value = fields[name]
        if name == "response_format" and value.struct_value.fields["type"].string_value in ("", "text"):
            continue
        if value.WhichOneof("kind") != "null_value":
            return name
    return ""
