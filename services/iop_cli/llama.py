"""The Python that runs llama-cpp-python's server for ``iop up --model`` / ``iop join --model``.

Looked for in this order, each checked by running ``PY -c "import llama_cpp.server"``:

1. ``--llama-python PY``, else ``$IOP_LLAMA_PYTHON``: used if it has the server, else one line
   naming it and why (exit 2): a Python the user named is never passed over for another.
2. ``STATE/engines/llama/bin/python``: the state folder's own environment (an earlier install).
3. The Python ``iop`` runs on, when llama-cpp-python is installed beside it.
4. None has it: ``STATE/engines/llama`` is made (``python -m venv``) and
   ``llama-cpp-python[server]`` installed into it with pip, which compiles llama.cpp (6-20 min on
   a few cores; pip caches the wheel it builds, so a later install takes seconds). One line says so
   first, one line after with the time; pip's output goes to ``STATE/engines/llama-install.log``.
   A failure (or ``INSTALL_TIMEOUT``) prints the log's last lines and the command to run by hand.

The version and build settings are tests/backends/install.sh's (a test checks that they agree):
the wheel CI builds once is the one pip finds in its cache here.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from iop_cli.output import CliError

__all__ = [
    "BUILD_ENV",
    "INSTALL_TIMEOUT",
    "LLAMA_CPP_REQUIREMENT",
    "LLAMA_CPP_VERSION",
    "install",
    "llama_python",
    "server_missing",
]

LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_REQUIREMENT = f"llama-cpp-python[server]=={LLAMA_CPP_VERSION}"
BUILD_ENV = {
    "CMAKE_BUILD_PARALLEL_LEVEL": str(min(os.cpu_count() or 2, 8)),  # more compilers than 8 risk the RAM
    # Portable code (no -march=native: the wheel pip caches may serve another CPU), no tests or examples.
    "CMAKE_ARGS": "-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF",
}
INSTALL_TIMEOUT = 3600.0
"""Seconds the install may take (compiling llama.cpp on one busy core is well under it)."""
_CHECK_TIMEOUT = 120.0  # importing the server loads llama.cpp's library; slow on a busy machine, never minutes
_LOG_LINES = 20


def llama_python(state: Path, given: str | None = None, *, this: Path | None = None) -> Path:
    """The Python to run ``llama_cpp.server`` with (see the module's order); installs it when none has it.

    ``given``: ``--llama-python``; ``this``: the Python ``iop`` runs on (default ``sys.executable``)."""
    source = "--llama-python" if given else "$IOP_LLAMA_PYTHON"
    if named := given or os.environ.get("IOP_LLAMA_PYTHON"):
        python = _located(named, source)
        if (problem := server_missing(python)) is not None:
            raise CliError(f"{source} {named}: cannot run llama-cpp-python's server: {problem}", 2)
        return python
    for python in (own_python(state), this or Path(sys.executable)):
        if python.exists() and server_missing(python) is None:
            return python
    return install(state)


def own_python(state: Path) -> Path:
    """The Python of the state folder's own environment for llama-cpp-python."""
    return _environment(state) / "bin" / "python"


def server_missing(python: Path) -> str | None:
    """None if ``python`` can import ``llama_cpp.server``; else why not, in one line."""
    try:
        result = subprocess.run(  # noqa: S603 - a Python the user named or we made; no shell
            [str(python), "-c", "import llama_cpp.server"],
            capture_output=True,
            text=True,
            timeout=_CHECK_TIMEOUT,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return f"importing llama_cpp.server took over {_CHECK_TIMEOUT:.0f} s"
    except OSError as exc:
        return str(exc.strerror or exc)
    if result.returncode == 0:
        return None
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {result.returncode}"


def install(state: Path, *, base: Path | None = None, env: dict[str, str] | None = None) -> Path:
    """Make ``STATE/engines/llama`` and install llama-cpp-python's server into it; its Python.

    ``base``: the Python that makes the environment (default ``sys.executable``); ``env``: extra
    variables for pip (its index, say). CliError with the log's end and the command to run by hand."""
    target, log = _environment(state), _install_log(state)
    target.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"installing llama-cpp-python {LLAMA_CPP_VERSION} into {target} (compiles llama.cpp, 6-20 min the "
        f"first time; pip caches the wheel); its output: {log}",
        flush=True,
    )
    started = time.monotonic()
    python = own_python(state)
    steps = {
        "python -m venv": [str(base or sys.executable), "-m", "venv", "--clear", str(target)],
        "pip install": [str(python), "-m", "pip", "install", "--disable-pip-version-check", LLAMA_CPP_REQUIREMENT],
    }
    with log.open("w") as sink:
        for what, step in steps.items():
            failure = _run(what, step, sink, {**os.environ, **build_env(), **(env or {})}, started + INSTALL_TIMEOUT)
            if failure:
                raise CliError(_failed(state, failure), 1)
    if (problem := server_missing(python)) is not None:
        raise CliError(_failed(state, f"the installed server does not start: {problem}"), 1)
    print(f"installed llama-cpp-python {LLAMA_CPP_VERSION} in {time.monotonic() - started:.0f} s", flush=True)
    return python


def build_env() -> dict[str, str]:
    """The build's variables: BUILD_ENV, after the user's own CMAKE_ARGS (``-DGGML_CUDA=on``, say), which
    are kept (cmake takes the last of a repeated option, so the user's win where they say the same)."""
    own = os.environ.get("CMAKE_ARGS", "").strip()
    return {**BUILD_ENV, "CMAKE_ARGS": f"{BUILD_ENV['CMAKE_ARGS']} {own}".strip()}


def install_command(state: Path) -> str:
    """The shell command that installs what ``install`` does, for a user to run by hand (with the
    Python ``iop`` runs on: the environment is made for that version)."""
    target = shlex.quote(str(_environment(state)))
    variables = " ".join(f"{key}={shlex.quote(value)}" for key, value in build_env().items())
    python = shlex.quote(sys.executable)
    return f"{python} -m venv {target} && {variables} {target}/bin/pip install {shlex.quote(LLAMA_CPP_REQUIREMENT)}"


def _run(what: str, command: list[str], sink: IO[str], env: dict[str, str], deadline: float) -> str:
    """Run one install step with its output in ``sink``; "" when it succeeded, else what went wrong.

    Its own process group: a timeout or Ctrl-C stops pip's compilers too, not pip alone."""
    process = subprocess.Popen(  # noqa: S603 - our interpreter, the venv's pip; no shell
        command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
    )
    try:
        code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _stop_group(process)
        return f"{what} did not finish within {INSTALL_TIMEOUT:.0f} s"
    except BaseException:
        _stop_group(process)
        raise
    return f"{what} exited with code {code}" if code else ""


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _failed(state: Path, what: str) -> str:
    try:
        tail = _install_log(state).read_text(errors="replace").rstrip().splitlines()[-_LOG_LINES:]
    except OSError:
        tail = []
    return "\n".join(
        [
            f"installing llama-cpp-python {LLAMA_CPP_VERSION} failed: {what}; the end of {_install_log(state)}:",
            *tail,
            f"install it yourself with: {install_command(state)}",
            "(or pass --llama-python PY: a Python that has llama-cpp-python[server])",
        ]
    )


def _located(named: str, source: str) -> Path:
    """``named`` as an absolute path (a bare command is looked up on PATH); not resolved: a virtual
    environment's python is a link whose place selects the environment."""
    if os.sep not in named and (found := shutil.which(named)):
        return Path(found)
    path = Path(named).expanduser().absolute()
    if not path.exists():
        raise CliError(f"{source} {named}: no such file", 2)
    return path


def _environment(state: Path) -> Path:
    return (state / "engines" / "llama").absolute()


def _install_log(state: Path) -> Path:
    return (state / "engines" / "llama-install.log").absolute()
