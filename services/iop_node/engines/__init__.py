"""Servers the node runs itself: a route with an ``engine`` (llama.cpp, vllm, ollama, command).

    settings.py     each engine's settings (a route's ``serve``) and the command line it starts
    process.py      the process: exec shim (dies with the node), rotating log, pid file, leftovers
    supervisor.py   one server kept running: ready probe, liveness probe, restarts, FAILED, stop
    served.py       the route's adapter: the supervisor plus the vllm/ollama adapter speaking to it

:func:`served_adapter` builds a route's adapter from its settings; ``bootstrap.build_adapters``
calls it for each route with an engine, and ``NodeApp.start`` calls :func:`kill_leftovers` first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.adapters import AdapterEntry
from iop_node.adapters.http import KINDS
from iop_node.engines.process import EngineFiles, kill_leftovers
from iop_node.engines.served import ServedAdapter
from iop_node.engines.settings import ENGINE_SETTINGS
from iop_node.metrics import NodeMetrics
from iop_node.ports import Adapter
from iop_node.settings import ConfigError, Problem, RouteSettings
from iop_wire.settings import problems, resolve_paths

__all__ = ["ServedAdapter", "kill_leftovers", "served_adapter"]

_CHECKED_URL = "http://127.0.0.1:1"  # a stand-in base_url while the route's options are checked
_COUNTS = {"vllm": "tokenize", "llama.cpp": "chat"}
"""How the server each engine runs counts tokens (the vllm adapter's ``count_tokens``), unless the route says."""


def served_adapter(
    route: RouteSettings,
    index: int,
    *,
    speaker: AdapterEntry,
    engines_dir: Path,
    base: Path | None,
    metrics: NodeMetrics,
) -> ServedAdapter:
    """The adapter of route ``index`` (which has an engine); ConfigError naming every bad
    ``routes.N.serve`` and ``routes.N.options`` key. ``speaker``: the speaking adapter's registry entry."""
    assert route.engine is not None
    settings_model = ENGINE_SETTINGS[route.engine]
    options_model, factory = speaker
    target = route.target or route.model
    found: list[Problem] = []
    try:
        settings = settings_model.model_validate(_resolved(settings_model, route.serve, base))
    except ValidationError as exc:
        found += problems(exc, f"routes.{index}.serve")
    options_data = {**_resolved(options_model, route.options, base), "target": target}
    if route.engine in _COUNTS and "count_tokens" in options_model.model_fields:
        options_data.setdefault("count_tokens", _COUNTS[route.engine])
    try:
        options = options_model.model_validate({**options_data, "base_url": _CHECKED_URL})
    except ValidationError as exc:
        found += problems(exc, f"routes.{index}.options")
    if found:
        raise ConfigError(found)

    def speak(base_url: str) -> Adapter:
        adapter: Adapter = factory({route.model: options_model.model_validate({**options_data, "base_url": base_url})})
        return adapter

    kinds = [KINDS[kind] for kind in getattr(options, "kinds", ())]
    if getattr(options, "count_tokens", None) is not None:
        kinds.append(pb.RUN_KIND_COUNT_TOKENS)
    return ServedAdapter(
        engine=route.engine,
        model=route.model,
        target=target,
        settings=settings,
        files=EngineFiles(engines_dir, route.model),
        metrics=metrics,
        speaker=speak,
        info=pb.ModelInfo(name=route.model, kinds=kinds),
    )


def _resolved(model: type[BaseModel], data: dict[str, Any], base: Path | None) -> dict[str, Any]:
    return dict(data) if base is None else resolve_paths(model, data, base)
