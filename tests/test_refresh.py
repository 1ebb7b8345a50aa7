"""The core of a draft that follows its target (`eaglet.refresh`): the current draft (its record,
else the last run's), the watch's change (by content: a README or a byte copy is none), the
keep-or-train verdict against `refresh.max_drop`, and the config a refresh trains with. The
flows, the event and the trigger on a real Prefect server: tests/test_prefect_server.py."""

from __future__ import annotations

import json
import shutil

import pytest

from eaglet.config import load_config
from eaglet.refresh import (
    PROMOTED_FILE,
    RefreshError,
    current_draft,
    promote,
    retrain_config,
    target_change,
    verdict,
)
from eaglet.run_report import start_run_record, write_run_record
from tests.pipeline_helpers import run_every_stage, small_pipeline


def test_the_verdict_keeps_a_draft_whose_tau_held_and_trains_one_that_fell():
    kept = verdict({"gsm8k": 3.0, "mt-bench": 2.0}, {"gsm8k": 2.95, "mt-bench": 2.0}, 0.03)
    assert kept["keep"] and kept["lines"][0].startswith("gsm8k: τ 3.000 at training, 2.950")
    fell = verdict({"gsm8k": 3.0, "mt-bench": 2.0}, {"gsm8k": 2.95, "mt-bench": 1.9}, 0.03)
    assert not fell["keep"] and fell["worst_drop"] == pytest.approx(0.05)
    assert "is trained again" in fell["lines"][-1]
    with pytest.raises(RefreshError, match="evaluate.sets"):
        verdict({}, {"gsm8k": 1.0}, 0.03)


def test_a_refresh_trains_from_the_draft_for_a_share_of_the_epochs_on_its_samples(tmp_path):
    config = load_config(None, ["train.epochs=8", "refresh.samples=30"])
    retrain = retrain_config(config, tmp_path / "draft")
    assert retrain.train.init_from == str((tmp_path / "draft").resolve())
    assert retrain.train.init_from_vocab == "grow" and retrain.train.epochs == 3
    assert [d.limit for d in retrain.datasets] == [10, 10, 10]  # the demo's three sources
    assert config.train.init_from is None  # the config itself untouched


@pytest.mark.slow  # a small pipeline run
def test_the_watch_sees_a_changed_target_by_content_only(
    tmp_path, fixture_model_dir, sample_data_dir
):
    target, work = tmp_path / "target", tmp_path / "work"
    shutil.copytree(fixture_model_dir, target)
    config = small_pipeline(work, target, sample_data_dir)
    assert current_draft(work) is None and target_change(config) is None  # nothing trained
    run = start_run_record(config, None, "evaluate", None)
    for stage, manifest in run_every_stage(config).items():
        run["stages"][stage] = {"key": manifest.key, "state": "Completed"}
    write_run_record(work, run)
    draft = current_draft(work)  # the last run's, no record yet
    assert draft is not None and (work / draft.draft / "config.json").is_file()
    assert not (work / PROMOTED_FILE).exists()

    (target / "README.md").write_text("a card\n")
    shutil.copytree(target, tmp_path / "copy")
    shutil.rmtree(target)
    (tmp_path / "copy").rename(target)
    assert target_change(config) is None  # a README and new files of the same bytes

    promote(work, draft)
    generation = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": 1}))
    change = target_change(config)
    assert change is not None and change["changed"] == ["generation_config"]
    assert change["old"] == draft.target and change["draft"] == draft.draft
