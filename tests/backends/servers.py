"""Real inference servers for the adapter tests, started as subprocesses on free loopback ports.

``bash tests/backends/install.sh`` installs them (once per machine) under ``$IOP_BACKENDS_DIR``
(default ``~/.cache/iop-backends``); without it ``backends_available()`` says which are missing and
``skip_reason()`` tells a test what to print when it skips.

- ``llama_server(model)``: llama-cpp-python's OpenAI-compatible server (``/v1/models``,
  ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` with ``embedding=True``), the
  stand-in for vLLM. About 0.6 s to start with the tiny model; about 1,200 tokens/s streamed.
- ``ollama_server(model)``: the real Ollama 0.5.4 server (``/api/tags``, ``/api/chat``,
  ``/api/generate``, ``/api/embed``, and its own OpenAI-compatible ``/v1/...``, whose streams do
  end with a usage chunk when asked), with the model imported under ``name``. About 0.4 s to start,
  import and load the tiny model; about 150 tokens/s streamed.
- ``tiny_model_path(directory)``: writes tests/backends/tiny_model.py's model with a backend venv's
  Python (the project's venv has neither gguf nor numpy).

Each context manager yields a ``BackendServer`` and stops it on exit: SIGTERM to its process group,
SIGKILL after a grace period, so nothing is left behind (Ollama runs the model in a child process,
which SIGKILL on the parent alone would orphan). ``BackendServer.kill()`` SIGKILLs the whole group
at once, for "backend died mid-stream" tests. Server output goes to ``BackendServer.log``; a server
that fails to start raises ``BackendError`` with the end of its log.

Standard library only (urllib for HTTP): importable from any test, with or without pytest.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .tiny_model import OLLAMA_TEMPLATE

HERE = Path(__file__).resolve().parent
INSTALL_COMMAND = "bash tests/backends/install.sh"
MARKER = ".iop-backend"
BACKENDS = ("llama", "ollama")
LOOPBACK = "127.0.0.1"


class BackendError(RuntimeError):
    """A backend server could not be started, or a helper request failed."""


def backends_dir() -> Path:
    """Where install.sh put the virtual environments: $IOP_BACKENDS_DIR or ~/.cache/iop-backends."""
    configured = os.environ.get("IOP_BACKENDS_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "iop-backends"


def venv(kind: str) -> Path:
    return backends_dir() / kind


def backends_available() -> dict[str, bool]:
    """``{"llama": bool, "ollama": bool}``: whether install.sh has completed for each backend."""
    return {kind: (venv(kind) / MARKER).is_file() and (venv(kind) / "bin" / "python").exists() for kind in BACKENDS}


def skip_reason(kind: str) -> str | None:
    """None when ``kind`` is installed, else a one-line reason for pytest.skip."""
    if backends_available().get(kind):
        return None
    return f"{kind} backend not installed in {venv(kind)}: run `{INSTALL_COMMAND}` (CI does)"


def ollama_binary() -> Path:
    """The ``ollama-lib`` executable inside the ollama venv's bigdl-core-cpp package."""
    found = sorted(venv("ollama").glob("lib/python3*/site-packages/bigdl/cpp/libs/ollama-lib"))
    if not found:
        raise BackendError(f"no ollama-lib under {venv('ollama')}: run `{INSTALL_COMMAND} ollama`")
    return found[0]


def model_python() -> Path:
    """A Python with gguf and numpy: the llama venv's, else the ollama venv's."""
    for kind in BACKENDS:
        if backends_available()[kind]:
            return venv(kind) / "bin" / "python"
    raise BackendError(f"no backend venv with gguf installed in {backends_dir()}: run `{INSTALL_COMMAND}`")


