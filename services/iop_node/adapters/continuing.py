"""How the HTTP adapters continue a cut run (a run.request with a ``Continuation``): which kinds a
route continues, the tokens left to generate, and the usage of the whole run.

A continued run's backend request re-reads the delivered text as prompt and generates only what
follows; its usage must still be the whole run's (runtime.proto's Continuation): the requester's
prompt once, every delivered token, and the re-read recorded apart as continuation_prompt_tokens.
No backend reports which of its prompt tokens were the delivered text, so the re-read is taken to be
``continuation.completion_tokens`` (the delivered tokens, as the first attempt counted them).
"""

from __future__ import annotations

from collections.abc import Iterable

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters.http import KINDS
from iop_node.adapters.shapes import estimated_usage
from iop_node.domain import ExecutionSpec, refuse_continuation
from iop_wire.continuation import SHAPING_FIELDS

__all__ = ["check_continuable", "continuable_kinds", "limit_reached", "remaining_tokens", "whole_run_usage"]

_KIND_NAMES = {number: name for name, number in KINDS.items()}


def continuable_kinds(continued: Iterable[str], served: Iterable[str]) -> list[pb.RunKind.ValueType]:
    """The kinds a route continues (its ``continuation`` setting) among those it serves, for ModelInfo."""
    served = set(served)
    return [KINDS[kind] for kind in continued if kind in served]


def check_continuable(spec: ExecutionSpec, continued: Iterable[str]) -> None:
    """INVALID_ARGUMENT (param ``continuation``) for a continuation of a kind the route does not continue."""
    kind = _KIND_NAMES.get(spec.kind, "unknown")
    if kind not in continued:
        refuse_continuation(spec, f"its route continues {', '.join(continued) or 'no'} runs, not {kind}")
    shaped = [name for name in SHAPING_FIELDS if spec.openai_fields.get(name) not in (None, {"type": "text"})]
    if shaped:  # a grammar or schema constrains only what the backend generates: it would start a new document
        refuse_continuation(spec, f"output constrained by {shaped[0]} cannot be continued")


def remaining_tokens(spec: ExecutionSpec) -> int | None:
    """``max_tokens`` for this attempt: the run's limit less the tokens already delivered (None: no limit).

    0 means the delivered output already reached the limit: the run ends LENGTH with nothing more."""
    if not spec.sampling.HasField("max_tokens"):
        return None
    return max(spec.sampling.max_tokens - spec.request.continuation.completion_tokens, 0)


def limit_reached(spec: ExecutionSpec) -> pb.Usage | None:
    """The whole run's usage when the delivered output already reached ``max_tokens`` (the run ends
    LENGTH and no backend is asked), else None. Nothing was re-read: no continuation cost is added."""
    if not spec.request.HasField("continuation") or remaining_tokens(spec) != 0:
        return None
    usage = estimated_usage(spec, spec.request.continuation.completion_tokens)
    usage.continuation_prompt_tokens = spec.request.continuation.continuation_prompt_tokens
    return usage


def whole_run_usage(spec: ExecutionSpec, usage: pb.Usage | None) -> pb.Usage | None:
    """``usage`` of this attempt turned into the whole run's when ``spec`` continues a run.

    A count the backend reported includes the delivered text it re-read as prompt, taken out here; a
    count the node estimated (``usage.estimated``) was made from the requester's prompt alone."""
    if usage is None or not spec.request.HasField("continuation"):
        return usage
    continuation = spec.request.continuation
    reread = continuation.completion_tokens
    if not usage.estimated:
        usage.prompt_tokens = max(usage.prompt_tokens - reread, 0)
    usage.completion_tokens += continuation.completion_tokens
    usage.continuation_prompt_tokens = continuation.continuation_prompt_tokens + reread
    return usage
