"""The policy file: how runs are placed, limited and retried (YAML, validated in one go).

    defaults: {policy: least-loaded, priority: 0, attempts: 2, migrations: 2, caller_concurrency: null,
               fairness: tokens, prefix_imbalance: 0.5}
    aliases: {gpt-4o: llama-70b}                   # a name clients use -> a model nodes serve
    routes: {chat: {llama-8b: 90, qwen-7b: 10}}    # a name -> models by weight
    models:
      llama-70b: {policy: session-affinity, labels: {gpu: h100}, attempts: 3, migrations: 1, fairness: fifo}
      qwen-7b: {policy: prefix}                    # to the node that saw the prompt's start
    callers:
      batch-worker: {max_concurrency: 64, priority: -10, weight: 0.5}

Aliases and routes name models that nodes serve, never each other. :func:`load_policy` raises
:class:`~iop_wire.settings.ConfigError`, one line naming every bad key.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from iop_wire.settings import ConfigError, Section, SettingError, problems

__all__ = ["CallerPolicy", "Defaults", "Fairness", "ModelPolicy", "Policy", "PolicyName", "load_policy"]

PolicyName = Literal["least-loaded", "round-robin", "session-affinity", "prefix"]
"""How a node is picked among a model's candidates."""

Fairness = Literal["fifo", "tokens"]
"""Which waiting run of a priority gets a freed slot: the earliest (fifo), or the earliest of the caller
served the fewest weighted tokens so far (tokens: :mod:`iop_control_plane.fairness`)."""

Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Weight = Annotated[int, Field(ge=0)]
Imbalance = Annotated[float, Field(ge=0)]
Name = Annotated[str, Field(min_length=1)]


class Defaults(Section):
    """What applies where a model or caller says nothing."""

    policy: PolicyName = "least-loaded"
    """Scheduling policy."""
    priority: Priority = 0
    """Priority of a run that sets none (higher first; interactive 0, batch below)."""
    attempts: int = Field(2, ge=1, le=10)
    """Nodes a run may be tried on before it fails (the first included)."""
    migrations: int = Field(2, ge=0, le=10)
    """Times a run whose node was lost after output may be continued on another node (0: never)."""
    caller_concurrency: int | None = Field(None, ge=1)
    """Runs one caller may have in progress; None: no limit."""
    fairness: Fairness = "tokens"
    """Order of waiting runs within a priority."""
    prefix_imbalance: Imbalance = 0.5
    """``prefix`` policy: how far the load / capacity of the node holding a run's prompt prefix may
    exceed the least loaded candidate's before the least loaded takes the run instead."""


class ModelPolicy(Section):
    """Settings of one model (as nodes serve it, after alias and route resolution)."""

    policy: PolicyName | None = None
    """Scheduling policy; None: the default."""
    labels: dict[Name, str] = Field(default_factory=dict)
    """Labels a node must carry, all of them, to run this model."""
    priority: Priority | None = None
    """Priority of its runs that set none; None: the caller's, else the default."""
    attempts: int | None = Field(None, ge=1, le=10)
    """Nodes a run may be tried on; None: the default."""
    migrations: int | None = Field(None, ge=0, le=10)
    """Times a run cut after output may be continued on another node; None: the default."""
    fairness: Fairness | None = None
    """Order of its waiting runs within a priority; None: the default."""
    prefix_imbalance: Imbalance | None = None
    """``prefix`` policy: the imbalance its prefix holders may have over the least loaded; None: the default."""


class CallerPolicy(Section):
    """Settings of one caller (the request's caller id, else the peer's certificate name)."""

    max_concurrency: int | None = Field(None, ge=1)
    """Runs it may have in progress; None: the default."""
    priority: Priority | None = None
    """Priority of its runs that set none; None: the model's, else the default."""
    weight: float = Field(1.0, gt=0, le=1e6)
    """Its share of a contended model against other callers' (fairness tokens): 2 is served twice the tokens of 1."""