def tiny_model_path(directory: Path) -> Path:
    """Write the tiny deterministic GGUF model (tiny_model.py) into ``directory``; return its path."""
    out = directory.resolve() / "tiny.gguf"
    result = subprocess.run(
        [str(model_python()), str(HERE / "tiny_model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0 or not out.is_file():
        raise BackendError(f"tiny_model.py failed ({result.returncode}): {result.stderr[-2000:]}")
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


# --- HTTP helpers (urllib only) -----------------------------------------------------------------


def http_json(url: str, body: Mapping[str, Any] | None = None, timeout: float = 30.0) -> Any:
    """GET (``body`` None) or POST a JSON body; return the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})  # noqa: S310
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
        return json.loads(response.read())


def http_lines(url: str, body: Mapping[str, Any], timeout: float = 30.0) -> Iterator[str]:
    """POST a JSON body and yield the answer's non-empty lines as they arrive (SSE or NDJSON)."""
    request = urllib.request.Request(  # noqa: S310
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
        for raw in response:
            line = raw.decode().strip()
            if line:
                yield line


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:  # noqa: S310
            response.read()
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


# --- the servers ----------------------------------------------------------------------------------


@dataclass
class BackendServer:
    """A running backend: ``base_url`` is ``http://127.0.0.1:PORT`` (no trailing slash)."""

    kind: str
    port: int
    process: subprocess.Popen[bytes]
    model: str
    log: Path
    env: dict[str, str] = field(repr=False, default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def openai_url(self) -> str:
        """The OpenAI-compatible base URL (``.../v1``); Ollama serves one too."""
        return f"{self.base_url}/v1"

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _signal_group(self, sig: signal.Signals) -> None:
        # start_new_session=True made the server the leader of its own process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL the server and its children at once (a backend that dies mid-stream).

        A client reading a stream then sees the connection close: urllib's line iteration just
        ends (no ``[DONE]``, no ``done: true``), httpx raises RemoteProtocolError.
        """
        self._signal_group(signal.SIGKILL)
        self.process.wait()

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; also reaps children left in the group."""
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait()
        self._signal_group(signal.SIGKILL)  # stragglers, e.g. an Ollama runner


def _start(
    kind: str, argv: Sequence[str], *, env: dict[str, str], port: int, model: str, log: Path, ready: str, timeout: float
) -> BackendServer:
    with log.open("ab") as sink:
        process = subprocess.Popen(
            list(argv), env=env, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    server = BackendServer(kind=kind, port=port, process=process, model=model, log=log, env=env)
    deadline = time.monotonic() + timeout
    while not _answers(server.base_url + ready):
        if process.poll() is not None or time.monotonic() > deadline:
            state = f"exited with {process.returncode}" if process.poll() is not None else f"not ready in {timeout} s"
            server.stop()
            raise BackendError(f"{kind} server {state}: {' '.join(argv)}\n--- {log} ---\n{server.log_tail()}")
        time.sleep(0.05)
    return server


@contextlib.contextmanager
def _workdir(prefix: str, given: Path | None) -> Iterator[Path]:
    """``given`` (created, kept: e.g. a pytest tmp_path, so logs survive a failure) or a temporary directory."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given.resolve()
        return
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _with_port_retries(start: Any, attempts: int = 3) -> BackendServer:
    """Run ``start(port)``; another process may take the free port before the server binds it."""
    for attempt in range(attempts):
        try:
            server: BackendServer = start(free_port())
        except BackendError as error:
            if attempt + 1 == attempts or "address already in use" not in str(error).lower():
                raise
        else:
            return server
    raise AssertionError("unreachable")


@contextlib.contextmanager
def llama_server(
    model: Path,
    alias: str = "tiny",
    *,
    embedding: bool = False,
    pooling: bool = True,
    interrupt_requests: bool = False,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    workdir: Path | None = None,
    timeout: float = 60.0,
) -> Iterator[BackendServer]:
    """llama-cpp-python's OpenAI-compatible server for ``model`` as ``alias``; ready when GET /v1/models answers.

    - It answers any ``model`` name in a request with its one model, and ignores
      ``stream_options.include_usage``: streams carry no usage chunk (its non-streamed answers do).
    - ``interrupt_requests=False`` (the default here; the server's own default is True) queues a
      request that arrives while another runs. With True, the new request ends the running stream
      at once with ``data: [DONE]`` and no finish_reason chunk.
    - ``embedding=True`` makes /v1/embeddings work (else HTTP 500 "Llama model must be created with
      embedding=True"), with mean pooling so each input gets one vector of 64 floats; chat and
      completions keep working on that server. ``pooling=False`` leaves the model's own pooling
      (none for the tiny model): each input then gets one vector per token, a list of lists.
    - server.log lives in ``workdir`` (kept) or else in a temporary directory removed at exit.
    """
    python = venv("llama") / "bin" / "python"
    if not backends_available()["llama"]:
        raise BackendError(skip_reason("llama") or "llama backend not installed")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    env.pop("VIRTUAL_ENV", None)

    def start(port: int, directory: Path) -> BackendServer:
        argv = [
            str(python), "-m", "llama_cpp.server",
            "--model", str(Path(model).resolve()), "--model_alias", alias,
            "--host", LOOPBACK, "--port", str(port),
            "--interrupt_requests", "true" if interrupt_requests else "false",
            *(["--embedding", "true"] if embedding else []),
            *(["--kv_overrides", "llama.pooling_type=int:1"] if embedding and pooling else []),
            *extra_args,
        ]  # fmt: skip
        log = directory / "server.log"
        return _start("llama", argv, env=env, port=port, model=alias, log=log, ready="/v1/models", timeout=timeout)

    with _workdir("iop-llama-", workdir) as directory:
        server = _with_port_retries(lambda port: start(port, directory))
        try:
            yield server
        finally:
            server.stop()


OLLAMA_MODELFILE = 'FROM {model}\nTEMPLATE """{template}"""\n'


def _library_path() -> str:
    return os.pathsep.join(filter(None, [str(venv("ollama") / "lib"), os.environ.get("LD_LIBRARY_PATH")]))


@contextlib.contextmanager
def ollama_server(
    model: Path,
    name: str = "tiny",
    *,
    template: str | None = None,
    warm: bool = True,
    extra_env: Mapping[str, str] | None = None,
    workdir: Path | None = None,
    timeout: float = 60.0,
) -> Iterator[BackendServer]:
    """The Ollama server with ``model`` imported as ``name`` (listed as ``name:latest``).

    ``template`` is the Modelfile TEMPLATE (Go template), by default tiny_model.OLLAMA_TEMPLATE
    (ChatML, matching the tiny model's Jinja template). ``warm`` loads the model into the runner
    before yielding, so the first request of a test does not pay the load (about 0.3 s).
    State (OLLAMA_MODELS, HOME with its generated key), the Modelfile and server.log live in
    ``workdir`` (kept) or else in a temporary directory removed at exit.
    """
    if template is None:
        template = OLLAMA_TEMPLATE
    binary = ollama_binary()
    with _workdir("iop-ollama-", workdir) as directory:
        server = _with_port_retries(
            lambda port: _start_ollama(binary, directory, port, name=name, extra_env=extra_env, timeout=timeout)
        )
        try:
            _import_model(server, binary, directory, model=model, name=name, template=template, timeout=timeout)
            if warm:
                http_json(server.base_url + "/api/generate", {"model": name}, timeout=timeout)
            yield server
        finally:
            server.stop()


def _start_ollama(
    binary: Path, workdir: Path, port: int, *, name: str, extra_env: Mapping[str, str] | None, timeout: float
) -> BackendServer:
    (workdir / "home").mkdir(exist_ok=True)
    (workdir / "models").mkdir(exist_ok=True)
    env = {
        **os.environ,
        "OLLAMA_MODELS": str(workdir / "models"),
        "HOME": str(workdir / "home"),
        # Without these two, OpenMP threads spin and the server crawls when the cores are busy.
        "OMP_NUM_THREADS": "1",
        "KMP_BLOCKTIME": "0",
        # The Intel runtime libraries (libsvml, libimf, libiomp5, ...) are in the venv's lib/.
        "LD_LIBRARY_PATH": _library_path(),
        "GIN_MODE": "release",
        **(extra_env or {}),
        "OLLAMA_HOST": f"{LOOPBACK}:{port}",
    }
    log = workdir / "server.log"
    return _start(
        "ollama", [str(binary), "serve"], env=env, port=port, model=name, log=log, ready="/api/tags", timeout=timeout
    )


def _import_model(
    server: BackendServer, binary: Path, workdir: Path, *, model: Path, name: str, template: str, timeout: float
) -> None:
    """``ollama-lib create NAME -f Modelfile`` (FROM the GGUF's absolute path, TEMPLATE), then check /api/tags."""
    modelfile = workdir / "Modelfile"
    modelfile.write_text(OLLAMA_MODELFILE.format(model=Path(model).resolve(), template=template))
    created = subprocess.run(
        [str(binary), "create", name, "-f", str(modelfile)],
        env=server.env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if created.returncode != 0:
        raise BackendError(f"ollama create {name} failed: {created.stdout[-2000:]}{created.stderr[-2000:]}")
    tags = http_json(server.base_url + "/api/tags")
    if f"{name}:latest" not in {entry["name"] for entry in tags["models"]}:
        raise BackendError(f"ollama create {name} succeeded but /api/tags lists {tags}")
