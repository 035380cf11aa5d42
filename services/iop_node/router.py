"""The router: a request's model name -> the route that serves it -> an ExecutionSpec."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.domain import ExecutionSpec, RunKind
from iop_node.settings import RouteSettings
from iop_wire.errors import IopError

__all__ = ["Limits", "Router", "merge_sampling"]


@dataclass(frozen=True, slots=True)
class Limits:
    """What a request may ask for on this node."""

    max_prompt_chars: int
    """Largest prompt, all message text together with a continuation's delivered text."""
    max_tokens: int
    """Largest max_tokens."""


class Router:
    """Resolves requests against the route table, checking them on the way."""

    def __init__(self, routes: Iterable[RouteSettings], limits: Limits) -> None:
        self._routes = {route.model: route for route in routes}
        self._defaults = {
            route.model: pb.Sampling(**route.defaults.model_dump(exclude_none=True)) for route in self._routes.values()
        }
        self.limits = limits

    @property
    def routes(self) -> list[RouteSettings]:
        """The route table."""
        return list(self._routes.values())

    def resolve(self, request: pb.RunRequest) -> ExecutionSpec:
        """The spec for ``request``; IopError (MODEL_NOT_FOUND, INVALID_ARGUMENT) if it cannot run here."""
        route = self._routes.get(request.model)
        if route is None:
            known = ", ".join(sorted(self._routes)) or "none"
            raise IopError(
                pb.ERROR_CODE_MODEL_NOT_FOUND, f"model {request.model!r} is not served here (models: {known})"
            )
        kind = _KINDS.get(request.kind)
        if kind is None:
            raise _invalid(f"unknown run kind {request.kind}")
        self._check(request, kind)
        return ExecutionSpec(
            request=request,
            adapter=route.engine or route.adapter,
            target_model=route.target or route.model,
            kind=kind,
            sampling=merge_sampling(self._defaults[route.model], request.sampling),
            openai_fields=_integral(json_format.MessageToDict(request.openai_fields))
            if request.HasField("openai_fields")
            else {},
            deadline=request.deadline.ToDatetime(datetime.UTC) if request.HasField("deadline") else None,
        )

    def _check(self, request: pb.RunRequest, kind: RunKind) -> None:
        if kind in _OF_MESSAGES and not request.messages:
            what = "a chat run needs" if kind == pb.RUN_KIND_CHAT else "counting tokens needs"
            raise _invalid(f"messages is empty: {what} at least one message", "messages")
        if kind not in _OF_MESSAGES and not request.prompt:
            name = pb.RunKind.Name(kind).removeprefix("RUN_KIND_").lower()
            param = "input" if kind == pb.RUN_KIND_EMBEDDING else "prompt"
            raise _invalid(f"prompt is empty: {name} runs need a prompt", param)
        if request.HasField("continuation"):
            _check_continuation(request, kind)
        # the delivered text to continue goes to the backend as prompt too
        size = sum(map(len, request.prompt)) + len(request.continuation.text)
        for message in request.messages:
            if message.role == pb.ROLE_UNSPECIFIED:
                raise _invalid("every message needs a role", "messages")
            for part in message.content:
                size += len(part.text)
        if size > self.limits.max_prompt_chars:
            raise _invalid(f"prompt of {size} characters is over this node's limit of {self.limits.max_prompt_chars}")
        self._check_sampling(request.sampling)

    def _check_sampling(self, sampling: pb.Sampling) -> None:
        """The ranges runtime.proto gives each field; NaN and infinities are outside every range."""
        for name, (low, high) in _SAMPLING_RANGES.items():
            if sampling.HasField(name):  # type: ignore[arg-type]  # a name from the table above
                value = getattr(sampling, name)
                if not low <= value <= high:  # False for NaN too
                    raise _invalid(f"sampling.{name} must be between {low:g} and {high:g}, got {value}", name)
        if sampling.HasField("max_tokens") and not 0 < sampling.max_tokens <= self.limits.max_tokens:
            limit = self.limits.max_tokens
            message = f"sampling.max_tokens must be between 1 and {limit}, got {sampling.max_tokens}"
            raise _invalid(message, "max_tokens")
        if sampling.HasField("top_k") and sampling.top_k < 1:  # "the k most likely tokens": one at least
            raise _invalid(f"sampling.top_k must be at least 1, got {sampling.top_k}", "top_k")
        if len(sampling.stop) > _MAX_STOP:
            raise _invalid(f"sampling.stop takes at most {_MAX_STOP} sequences, got {len(sampling.stop)}", "stop")


def _check_continuation(request: pb.RunRequest, kind: RunKind) -> None:
    """The shapes a continuation can have (runtime.proto's Continuation): one output to extend."""
    if kind == pb.RUN_KIND_EMBEDDING:
        raise _invalid("an embedding run has no output to continue", "continuation")
    if kind == pb.RUN_KIND_COUNT_TOKENS:
        raise _invalid("counting tokens has no output to continue", "continuation")
    if kind == pb.RUN_KIND_COMPLETION and len(request.prompt) != 1:
        message = f"a continued completion has one prompt, not {len(request.prompt)}"
        raise _invalid(message, "continuation")
    if request.continuation.token_ids and len(request.continuation.token_ids) != request.continuation.completion_tokens:
        message = (
            f"continuation has {len(request.continuation.token_ids)} token ids but completion_tokens "
            f"{request.continuation.completion_tokens}"
        )
        raise _invalid(message, "continuation")


_SAMPLING_RANGES = {  # runtime.proto's Sampling comments (OpenAI's ranges), bounds included
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
_MAX_STOP = 4  # "up to 4 sequences"

_OF_MESSAGES = (pb.RUN_KIND_CHAT, pb.RUN_KIND_COUNT_TOKENS)
"""Kinds that read a conversation (``messages``); the others read ``prompt``."""
_KINDS: dict[int, RunKind] = {kind: kind for kind in pb.RunKind.values()}
_KINDS[pb.RUN_KIND_UNSPECIFIED] = pb.RUN_KIND_CHAT  # unset means chat


def _integral(value: Any) -> Any:
    """``value`` with whole numbers as ints: a Struct holds every number as a double, and backends
    read ``"top_logprobs": 5.0`` or ``"n": 1.0`` as a type error."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _integral(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral(item) for item in value]
    return value


def _invalid(message: str, param: str = "") -> IopError:
    return IopError(pb.ERROR_CODE_INVALID_ARGUMENT, message, param=param)


def merge_sampling(defaults: pb.Sampling, given: pb.Sampling) -> pb.Sampling:
    """``defaults`` with every field ``given`` sets replaced; a non-empty ``stop`` replaces the whole list."""
    merged = pb.Sampling()
    merged.CopyFrom(defaults)
    for field, value in given.ListFields():  # set optionals (zeros too) and non-empty lists only
        if field.name == "stop":
            del merged.stop[:]
            merged.stop.extend(value)
        else:
            setattr(merged, field.name, value)
    return merged
