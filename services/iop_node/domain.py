"""The node's own data: what a run executes (ExecutionSpec) and what is recorded about it (RunRecord)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeAlias

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_wire.errors import IopError

__all__ = ["ROLE_NAMES", "ExecutionSpec", "RunKind", "RunRecord", "RunStatus", "cannot_count", "refuse_continuation"]

RunKind: TypeAlias = pb.RunKind.ValueType
"""A ``RunKind`` value (``pb.RUN_KIND_CHAT``, ...)."""


class RunStatus(StrEnum):
    """Where a run is in its life, as recorded in the run history."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True, slots=True)
class ExecutionSpec:
    """A checked request and what the router resolved for it: all an adapter needs to execute one run.

    Everything the client sent (run id, model, messages, prompt, stream, metadata) is read from
    ``request``; the other fields hold only what the router decided.
    """

    request: pb.RunRequest
    """The request as it arrived; adapters must not change it."""
    adapter: str
    """Name of the adapter that executes it; for a route with an engine, the engine (llama.cpp, ...)."""
    target_model: str
    """The backend's name for the model (route ``target``; defaults to ``request.model``)."""
    kind: RunKind
    """Chat, completion, embedding or count tokens (an unset kind resolved to chat)."""
    sampling: pb.Sampling
    """The request's sampling over the route's defaults; an unset field means the backend's default."""
    openai_fields: dict[str, Any]
    """The request's OpenAI fields, decoded once, to pass through untouched."""
    deadline: datetime.datetime | None = None
    """When the run must be finished, if the client set a deadline."""

    def prompt_text(self) -> str:
        """The input as one text: prompt entries, or the conversation as ``role: text`` lines."""
        if self.request.prompt:
            return "\n".join(self.request.prompt)
        lines = []
        for message in self.request.messages:
            text = "".join(part.text for part in message.content)
            lines.append(f"{ROLE_NAMES[message.role]}: {text}")
        return "\n".join(lines)


def refuse_continuation(spec: ExecutionSpec, why: str) -> None:
    """INVALID_ARGUMENT (param ``continuation``) when ``spec`` continues delivered output and its
    adapter cannot, ``why`` saying so: a relay must not take a fresh answer for the rest of one."""
    if spec.request.HasField("continuation"):
        raise IopError(
            pb.ERROR_CODE_INVALID_ARGUMENT,
            f"model {spec.request.model!r} cannot continue delivered output: {why}",
            param="continuation",
        )


def cannot_count(spec: ExecutionSpec, why: str = "") -> IopError:
    """INVALID_ARGUMENT (param ``model``) for a RUN_KIND_COUNT_TOKENS run whose route's backend cannot
    count tokens, ``why`` saying more where there is more to say."""
    message = f"the backend of model {spec.request.model!r} cannot count tokens"
    return IopError(pb.ERROR_CODE_INVALID_ARGUMENT, f"{message}: {why}" if why else message, param="model")


ROLE_NAMES = {number: name.removeprefix("ROLE_").lower() for name, number in pb.Role.items()}
"""Role numbers -> OpenAI's role names (user, assistant, ...)."""


@dataclass(slots=True)
class RunRecord:
    """One row of the run history."""

    run_id: str
    """The run id the client chose; unique only within its connection."""
    node_id: str
    model: str
    status: RunStatus
    caller: str = ""
    """Who the run is attributed to: the peer itself, or a caller named by a peer trusted to act for others."""
    peer: str = ""
    """The certificate name of the peer that sent the request (it vouches for ``caller``)."""
    connection: str = ""
    """The connection the request arrived on: the scope of ``run_id``."""
    adapter: str = ""
    error_code: str = ""
    error_message: str = ""
    received_at: datetime.datetime | None = None
    started_at: datetime.datetime | None = None
    first_token_at: datetime.datetime | None = None
    finished_at: datetime.datetime | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_estimated: bool = False
    """True when the node counted the tokens (~4 characters a token, or streamed chunks): the backend reported none."""
    finish_reason: str = ""
    stderr_tail: str = ""
    extra: dict[str, str] = field(default_factory=dict)
