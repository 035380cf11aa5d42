"""``iop up --model PATH.gguf[=NAME]`` and ``iop join ... --model``: GGUF files served by the node.

Each ``--model`` is checked before anything is written or started: the file must exist and begin
with GGUF's magic (the node would find out only after starting a server that cannot load it).
Its model name is ``NAME`` when given, else the file's stem lower-cased without its quantisation
suffix (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct``): the name clients ask for
should not change when the file is quantised differently. Each becomes a node route with
``engine: llama.cpp`` (``serve``: the model file and the Python that runs ``llama_cpp.server``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from iop_cli.output import CliError

__all__ = [
    "GGUF_MAGIC",
    "GgufModel",
    "default_name",
    "engine_logs",
    "engine_models",
    "gguf_models",
    "llama_routes",
    "servers_dir",
]

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file (llama.cpp's gguf.h: GGUF_MAGIC)."""
_QUANTISATION = re.compile(r"[._-](?:I?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32)$", re.IGNORECASE)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
# llama-cpp-python's server runs one completion at a time (a lock around its model): more runs at
# once would only wait inside it, where the control-plane cannot see them or send them elsewhere.
_LLAMA_CONCURRENCY = 1


@dataclass(frozen=True)
class GgufModel:
    """One ``--model``: the file (absolute) and the name clients use."""

    path: Path
    name: str


def gguf_models(specs: list[str]) -> list[GgufModel]:
    """The ``--model PATH[=NAME]`` values checked; CliError (one line, exit 2) naming the first bad one."""
    models = [_checked(spec) for spec in specs]
    names = [model.name for model in models]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise CliError(f"--model: two files are named {twice[0]!r}; name one with --model PATH=NAME", 2)
    return models


def default_name(path: Path) -> str:
    """The file's stem, lower-cased, without a quantisation suffix (``.Q4_1``, ``-q8_0``, ``.F16``)."""
    stem = path.name.removesuffix(path.suffix) if path.suffix.lower() == ".gguf" else path.name
    return _QUANTISATION.sub("", stem).lower() or stem.lower()


def llama_routes(models: list[GgufModel], python: Path) -> list[dict[str, Any]]:
    """One node route per model: llama-cpp-python's server run by the node with ``python``."""
    return [
        {
            "model": model.name,
            "engine": "llama.cpp",
            "max_concurrency": _LLAMA_CONCURRENCY,
            "serve": {"model_path": str(model.path), "python": str(python)},
        }
        for model in models
    ]


def servers_dir(state: Path) -> Path:
    """Where the node of ``state`` keeps its model servers' logs (``NAME.log``), pid files and folders."""
    return (state / "models").resolve()


def engine_models(node_config: Path) -> list[str]:
    """The models of ``node_config``'s routes that the node serves itself (an ``engine``); [] if unreadable."""
    try:
        routes = yaml.safe_load(node_config.read_text()).get("routes") or []
        return [str(route["model"]) for route in routes if isinstance(route, dict) and route.get("engine")]
    except (OSError, yaml.YAMLError, AttributeError, KeyError, TypeError):
        return []


def engine_logs(node_config: Path) -> list[Path]:
    """The log file of each model server ``node_config``'s node runs, where its ``engines_dir`` says
    ([] when it sets none: the node's default depends on where it was started)."""
    try:
        folder = yaml.safe_load(node_config.read_text()).get("engines_dir")
    except (OSError, yaml.YAMLError, AttributeError):
        return []
    if not isinstance(folder, str):
        return []
    from iop_node.engines.process import EngineFiles  # the node's own naming (a hash after names with / or :)

    return [EngineFiles(node_config.parent / folder, model).log for model in engine_models(node_config)]


def _checked(spec: str) -> GgufModel:
    path_text, equals, name = spec.rpartition("=") if "=" in spec and not Path(spec).exists() else (spec, "", "")
    path = Path(path_text).expanduser()
    if equals and not _NAME.fullmatch(name):
        raise CliError(f"--model {spec}: NAME must be letters, digits and . _ - : / (at most 128), not {name!r}", 2)
    try:
        with path.open("rb") as file:
            magic = file.read(len(GGUF_MAGIC))
    except IsADirectoryError:
        raise CliError(f"--model {spec}: {path} is a directory, not a GGUF file", 2) from None
    except OSError as exc:
        raise CliError(f"--model {spec}: cannot read {path}: {exc.strerror or exc}", 2) from None
    if magic != GGUF_MAGIC:
        raise CliError(f"--model {spec}: {path} is not a GGUF file (it does not begin with {GGUF_MAGIC!r})", 2)
    chosen = name or default_name(path)
    if not _NAME.fullmatch(chosen):
        raise CliError(f"--model {spec}: {chosen!r} is no model name; name it with --model PATH=NAME", 2)
    return GgufModel(path.resolve(), chosen)
