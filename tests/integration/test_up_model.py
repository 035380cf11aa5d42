"""``iop up --model`` / ``iop join --model`` before anything starts: the one-line refusals, the node
config written (read back by the node's own loader), and the Python that runs llama-cpp-python's
server: found in its order, or installed (a real pip, into a real virtual environment).

The Pythons are real: the llama backend's (tests/backends/install.sh), reached through a shell
wrapper at another path (a link would lose the virtual environment), and this test's own, which
lacks llama-cpp-python.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from backends.fixtures import require
from backends.servers import HERE as BACKENDS
from backends.servers import venv

from iop_cli.configs import prepare
from iop_cli.ggufs import GGUF_MAGIC, engine_logs, gguf_models, llama_routes
from iop_cli.llama import BUILD_ENV, LLAMA_CPP_REQUIREMENT, LLAMA_CPP_VERSION, build_env, install, llama_python
from iop_cli.output import CliError
from iop_cli.preflight import check_files
from iop_node.settings import load_settings

IOP = [sys.executable, "-m", "iop_cli.main"]
ENV = {k: v for k, v in os.environ.items() if k not in ("IOP_STATE_DIR", "IOP_API_KEY", "IOP_LLAMA_PYTHON")}
TOKEN = "iopjt-abcdef." + "0" * 32
PIN = "sha256:" + "0" * 64


def _iop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*IOP, *args], capture_output=True, text=True, timeout=60, check=False, env=ENV)


def _one_line(result: subprocess.CompletedProcess[str], command: str) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"iop {command}: "), result.stderr
    return lines[0]


@pytest.fixture
def not_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>404 Not Found</html>")  # what a failed download leaves
    return path


@pytest.mark.parametrize("command", ["up", "join"])
def test_a_missing_or_foreign_model_is_one_line_before_anything(tmp_path: Path, not_gguf: Path, command: str) -> None:
    state = tmp_path / "state"
    join = ["join", "127.0.0.1:9", "--token", TOKEN, "--ca", PIN] if command == "join" else ["up", "--port", "0"]
    for model, said in ((tmp_path / "nothing.gguf", "No such file"), (not_gguf, "is not a GGUF file")):
        line = _one_line(_iop(*join, "--dir", str(state), "--model", str(model)), command)
        assert f"--model {model}: " in line and said in line
        assert not state.exists()  # nothing written, nothing started, nothing sent (port 9 was never dialed)


def test_model_and_backend_are_one_or_the_other(tmp_path: Path) -> None:
    result = _iop("up", "--dir", str(tmp_path), "--model", "a.gguf", "--backend", "http://127.0.0.1:9")
    assert result.returncode == 2 and "not allowed with argument" in result.stderr


def _prepared(tmp_path: Path) -> tuple[Path, Path]:
    """A state folder ``iop up --model FILE --model FILE=smol`` prepares; and the file."""
    model = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model.write_bytes(GGUF_MAGIC + bytes(60))
    state = tmp_path / "state"
    python = Path("/opt/llama/bin/python")
    prepare(state, 0, None, served=llama_routes(gguf_models([str(model), f"{model}=smol"]), python))
    return state, model


def test_the_node_config_serves_each_file_with_llama_cpp(tmp_path: Path) -> None:
    state, model = _prepared(tmp_path)
    written = yaml.safe_load((state / "node.yaml").read_text())
    serve = {"model_path": str(model), "python": "/opt/llama/bin/python"}
    assert written["routes"] == [
        {"model": "smollm2-135m-instruct", "engine": "llama.cpp", "max_concurrency": 1, "serve": serve},
        {"model": "smol", "engine": "llama.cpp", "max_concurrency": 1, "serve": serve},
    ]
    # the node's own default is relative to where it starts: two state folders would share it
    assert written["engines_dir"] == str((state / "models").resolve())
    assert engine_logs(state / "node.yaml") == [
        (state / "models" / "smollm2-135m-instruct.log").resolve(),
        (state / "models" / "smol.log").resolve(),
    ]


def test_the_node_reads_the_config_up_writes(tmp_path: Path) -> None:
    state, model = _prepared(tmp_path)
    check_files(state)  # what the next `iop up` checks first: every config by its service's loader
    settings = load_settings(state / "node.yaml")
    assert [(route.model, route.engine, route.adapter, route.adapter_key) for route in settings.routes] == [
        ("smollm2-135m-instruct", "llama.cpp", "vllm", "llama.cpp:smollm2-135m-instruct"),
        ("smol", "llama.cpp", "vllm", "llama.cpp:smol"),
    ]
    assert settings.routes[0].serve == {"model_path": str(model), "python": "/opt/llama/bin/python"}
    assert settings.routes[0].max_concurrency == 1


# --- which Python runs llama_cpp.server -------------------------------------------------------------------


def _wrapper(path: Path, python: Path) -> Path:
    """An executable at ``path`` that runs ``python``: another path to a real Python."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
    path.chmod(0o755)
    return path


