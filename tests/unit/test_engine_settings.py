"""Engine settings (a route's ``serve``): errors name the key, each engine's command line, log rotation."""

from __future__ import annotations

from pathlib import Path

import pytest

from iop_node.bootstrap import build_adapters
from iop_node.engines.process import EngineFiles, RotatingLog
from iop_node.engines.served import ServedAdapter
from iop_node.engines.settings import CommandSettings, LlamaCppSettings, OllamaSettings, VllmSettings
from iop_node.settings import ConfigError, Settings, load_settings


def _settings(tmp_path: Path, *routes: dict[str, object]) -> Settings:
    return Settings.model_validate({"engines_dir": str(tmp_path / "engines"), "routes": list(routes)})


def test_bad_engine_settings_are_all_named_by_key(tmp_path: Path) -> None:
    settings = _settings(
        tmp_path,
        {"model": "a", "engine": "llama.cpp", "serve": {"threads": 0}},
        {"model": "b", "engine": "command", "serve": {"command": ["server"], "hang_timeout": -1, "colour": "red"}},
        {"model": "c", "engine": "vllm", "serve": {"model": "org/m"}, "options": {"kinds": []}},
    )
    with pytest.raises(ConfigError) as raised:
        build_adapters(settings)
    message = str(raised.value)
    assert "routes.0.serve.model_path: Field required" in message
    assert "routes.0.serve.threads: Input should be greater than or equal to 1" in message
    assert "routes.1.serve.command: must contain {port}: the node picks the port" in message
    assert "routes.1.serve.hang_timeout: Input should be greater than 0" in message
    assert "routes.1.serve.colour: Extra inputs are not permitted" in message
    assert "routes.2.options.kinds: " in message
    assert len(raised.value.problems) == 6


def test_an_engine_route_gets_its_own_adapter_with_paths_from_the_config_folder(tmp_path: Path) -> None:
    settings = _settings(
        tmp_path,
        {"model": "one", "engine": "llama.cpp", "serve": {"model_path": "models/one.gguf"}},
        {"model": "two", "engine": "llama.cpp", "target": "t2", "serve": {"model_path": "/abs/two.gguf"}},
        {"model": "mock-small", "adapter": "mock"},
    )
    adapters = build_adapters(settings, base=tmp_path)
    assert sorted(adapters) == ["llama.cpp:one", "llama.cpp:two", "mock"]
    one, two = adapters["llama.cpp:one"], adapters["llama.cpp:two"]
    assert isinstance(one, ServedAdapter) and isinstance(two, ServedAdapter)
    assert one.name == "llama.cpp" and not one.available("one")
    assert isinstance(one.supervisor.settings, LlamaCppSettings)
    assert one.supervisor.settings.model_path == tmp_path / "models" / "one.gguf"
    assert two.supervisor.target == "t2"
    assert not (tmp_path / "engines").exists()  # nothing written before the node starts


def test_llama_cpp_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_LLAMA_PYTHON", "/opt/llama/bin/python")
    settings = LlamaCppSettings.model_validate(
        {"model_path": "/m/a.gguf", "context_size": 4096, "threads": 2, "chat_format": "chatml", "args": ["--x", "1"]}
    )
    launch = settings.launch(target="tiny", port=4321, workdir=tmp_path)
    assert launch.argv == [
        "/opt/llama/bin/python", "-m", "llama_cpp.server", "--model", "/m/a.gguf", "--model_alias", "tiny",
        "--host", "127.0.0.1", "--port", "4321", "--interrupt_requests", "false",
        "--n_ctx", "4096", "--n_threads", "2", "--chat_format", "chatml", "--x", "1",
    ]  # fmt: skip
    assert (launch.ready_path, launch.health_path, launch.ready_model) == ("/v1/models", "/docs", "tiny")
    assert settings.start_timeout == 120


def test_vllm_ollama_and_command_lines(tmp_path: Path) -> None:
    vllm = VllmSettings(model="org/m", args=["--max-model-len", "2048"]).launch(target="m", port=9, workdir=tmp_path)
    assert vllm.argv == [
        "vllm", "serve", "org/m", "--host", "127.0.0.1", "--port", "9", "--served-model-name", "m",
        "--max-model-len", "2048",
    ]  # fmt: skip
    assert (vllm.ready_path, vllm.health_path) == ("/v1/models", "/health")
    assert VllmSettings(model="org/m").start_timeout == 900

    create = [{"name": "tiny", "modelfile": "/m/Modelfile"}]
    ollama = OllamaSettings.model_validate({"create": create, "pull": ["qwen2.5:0.5b"]})
    launch = ollama.launch(target="tiny", port=9, workdir=tmp_path)
    assert launch.argv == ["ollama", "serve"]
    assert launch.env == {"OLLAMA_MODELS": str(tmp_path / "models"), "OLLAMA_HOST": "127.0.0.1:9"}
    assert launch.setup == [["ollama", "pull", "qwen2.5:0.5b"], ["ollama", "create", "tiny", "-f", "/m/Modelfile"]]
    assert (launch.ready_path, launch.health_path) == ("/api/tags", "/api/version")

    command = CommandSettings(command=["srv", "--bind={host}:{port}"], health_path="/health", env={"A": "1"})
    launch = command.launch(target="x", port=9, workdir=tmp_path)
    assert launch.argv == ["srv", "--bind=127.0.0.1:9"] and launch.env == {"A": "1"}
    assert (launch.ready_path, launch.health_path, launch.ready_model) == ("/v1/models", "/health", None)


def test_log_rotation_keeps_the_bound(tmp_path: Path) -> None:
    assert EngineFiles(tmp_path, "tiny-1.5b_q4").log.name == "tiny-1.5b_q4.log"
    files = EngineFiles(tmp_path, "org/model:7b")
    assert files.log.name.startswith("org_model_7b-") and files.pid_file(42).name == files.log.name.replace(
        ".log", ".42.pid"
    )
    assert files.log != EngineFiles(tmp_path, "org_model:7b").log
    log = RotatingLog(files.log, max_bytes=1024, backups=2)
    for number in range(40):
        log.write(f"line {number:03d} ".encode() + b"x" * 90 + b"\n")
    log.close()
    kept = sorted(path.name for path in tmp_path.iterdir())
    assert kept == [files.log.name, f"{files.log.name}.1", f"{files.log.name}.2"]
    assert all(path.stat().st_size <= 1024 for path in tmp_path.iterdir())
    assert files.log.read_text().splitlines()[-1].startswith("line 039")
    assert "line 000" not in "".join(path.read_text() for path in tmp_path.iterdir())  # the oldest dropped


def test_engines_dir_unset_is_beside_the_run_history_not_where_the_node_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path.parent)  # started elsewhere: the servers' files stay with the node's own
    monkeypatch.delenv("IOP_ENGINES_DIR", raising=False)
    (tmp_path / "node.yaml").write_text("store_path: state/runs.db\nroutes: [{model: m, adapter: mock}]\n")
    assert load_settings(tmp_path / "node.yaml").engines_dir == tmp_path / "state" / "engines"
    (tmp_path / "node.yaml").write_text("store_path: state/runs.db\nengines_dir: mine\nroutes: []\n")
    assert load_settings(tmp_path / "node.yaml").engines_dir == tmp_path / "mine"