class Policy(Section):
    """The whole policy file."""

    defaults: Defaults = Defaults()
    """Fallbacks for models and callers."""
    aliases: dict[Name, Name] = Field(default_factory=dict)
    """Another name for a model."""
    routes: dict[Name, dict[Name, Weight]] = Field(default_factory=dict)
    """A name whose runs are split between models by weight (0: only when the others have no candidate)."""
    models: dict[Name, ModelPolicy] = Field(default_factory=dict)
    """Per-model settings."""
    callers: dict[Name, CallerPolicy] = Field(default_factory=dict)
    """Per-caller settings."""

    @model_validator(mode="after")
    def _names_resolve_once(self) -> Policy:
        if found := _unresolvable(self):
            raise SettingError(*found)
        return self

    def policy_for(self, model: str) -> PolicyName:
        """The scheduling policy of ``model``."""
        settings = self.models.get(model)
        return settings.policy if settings and settings.policy else self.defaults.policy

    def imbalance_for(self, model: str) -> float:
        """How far past the least loaded candidate's load / capacity a prefix holder of ``model`` may be."""
        settings = self.models.get(model)
        if settings and settings.prefix_imbalance is not None:
            return settings.prefix_imbalance
        return self.defaults.prefix_imbalance

    def places_by_prefix(self, name: str) -> bool:
        """Whether a run of ``name`` (a model, an alias or a route) may be placed by prompt prefix: only
        then is its prompt hashed (once per run, in the relay)."""
        if (alias := self.aliases.get(name)) is not None:
            return self.policy_for(alias) == "prefix"
        targets = self.routes.get(name) or (name,)
        return any(self.policy_for(target) == "prefix" for target in targets)

    def priority_for(self, model: str, caller: str | None) -> int:
        """Priority of a run that sets none: the caller's, else the model's, else the default."""
        by_caller, by_model = self.callers.get(caller or ""), self.models.get(model)
        if by_caller and by_caller.priority is not None:
            return by_caller.priority
        if by_model and by_model.priority is not None:
            return by_model.priority
        return self.defaults.priority

    def attempts_for(self, model: str) -> int:
        """Nodes a run of ``model`` may be tried on, the first included."""
        settings = self.models.get(model)
        return settings.attempts if settings and settings.attempts else self.defaults.attempts

    def migrations_for(self, model: str) -> int:
        """Times a run of ``model`` cut after output may be continued on another node."""
        settings = self.models.get(model)
        return settings.migrations if settings and settings.migrations is not None else self.defaults.migrations

    def may_migrate(self, name: str) -> bool:
        """Whether a run of ``name`` (a model, an alias or a route) may be continued on any model it can be
        placed on: only then does the relay keep its output."""
        if (alias := self.aliases.get(name)) is not None:
            return self.migrations_for(alias) > 0
        return any(self.migrations_for(target) > 0 for target in self.routes.get(name) or (name,))

    def caller_limit(self, caller: str) -> int | None:
        """Runs ``caller`` may have in progress; None: no limit."""
        settings = self.callers.get(caller)
        limit = settings.max_concurrency if settings else None
        return limit or self.defaults.caller_concurrency

    def fairness_for(self, name: str) -> Fairness:
        """Order of waiting runs for ``name`` (a model, or an alias of one; a route takes the default)."""
        settings = self.models.get(self.aliases.get(name, name))
        return settings.fairness if settings and settings.fairness else self.defaults.fairness

    def caller_weight(self, caller: str) -> float:
        """``caller``'s share of a contended model, against 1 for a caller the policy does not name."""
        settings = self.callers.get(caller)
        return settings.weight if settings else 1.0


def _unresolvable(policy: Policy) -> list[tuple[str, str]]:
    """(key, problem) for each alias or route that does not name models directly."""
    found = [(f"aliases.{name}", _chained(target, policy)) for name, target in policy.aliases.items()]
    found += [(f"aliases.{name}", "is also a route") for name in policy.aliases if name in policy.routes]
    for name, route in policy.routes.items():
        found += [(f"routes.{name}.{target}", _chained(target, policy)) for target in route]
        if not sum(route.values()):
            found.append((f"routes.{name}", "weights add up to 0" if route else "names no model"))
    return [(key, problem) for key, problem in found if problem]


def _chained(target: str, policy: Policy) -> str:
    """Why ``target`` cannot be resolved to: it is itself an alias or a route; empty if it is a model."""
    if target in policy.aliases:
        return f"{target!r} is an alias; name the model it stands for"
    if target in policy.routes:
        return f"{target!r} is a route; routes and aliases name models, not each other"
    return ""


def load_policy(text: str) -> Policy:
    """The policy in ``text`` (YAML); ConfigError naming every bad key in one line."""
    try:
        data: Any = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"policy: not valid YAML{where} ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError("policy: the top level must be a mapping of keys")
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(problems(exc)) from None
