"""The node's own data: what a run executes (ExecutionSpec) and what is recorded about it (RunRecord)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from iop_gen.bp import iop as bp
from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = ["ROLE_NAMES", "ExecutionSpec", "RunRecord", "RunStatus", "SamplingSpec"]


class RunStatus(StrEnum):
    """Where a run is in its life, as recorded in the run history."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Sampling after the route's defaults were applied; None means the backend's default."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


@dataclass(frozen=True, slots=True)
class ExecutionSpec:
    """Everything an adapter needs to execute one run, resolved by the router."""

    run_id: str
    """The client's run id."""
    model: str
    """The model name the client asked for."""
    adapter: str
    """Name of the adapter that executes it."""
    target_model: str
    """The backend's name for the model (route ``target``; defaults to ``model``)."""
    kind: bp.RunKind
    """Chat, completion or embedding."""
    messages: tuple[pb.ChatMessage, ...]
    """The conversation (chat runs), as the upb messages the request arrived in."""
    prompt: tuple[str, ...]
    """Prompt entries (completion and embedding runs)."""
    sampling: SamplingSpec
    """Sampling with route defaults applied."""
    stream: bool
    """Whether the client streams."""
    openai_fields: dict[str, Any]
    """OpenAI fields to pass through untouched."""
    metadata: dict[str, str]
    """The request's metadata."""
    deadline: datetime.datetime | None = None
    """When the run must be finished, if the client set a deadline."""

    def prompt_text(self) -> str:
        """The input as one text: prompt entries, or the conversation as ``role: text`` lines."""
        if self.prompt:
            return "\n".join(self.prompt)
        lines = []
        for message in self.messages:
            text = "".join(part.text for part in message.content)
            lines.append(f"{ROLE_NAMES[message.role]}: {text}")
        return "\n".join(lines)


ROLE_NAMES = {number: name.removeprefix("ROLE_").lower() for name, number in pb.Role.items()}
"""Role numbers -> OpenAI's role names (user, assistant, ...)."""


@dataclass(slots=True)
class RunRecord:
    """One row of the run history."""

    run_id: str
    node_id: str
    model: str
    status: RunStatus
    caller: str = ""
    adapter: str = ""
    error_code: str = ""
    error_message: str = ""
    received_at: datetime.datetime | None = None
    started_at: datetime.datetime | None = None
    first_token_at: datetime.datetime | None = None
    finished_at: datetime.datetime | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    stderr_tail: str = ""
    extra: dict[str, str] = field(default_factory=dict)
