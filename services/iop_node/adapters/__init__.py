"""Adapters: one module each; REGISTRY names them for the composition root.

To add an adapter: write ``adapters/<name>.py`` with an options model (pydantic, extra="forbid")
and a class conforming to ``ports.Adapter`` whose constructor takes ``{model: options}``, then
add one line to ``REGISTRY``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from iop_node.adapters.cli import CliAdapter, CliOptions
from iop_node.adapters.mock import MockAdapter, MockOptions
from iop_node.adapters.ollama import OllamaAdapter, OllamaOptions
from iop_node.adapters.vllm import VllmAdapter, VllmOptions
from iop_node.ports import Adapter

__all__ = ["REGISTRY", "AdapterEntry"]

#: name -> (options model, factory taking {model name: options}).
AdapterEntry = tuple[type[BaseModel], Callable[[Mapping[str, Any]], Adapter]]

REGISTRY: dict[str, AdapterEntry] = {
    "mock": (MockOptions, MockAdapter),
    "cli": (CliOptions, CliAdapter),
    "vllm": (VllmOptions, VllmAdapter),
    "ollama": (OllamaOptions, OllamaAdapter),
}
