"""The policy file: what it sets, and validation errors in one line naming the key."""

from __future__ import annotations

import pytest

from iop_control_plane.policy import load_policy
from iop_wire.settings import ConfigError

_EXAMPLE = """
defaults: {policy: least-loaded, priority: 0, attempts: 2, caller_concurrency: 100}
aliases: {gpt-4o: llama-70b}
routes:
  chat: {llama-8b: 90, qwen-7b: 10}
models:
  llama-70b: {policy: session-affinity, labels: {gpu: h100}, attempts: 3, migrations: 1, priority: 5}
  qwen-7b: {policy: round-robin}
callers:
  batch-worker: {max_concurrency: 64, priority: -10}
  vip: {max_concurrency: 1000}
"""


def test_the_example_loads_and_answers_per_model_and_caller() -> None:
    policy = load_policy(_EXAMPLE)
    assert policy.aliases == {"gpt-4o": "llama-70b"}
    assert policy.routes == {"chat": {"llama-8b": 90, "qwen-7b": 10}}
    assert policy.models["llama-70b"].labels == {"gpu": "h100"}
    assert [policy.policy_for(model) for model in ("llama-70b", "qwen-7b", "other")] == [
        "session-affinity",
        "round-robin",
        "least-loaded",
    ]
    assert [policy.attempts_for(model) for model in ("llama-70b", "other")] == [3, 2]
    assert [policy.migrations_for(model) for model in ("llama-70b", "other")] == [1, 2]
    assert policy.priority_for("llama-70b", "batch-worker") == -10  # the caller's first
    assert policy.priority_for("llama-70b", "someone") == 5  # then the model's
    assert policy.priority_for("other", None) == 0  # then the default
    assert [policy.caller_limit(caller) for caller in ("batch-worker", "vip", "someone")] == [64, 1000, 100]


def test_a_route_or_alias_may_migrate_when_a_model_it_names_does() -> None:
    policy = load_policy(
        "defaults: {migrations: 0}\nmodels: {big: {migrations: 2}}\n"
        "aliases: {a-big: big, a-small: small}\nroutes: {mixed: {big: 1, small: 1}, smalls: {small: 1}}\n"
    )
    allowed = {name: policy.may_migrate(name) for name in ("big", "small", "a-big", "a-small", "mixed", "smalls")}
    assert allowed == {"big": True, "small": False, "a-big": True, "a-small": False, "mixed": True, "smalls": False}


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n", "{}"])
def test_an_empty_policy_is_the_defaults(text: str) -> None:
    policy = load_policy(text)
    assert (policy.policy_for("m"), policy.attempts_for("m"), policy.caller_limit("c")) == ("least-loaded", 2, None)
    assert policy.migrations_for("m") == 2


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("models: {m: {polcy: round-robin}}", "models.m.polcy: Extra inputs are not permitted"),
        ("defaults: {policy: fastest}", "defaults.policy: Input should be 'least-loaded', 'round-robin'"),
        ("routes: {chat: {a: 90, b: -1}}", "routes.chat.b: Input should be greater than or equal to 0"),
        ("routes: {chat: {a: 0, b: 0}}", "routes.chat: weights add up to 0"),
        ("routes: {chat: {}}", "routes.chat: names no model"),
        ("routes: {chat: {a: ninety}}", "routes.chat.a: Input should be a valid integer"),
        ("aliases: {x: y, y: z}", "aliases.x: 'y' is an alias; name the model it stands for"),
        ("aliases: {x: chat}\nroutes: {chat: {a: 1}}", "aliases.x: 'chat' is a route; routes and aliases name models"),
        ("aliases: {chat: a}\nroutes: {chat: {b: 1}}", "aliases.chat: is also a route"),
        ("aliases: {x: a}\nroutes: {chat: {x: 1}}", "routes.chat.x: 'x' is an alias"),
        ("models: {m: {attempts: 0}}", "models.m.attempts: Input should be greater than or equal to 1"),
        ("models: {m: {migrations: -1}}", "models.m.migrations: Input should be greater than or equal to 0"),
        ("defaults: {migrations: 11}", "defaults.migrations: Input should be less than or equal to 10"),
        ("defaults: {migrations: many}", "defaults.migrations: Input should be a valid integer"),
        ("models: {m: {labels: {gpu: [h100]}}}", "models.m.labels.gpu: Input should be a valid string"),
        ("callers: {c: {max_concurrency: 0}}", "callers.c.max_concurrency: Input should be greater than or equal to 1"),
        ("callers: {c: {priority: 3000000000}}", "callers.c.priority: Input should be less than or equal to 2147"),
        ("aliases: {x: ''}", "aliases.x: String should have at least 1 character"),
        ("tenants: {}", "tenants: Extra inputs are not permitted"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_key(text: str, error: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_policy(text)
    message = str(caught.value)
    assert message.startswith(error) and "\n" not in message


def test_every_bad_key_is_named_in_the_same_line() -> None:
    with pytest.raises(ConfigError) as caught:
        load_policy("defaults: {attempts: 99}\nmodels: {m: {policy: random}}\naliases: {a: b, b: c}")
    keys = [problem.key for problem in caught.value.problems]
    assert keys == ["defaults.attempts", "models.m.policy"]  # field errors first; names resolve only when fields pass
    assert "; " in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("models: {m: [", "policy: not valid YAML at line 1"),
        ("- a\n- b\n", "policy: the top level must be a mapping of keys"),
        ("just text", "policy: the top level must be a mapping of keys"),
    ],
)
def test_a_file_that_is_not_a_mapping_says_so(text: str, error: str) -> None:
    with pytest.raises(ConfigError, match="^" + error):
        load_policy(text)


def test_a_policy_is_frozen() -> None:
    policy = load_policy(_EXAMPLE)
    with pytest.raises(ValueError, match="frozen"):
        policy.defaults = policy.defaults  # type: ignore[misc]