@pytest.fixture
def pythons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """``with``: two paths to a Python that has llama-cpp-python's server; ``without``: one that lacks it."""
    require("llama")
    monkeypatch.delenv("IOP_LLAMA_PYTHON", raising=False)
    real = venv("llama") / "bin" / "python"
    return {
        "with": _wrapper(tmp_path / "with" / "python", real),
        "also": _wrapper(tmp_path / "also" / "python", real),
        "without": _wrapper(tmp_path / "without" / "python", Path(sys.executable)),
    }


def test_a_named_python_is_used_or_refused_never_passed_over(
    tmp_path: Path, pythons: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    _wrapper(state / "engines" / "llama" / "bin" / "python", pythons["also"])  # would do, but is not named
    assert llama_python(state, str(pythons["with"])) == pythons["with"]
    with pytest.raises(CliError) as refused:
        llama_python(state, str(pythons["without"]), this=pythons["also"])
    assert refused.value.code == 2
    assert str(refused.value) == (
        f"--llama-python {pythons['without']}: cannot run llama-cpp-python's server: "
        "ModuleNotFoundError: No module named 'llama_cpp'"
    )
    monkeypatch.setenv("IOP_LLAMA_PYTHON", str(pythons["with"]))
    assert llama_python(state, None, this=pythons["also"]) == pythons["with"]
    assert llama_python(state, str(pythons["also"])) == pythons["also"]  # --llama-python before the variable
    monkeypatch.setenv("IOP_LLAMA_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(CliError, match=r"^\$IOP_LLAMA_PYTHON .*no-such-python: no such file$"):
        llama_python(state, None)


def test_the_state_folders_python_then_this_one(tmp_path: Path, pythons: dict[str, Path]) -> None:
    state = tmp_path / "state"
    own = state / "engines" / "llama" / "bin" / "python"
    assert llama_python(state, None, this=pythons["with"]) == pythons["with"]  # none of its own yet
    _wrapper(own, pythons["also"])
    assert llama_python(state, None, this=pythons["with"]) == own
    _wrapper(own, pythons["without"])  # a broken install of its own: this Python's is taken
    assert llama_python(state, None, this=pythons["with"]) == pythons["with"]


def test_none_has_it_so_it_is_installed_and_a_failure_says_the_command(
    tmp_path: Path, pythons: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The order reaches the installer; pip fails at once here (its index is a closed port), and
    the failure shows pip's last lines, and the command that installs it by hand."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    state = tmp_path / "state"
    with pytest.raises(CliError) as failed:
        llama_python(state, None, this=pythons["without"])
    printed = capsys.readouterr().out
    target = (state / "engines" / "llama").absolute()
    assert printed == (
        f"installing llama-cpp-python {LLAMA_CPP_VERSION} into {target} (compiles llama.cpp, 6-20 min the "
        f"first time; pip caches the wheel); its output: {target}-install.log\n"
    )
    message = str(failed.value)
    assert failed.value.code == 1
    assert message.startswith(
        f"installing llama-cpp-python {LLAMA_CPP_VERSION} failed: pip install exited with code 1; the end of "
        f"{target}-install.log:\n"
    )
    assert re.search(r"No matching distribution found for llama-cpp-python", message)
    command = next(line for line in message.splitlines() if line.startswith("install it yourself with: "))
    assert command.removeprefix("install it yourself with: ") == (
        f"{shlex.quote(sys.executable)} -m venv {target} && "
        f"CMAKE_BUILD_PARALLEL_LEVEL={BUILD_ENV['CMAKE_BUILD_PARALLEL_LEVEL']} "
        f"CMAKE_ARGS='{build_env()['CMAKE_ARGS']}' {target}/bin/pip install '{LLAMA_CPP_REQUIREMENT}'"
    )


def test_the_users_own_cmake_args_are_kept_after_the_portable_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=on")
    assert build_env()["CMAKE_ARGS"] == f"{BUILD_ENV['CMAKE_ARGS']} -DGGML_CUDA=on"
    monkeypatch.delenv("CMAKE_ARGS")
    assert build_env()["CMAKE_ARGS"] == BUILD_ENV["CMAKE_ARGS"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 24 s here with the wheel in pip's cache (install.sh built it); a compile is 9-20 min
def test_a_real_install_into_the_state_folder_serves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require("llama")  # install.sh built the wheel: pip takes it from its cache
    state = tmp_path / "state"
    python = install(state)
    assert python == (state / "engines" / "llama" / "bin" / "python").absolute()
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"installing llama-cpp-python {LLAMA_CPP_VERSION} into ")
    assert re.fullmatch(rf"installed llama-cpp-python {re.escape(LLAMA_CPP_VERSION)} in \d+ s", printed[-1])
    assert llama_python(state, None, this=Path(sys.executable)) == python  # found again, not installed again
    assert "Successfully installed" in (state / "engines" / "llama-install.log").read_text()


def test_the_pins_are_the_backend_installers() -> None:
    """CI builds the llama-cpp-python wheel once (install.sh); `iop up --model` must ask pip for the same."""
    script = (BACKENDS / "install.sh").read_text()
    pins = re.search(r"^llama_pins=\((.*)\)$", script, re.MULTILINE)
    assert pins is not None and f'"{LLAMA_CPP_REQUIREMENT}"' in pins.group(1).split()
    assert f'CMAKE_ARGS="{BUILD_ENV["CMAKE_ARGS"]}"' in script
