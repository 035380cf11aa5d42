"""``iop up --model``'s checks and routes, and how ``iop nodes ls`` / ``iop models`` / ``iop status``
show a served model's state, from protobuf messages built here as the control-plane sends them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from iop_cli.chat import _Fleet
from iop_cli.ggufs import GGUF_MAGIC, default_name, engine_logs, engine_models, gguf_models, llama_routes
from iop_cli.ops import _node_dict, _nodes_table
from iop_cli.output import CliError
from iop_cli.served import ServedWait, served_dict, served_text, span
from iop_cli.status import _served as status_served
from iop_gen.pb.iop import runtime_pb2 as pb

NOW = 1_800_000_000.0


def _gguf(path: Path) -> Path:
    path.write_bytes(GGUF_MAGIC + b"\x03\x00\x00\x00" + bytes(64))
    return path


@pytest.mark.parametrize(
    ("file", "name"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
        ("llama-3.2-1b-instruct-q8_0.gguf", "llama-3.2-1b-instruct"),
        ("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", "qwen2.5-0.5b-instruct"),
        ("phi-2.IQ3_XS.gguf", "phi-2"),
        ("tinyllama.F16.gguf", "tinyllama"),
        ("model-bf16.gguf", "model"),
        ("tiny.gguf", "tiny"),
        ("Q4_0.gguf", "q4_0"),  # nothing left without the suffix: the stem stays
    ],
)
def test_a_model_is_named_by_its_file_without_the_quantisation(file: str, name: str) -> None:
    assert default_name(Path(file)) == name


def test_models_are_checked_and_named(tmp_path: Path) -> None:
    smol = _gguf(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    tiny = _gguf(tmp_path / "tiny.gguf")
    models = gguf_models([str(smol), f"{tiny}=my-tiny"])
    assert [(m.path, m.name) for m in models] == [(smol, "smollm2-135m-instruct"), (tiny, "my-tiny")]


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda d: d / "missing.gguf", "cannot read"),
        (lambda d: d, "is a directory"),
        (lambda d: (d / "x.gguf").write_bytes(b"GGML....") and d / "x.gguf", "is not a GGUF file"),
        (lambda d: (d / "empty.gguf").write_bytes(b"") or d / "empty.gguf", "is not a GGUF file"),
    ],
)
def test_a_missing_or_foreign_file_is_one_line_naming_it(tmp_path: Path, make: object, said: str) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(CliError) as refused:
        gguf_models([str(path)])
    message = str(refused.value)
    assert refused.value.code == 2 and "\n" not in message
    assert message.startswith(f"--model {path}:") and said in message


def test_two_files_of_one_name_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    first, second = _gguf(tmp_path / "tiny.gguf"), _gguf(tmp_path / "a" / "tiny.Q8_0.gguf")
    with pytest.raises(CliError, match="two files are named 'tiny'"):
        gguf_models([str(first), str(second)])
    with pytest.raises(CliError, match="NAME must be"):
        gguf_models([f"{first}=bad name"])


def test_routes_run_llama_cpp_with_the_python_found(tmp_path: Path) -> None:
    tiny = _gguf(tmp_path / "tiny.gguf")
    routes = llama_routes(gguf_models([str(tiny)]), Path("/opt/llama/bin/python"))
    assert routes == [
        {
            "model": "tiny",
            "engine": "llama.cpp",
            "max_concurrency": 1,
            "serve": {"model_path": str(tiny), "python": "/opt/llama/bin/python"},
        }
    ]
    config = tmp_path / "node.yaml"
    config.write_text("routes:\n- {model: mock-small, adapter: mock}\n- {model: tiny, engine: llama.cpp}\n")
    assert engine_models(config) == ["tiny"]
    assert engine_models(tmp_path / "none.yaml") == []


# --- the state shown -----------------------------------------------------------------------------------


def _served(state: pb.ServedState.ValueType, **fields: object) -> pb.ServedModel:
    served = pb.ServedModel(engine="llama.cpp", state=state, **fields)  # type: ignore[arg-type]
    served.since.FromNanoseconds(int((NOW - 185) * 1e9))
    return served


READY = _served(pb.SERVED_STATE_READY, pid=1234, port=40123, restarts=1)
STARTING = _served(pb.SERVED_STATE_STARTING, pid=1300, port=40124)
RESTARTING = _served(pb.SERVED_STATE_RESTARTING, port=40125, restarts=2, failed_starts=1, reason="exited with code -9")
FAILED = _served(
    pb.SERVED_STATE_FAILED,
    port=40126,
    failed_starts=5,
    reason="exited with code 1; last log lines:\n" + "x" * 300 + "\nValueError: Failed to load model from file: a.gguf",
)
STOPPING = _served(pb.SERVED_STATE_STOPPING, pid=1400, port=40127)


@pytest.mark.parametrize(
    ("served", "text"),
    [
        (READY, "llama.cpp: ready, up 3m, pid 1234, port 40123, 1 restart"),
        (STARTING, "llama.cpp: starting, pid 1300, port 40124"),
        (RESTARTING, "llama.cpp: restarting, port 40125, 2 restarts, 1 failed start: exited with code -9"),
        (STOPPING, "llama.cpp: stopping, pid 1400, port 40127"),
    ],
)
def test_each_state_in_words(served: pb.ServedModel, text: str) -> None:
    assert served_text(served, NOW) == text


def test_a_failed_model_shows_why_on_one_line_with_the_servers_last_words() -> None:
    text = served_text(FAILED, NOW)
    assert text.startswith("llama.cpp: failed, port 40126, 5 failed starts: exited with code 1; last log lines: ")
    assert text.endswith("ValueError: Failed to load model from file: a.gguf") and "\n" not in text
    assert len(text) < 300 and " ... " in text
    assert served_text(FAILED, NOW, whole_reason=True).endswith(
        "x" * 300 + "\nValueError: Failed to load model from file: a.gguf"
    )


def test_json_has_every_field_and_the_uptime_only_when_ready() -> None:
    assert served_dict(READY, NOW) == {
        "engine": "llama.cpp",
        "state": "ready",
        "reason": "",
        "restarts": 1,
        "failed_starts": 0,
        "since": NOW - 185,
        "uptime_s": 185.0,
        "pid": 1234,
        "port": 40123,
    }
    assert served_dict(FAILED, NOW)["uptime_s"] is None and served_dict(FAILED, NOW)["pid"] is None


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (59.9, "59s"), (185, "3m"), (7500, "2h5m"), (273600, "3d4h")])
def test_spans(seconds: float, text: str) -> None:
    assert span(seconds) == text


def _node(node_id: str, *loads: pb.ModelLoad) -> pb.NodeInfo:
    node = pb.NodeInfo(node_id=node_id, state=pb.NODE_STATE_READY, models=loads, in_flight=0, capacity=5)
    node.last_heartbeat.FromNanoseconds(int(NOW * 1e9))
    return node


def _load(model: str, served: pb.ServedModel | None = None, available: bool = True) -> pb.ModelLoad:
    load = pb.ModelLoad(model=model, capacity=1, available=available)
    if served is not None:
        load.served.CopyFrom(served)
    return load


def test_nodes_ls_shows_a_served_models_state_in_place_of_its_availability() -> None:
    nodes = [
        _node("a", _load("smol", READY), _load("mock-small"), _load("gone", available=False)),
        _node("b", _load("tiny", FAILED, available=False), _load("boot", STARTING, available=False)),
        _node("c", _load("again", RESTARTING, available=False), _load("bye", STOPPING)),
    ]
    shown = _nodes_table(nodes, NOW)
    row = {line.split()[0]: line for line in shown.splitlines()}
    assert "smol (llama.cpp: ready, up 3m, pid 1234, port 40123, 1 restart),mock-small,gone(unavailable)" in row["a"]
    assert "tiny (llama.cpp: failed, port 40126, 5 failed starts: exited with code 1" in row["b"]
    assert "ValueError: Failed to load model from file: a.gguf),boot (llama.cpp: starting, pid 1300" in row["b"]
    assert "again (llama.cpp: restarting," in row["c"] and "bye (llama.cpp: stopping, pid 1400" in row["c"]
    as_json = _node_dict(nodes[1], NOW)["models"]
    assert as_json[0]["served"]["state"] == "failed" and as_json[0]["served"]["reason"] == FAILED.reason
    assert _node_dict(nodes[0], NOW)["models"][1]["served"] is None


def test_models_has_a_state_column_and_lists_served_models_the_edge_leaves_out() -> None:
    fleet = _Fleet([_node("a", _load("smol", READY), _load("tiny", FAILED)), _node("b", _load("smol", STARTING))])
    listed = fleet.row({"id": "smol", "object": "model"})
    assert listed["max_concurrency"] == 2 and listed["state"] == "ready,starting"
    assert [(s["node_id"], s["state"]) for s in listed["served"]] == [("a", "ready"), ("b", "starting")]
    assert list(fleet.served) == ["smol", "tiny"]  # tiny is not available: the edge does not list it
    assert fleet.row({"id": "mock-small"})["state"] is None


def test_status_has_a_line_per_served_model() -> None:
    node = _node("local-node", _load("smol", READY), _load("mock-small"), _load("tiny", FAILED))
    shown = status_served(node)
    # the uptime is counted to now, from a `since` in the test's future: 0s
    assert shown["served_lines"][0] == "model smol: llama.cpp: ready, up 0s, pid 1234, port 40123, 1 restart"
    assert shown["served_lines"][1].startswith("model tiny: llama.cpp: failed")
    assert [m["model"] for m in shown["served"]] == ["smol", "tiny"]
    assert status_served(None) == {}


# --- iop up waiting -------------------------------------------------------------------------------------


def test_up_waits_until_each_model_is_ready_and_says_so() -> None:
    answers = iter(
        [
            pb.NodesListed(nodes=[_node("local-node")]),  # not reported yet
            pb.NodesListed(nodes=[_node("local-node", _load("smol", STARTING), _load("tiny", STARTING))]),
            pb.NodesListed(nodes=[_node("local-node", _load("smol", READY), _load("tiny", STARTING))]),
            pb.NodesListed(nodes=[_node("other", _load("tiny", READY)), _node("local-node", _load("tiny", READY))]),
        ]
    )
    said: list[str] = []
    waiting = ServedWait(lambda: next(answers), "local-node", ["smol", "tiny"], report=said.append)
    assert waiting.wait(timeout=10, interval=0.001)
    assert said[0].startswith("model smol: ready (llama.cpp, pid 1234, port 40123) in ")
    assert said[1].startswith("model tiny: ready (llama.cpp, pid 1234, port 40123) in ")


def test_up_stops_waiting_for_a_failed_model_and_says_why() -> None:
    def listed() -> pb.NodesListed:
        return pb.NodesListed(nodes=[_node("local-node", _load("tiny", FAILED), _load("smol", STARTING))])

    said: list[str] = []
    waiting = ServedWait(listed, "local-node", ["tiny", "smol"], report=said.append)
    started = time.monotonic()
    assert not waiting.wait(timeout=0.3, interval=0.01)
    assert time.monotonic() - started >= 0.3  # smol is waited for to the end
    assert said == [f"model tiny: {served_text(FAILED, 0, whole_reason=True)}"]
    assert waiting.failed == ["tiny"]
    assert waiting.pending() == ["model smol: still llama.cpp: starting, pid 1300, port 40124"]


def test_a_control_plane_that_cannot_be_asked_is_asked_again() -> None:
    calls: list[int] = []

    def listed() -> pb.NodesListed:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError
        return pb.NodesListed(nodes=[_node("local-node", _load("smol", READY))])

    assert ServedWait(listed, "local-node", ["smol"], report=lambda _: None).wait(timeout=10, interval=0.001)
    never = ServedWait(pb.NodesListed, "local-node", ["smol"], report=lambda _: None)
    assert not never.wait(timeout=0.05, interval=0.01)
    assert never.pending() == ["model smol: not reported by the node yet"]


def test_the_log_paths_printed_are_the_nodes_own_file_names(tmp_path: Path) -> None:
    """A model name with / or : is written by the node under a sanitised name with a hash: up prints that one."""
    serve = {"model_path": "m.gguf"}
    routes = [{"model": name, "engine": "llama.cpp", "serve": serve} for name in ("smol", "org/x:7b")]
    (tmp_path / "node.yaml").write_text(yaml.safe_dump({"engines_dir": "models", "routes": routes}))
    plain, odd = engine_logs(tmp_path / "node.yaml")
    assert plain == tmp_path / "models" / "smol.log"
    assert odd.parent == tmp_path / "models" and odd.name.startswith("org_x_7b-") and odd.name.endswith(".log")
