"""The train stage through the real pipeline: online training under torchrun stores no shards,
records which mode ran and the disk it saved, and a rerun is Cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli, small_run_overrides
from tests.vllm_server import vllm_python

pytestmark = pytest.mark.slow


def test_online_training_under_torchrun_skips_the_shards(
    tmp_path, fixture_model_dir, sample_data_dir
):
    work_dir = tmp_path / "work"
    overrides = small_run_overrides(work_dir, fixture_model_dir, sample_data_dir) + [
        "train.hidden_states=online",
        "train.nproc_per_node=2",
        "train.threads=1",
    ]
    args = ["run", "/dev/null", "--until", "train"]
    args += [item for o in overrides for item in ("--set", o)]
    slow_machine = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "600"}
    first = run_cli(args, cwd=tmp_path, env=slow_machine)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run = json.loads((work_dir / "run.json").read_text())
    states = {stage: figures["state"] for stage, figures in run["stages"].items()}
    assert states["train"] == "Completed" and "hidden_states" not in states
    assert not (work_dir / "hidden_states").exists()  # nothing stored

    manifest = json.loads((Path(run["stages"]["train"]["path"]) / "manifest.json").read_text())
    info = manifest["info"]
    assert info["hidden_states_mode"] == "online" and info["world_size"] == 2
    assert info["feature_bytes_stored"] == 0 and info["feature_bytes_saved"] > 0
    assert info["steps"] == info["total_steps"] > 0
    assert (Path(run["stages"]["train"]["path"]) / "draft" / "model.safetensors").exists()

    second = run_cli(args, cwd=tmp_path, env=slow_machine)
    assert second.returncode == 0, second.stderr[-3000:]
    run = json.loads((work_dir / "run.json").read_text())
    assert run["stages"]["train"]["state"] == "Cached"

    # The mode and the disk it saved, where a person looks: inspect and the run report.
    inspected = run_cli(["inspect", str(work_dir)], cwd=tmp_path)
    assert "training: online hidden states, 0 B stored" in inspected.stdout, inspected.stdout
    as_json = json.loads(run_cli(["inspect", str(work_dir), "--json"], cwd=tmp_path).stdout)
    assert as_json["training"]["hidden_states_mode"] == "online"
    assert as_json["training"]["feature_bytes_saved"] == info["feature_bytes_saved"]
    assert "online hidden states" in (work_dir / "run_report.md").read_text()


@pytest.mark.vllm
@pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (make vllm-venv)")
def test_online_training_from_a_vllm_server_eaglet_starts(
    tmp_path, fixture_model_dir, sample_data_dir
):
    """train.hidden_states=online with hidden_states.backend=vllm and vllm_python: the train
    stage starts a vLLM server (extract_hidden_states, eaglet's CPU connector), trains from
    the states it serves, stops it, and keeps its log; no shard is stored."""
    work_dir = tmp_path / "work"
    overrides = small_run_overrides(work_dir, fixture_model_dir, sample_data_dir) + [
        "train.hidden_states=online",
        "train.threads=1",
        "hidden_states.backend=vllm",
        f"hidden_states.vllm_python={vllm_python()}",
        "hidden_states.vllm_args=[--enforce-eager, --max-model-len, '1024']",
    ]
    args = ["run", "/dev/null", "--until", "train"]
    args += [item for o in overrides for item in ("--set", o)]
    result = run_cli(args, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = json.loads((work_dir / "run.json").read_text())
    folder = Path(run["stages"]["train"]["path"])
    assert run["stages"]["train"]["state"] == "Completed" and "hidden_states" not in run["stages"]
    assert not (work_dir / "hidden_states").exists()
    info = json.loads((folder / "manifest.json").read_text())["info"]
    assert info["hidden_states_mode"] == "online" and info["steps"] == info["total_steps"] > 0
    assert (folder / "vllm_server.log").stat().st_size > 0
    assert not (folder / "connector").exists()
    assert "vLLM server up at http://127.0.0.1:" in result.stdout + result.stderr
