"""A work dir copied to another path is used where it is (issue 10, "Relocatable work dirs").

Manifests name their folders relative to the work dir, so the copy finds every stage Cached
(same keys: a manifest's content no longer holds the old absolute path) and a fresh train
reads the copied shards, not the original ones (deleted here before it runs).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli, small_run_overrides
from tests.pipeline_helpers import copy_project

pytestmark = pytest.mark.slow
UNTIL_TRAIN = ["download", "tokenize", "generate", "extract", "hidden_states", "train"]


def stage_states(work_dir: Path) -> dict[str, str]:
    run = json.loads((work_dir / "run.json").read_text())
    return {stage: figures["state"] for stage, figures in run["stages"].items()}


def test_a_copied_work_dir_is_cached_and_trains_from_its_own_shards(
    tmp_path, fixture_model_dir, sample_data_dir
):
    original, copy = tmp_path / "original", tmp_path / "elsewhere" / "copy"
    overrides = small_run_overrides(original, fixture_model_dir, sample_data_dir)
    config = tmp_path / "run.yaml"
    config.write_text("name: relocate\n")
    # a frozen copy of the code the runs import: stage keys hash the code, and a shared working
    # tree may change under a test that runs for minutes
    project = copy_project(tmp_path / "project")
    args = ["run", str(config), "--until", "train"]
    first = run_cli([*args, *(f"--set={o}" for o in overrides)], cwd=project)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert stage_states(original) == dict.fromkeys(UNTIL_TRAIN, "Completed")
    manifest = json.loads(next((original / "train").glob("*/manifest.json")).read_text())
    assert manifest["path"].startswith("train/")  # relative: nothing points back at `original`

    shutil.copytree(original, copy)
    moved = [*args, *(f"--set={o}" for o in overrides), f"--set=work_dir={copy}"]
    second = run_cli(moved, cwd=project)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert stage_states(copy) == dict.fromkeys(UNTIL_TRAIN, "Cached")

    shutil.rmtree(original)  # a train that read the old shards would fail now
    third = run_cli([*moved, "--refresh-from", "train"], cwd=project)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    states = stage_states(copy)
    assert states["train"] == "Completed"
    assert all(states[s] == "Cached" for s in UNTIL_TRAIN[:-1])
    run = json.loads((copy / "run.json").read_text())
    assert all(Path(e["path"]).is_relative_to(copy) for e in run["stages"].values())
    assert not original.exists()
    inspected = run_cli(["inspect", str(copy), "--json"], cwd=project)
    stages = json.loads(inspected.stdout)["stages"]
    assert all(stages[s]["status"] == "complete" for s in UNTIL_TRAIN)
    assert stages["train"]["path"].startswith(str(copy.resolve()))
