"""pytest fixtures over servers.py: real llama-cpp-python and Ollama servers with the tiny model.

Enable them for the whole suite with one line in tests/conftest.py::

    pytest_plugins = ["backends.fixtures"]

Fixtures (each skips its test with the install command as the reason when install.sh has not run):

- ``tiny_gguf`` (session): Path of the tiny deterministic GGUF model (tiny_model.py), written once.
- ``llama_backend`` (session): a ``BackendServer`` running llama-cpp-python's OpenAI-compatible
  server with the model served as "tiny". Shared by the session: tests must not stop or kill it.
- ``llama_embedding_backend`` (session): the same server started with ``embedding=True``, for
  /v1/embeddings (one vector of 64 floats per input).
- ``ollama_backend`` (session): a ``BackendServer`` running Ollama with the model imported as
  "tiny" (listed as "tiny:latest"). Shared likewise.
- ``llama_backend_fresh`` / ``ollama_backend_fresh`` (function): a server of the test's own, which
  the test may ``kill()`` or ``stop()`` (stopped again at teardown, harmlessly).

Each server's output is in ``server.log`` under pytest's temporary directories (``BackendServer.log``).

Set ``IOP_BACKENDS_REQUIRED=1`` (CI does, after running install.sh) to turn those skips into
errors, so a broken install cannot pass as skipped tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .servers import BackendServer, llama_server, ollama_server, skip_reason, tiny_model_path


def require(kind: str) -> None:
    """Skip (or, with IOP_BACKENDS_REQUIRED=1, fail) the current test when ``kind`` is not installed."""
    reason = skip_reason(kind)
    if reason is None:
        return
    if os.environ.get("IOP_BACKENDS_REQUIRED") == "1":
        pytest.fail(f"IOP_BACKENDS_REQUIRED=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of the tiny deterministic GGUF model (tiny_model.py), written once per session."""
    if skip_reason("llama") and skip_reason("ollama"):
        require("llama")
    return tiny_model_path(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def llama_backend(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackendServer]:
    """llama-cpp-python's OpenAI server, model "tiny"; shared by the session: do not stop or kill it."""
    require("llama")
    with llama_server(tiny_gguf, workdir=tmp_path_factory.mktemp("llama")) as server:
        yield server


@pytest.fixture(scope="session")
def llama_embedding_backend(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackendServer]:
    """llama-cpp-python started with embedding=True (mean pooling): /v1/embeddings gives 64 floats per input."""
    require("llama")
    with llama_server(tiny_gguf, embedding=True, workdir=tmp_path_factory.mktemp("llama-embedding")) as server:
        yield server


@pytest.fixture(scope="session")
def ollama_backend(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackendServer]:
    """Ollama with the model imported as "tiny" ("tiny:latest"); shared by the session: do not stop or kill it."""
    require("ollama")
    with ollama_server(tiny_gguf, workdir=tmp_path_factory.mktemp("ollama")) as server:
        yield server


@pytest.fixture
def llama_backend_fresh(tiny_gguf: Path, tmp_path: Path) -> Iterator[BackendServer]:
    """A llama-cpp-python server of this test's own, which it may kill() or stop()."""
    require("llama")
    with llama_server(tiny_gguf, workdir=tmp_path / "llama") as server:
        yield server


@pytest.fixture
def ollama_backend_fresh(tiny_gguf: Path, tmp_path: Path) -> Iterator[BackendServer]:
    """An Ollama server of this test's own, which it may kill() or stop()."""
    require("ollama")
    with ollama_server(tiny_gguf, workdir=tmp_path / "ollama") as server:
        yield server
