"""`eaglet doctor`: a bad config gives clear lines naming the key or file, never a traceback;
a server that accepts connections and never answers is reported within the canary's budget,
not after `request_timeout_s` (1800 s) per try."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml

from eaglet_prefect.flows.cli import main
from tests.fake_servers import FakeServer, serve, silent_server
from tests.preflight_helpers import make_target


@pytest.fixture
def good(tmp_path) -> dict:
    model = make_target(tmp_path / "model")
    data = tmp_path / "arith.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{i} + {i}?"}]} for i in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "work_dir": str(tmp_path / "work"),
        "target": {"model": str(model)},
        "datasets": [{"source": "arith", "path": str(data)}],
    }


def doctor(tmp_path: Path, data: dict, capsys) -> tuple[int, str]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    code = main(["doctor", str(path)])  # an uncaught error would raise here
    # stdout only: stderr may hold a "--- Logging error ---" traceback of a library logger
    # whose handler still points at an earlier test's closed capture stream.
    return code, capsys.readouterr().out


def test_a_good_config_is_ok(tmp_path, good, capsys):
    code, out = doctor(tmp_path, good, capsys)
    assert code == 0, out
    assert "doctor: ok" in out and "preflight: ok" in out


def _break(case: str, data: dict, tmp_path: Path) -> str:
    """Break `data` as `case` says; the text the doctor's problem line must hold."""
    model = Path(data["target"]["model"])
    if case == "missing_model_folder":
        data["target"]["model"] = str(tmp_path / "models" / "fixture")
        return "target.model: folder"
    if case == "folder_without_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
            (model / name).unlink()
        return "target.model: no tokenizer in the folder"
    if case == "hub_id_missing":
        data["target"]["model"] = "nobody-at-all/no-such-model"
        return "target.model='nobody-at-all/no-such-model'"
    if case == "no_datasets":
        data["datasets"] = []
        return "datasets: the list is empty"
    if case == "work_dir_is_a_file":
        Path(data["work_dir"]).write_text("x")
        return "work_dir:"
    if case == "truncated_weights":
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-64])
        return "cut short"
    if case == "empty_dataset_file":
        Path(data["datasets"][0]["path"]).write_text("")
        return "is empty"
    if case == "four_layers":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
        return "hidden_states.aux_layer_ids"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "missing_model_folder",
        "folder_without_tokenizer",
        "hub_id_missing",
        "no_datasets",
        "work_dir_is_a_file",
        "truncated_weights",
        "empty_dataset_file",
        "four_layers",
    ],
)
def test_bad_configs_give_one_clear_line_each(tmp_path, good, capsys, case):
    expected = _break(case, good, tmp_path)
    code, out = doctor(tmp_path, good, capsys)
    assert code == 1, out
    assert "Traceback" not in out
    problems = [line for line in out.splitlines() if line.startswith("problem: ")]
    assert any(expected in line for line in problems), out
    assert "doctor: " in out and "problem(s)" in out


def _doctor_in_thread(tmp_path: Path, data: dict, capsys) -> tuple[int, str] | None:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(doctor(tmp_path, data, capsys)))
    thread.daemon = True
    thread.start()
    thread.join(timeout=120)
    return result[0] if result else None


@pytest.mark.slow  # seconds of subprocess or timeouts: outside the fast suite
def test_doctor_against_a_server_that_never_answers_comes_back(tmp_path, good, capsys):
    with silent_server() as url:
        good["generation"] = {
            "engine": "vllm",
            "endpoints": [url],
            "request_timeout_s": 1800,
            "canary_timeout_s": 3,
        }
        result = _doctor_in_thread(tmp_path, good, capsys)
    assert result is not None, "doctor hung against a silent server (canary_timeout_s=3)"
    code, out = result
    assert code == 1 and "did not answer GET" in out and "Traceback" not in out


@pytest.mark.slow  # seconds of subprocess or timeouts: outside the fast suite
def test_doctor_against_a_server_that_never_generates_comes_back(tmp_path, good, capsys):
    fake = FakeServer(hang_s=600)
    fake.faults.extend(["hang"] * 8)
    with serve(fake) as url:
        good["generation"] = {
            "engine": "vllm",
            "endpoints": [url],
            "request_timeout_s": 1800,
            "canary_timeout_s": 3,
        }
        result = _doctor_in_thread(tmp_path, good, capsys)
    assert result is not None, "doctor hung against a server that never generates"
    code, out = result
    assert code == 1 and "no answer within generation.canary_timeout_s=3 s" in out
