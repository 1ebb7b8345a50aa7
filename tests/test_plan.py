"""`eaglet run --plan` tells what the run would do (issue 46): the preflight first (a config it
refuses lists its problems and no stage, exit 2), the lock (a held work dir is said), and
after `--refresh-from train` evaluate is "Cached if train writes the same files", not a stage
whose input "no earlier run wrote"."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eaglet.stage_reasons import plan_run
from tests.conftest import run_cli, small_run_overrides
from tests.pipeline_helpers import run_every_stage, small_pipeline


def plan_args(tmp_path, fixture_model_dir, sample_data_dir, *extra: str) -> list[str]:
    overrides = small_run_overrides(tmp_path / "work", fixture_model_dir, sample_data_dir)
    return ["run", "/dev/null", "--plan", *[i for o in [*overrides, *extra] for i in ("--set", o)]]


@pytest.mark.slow  # a CLI subprocess each
def test_a_plan_the_preflight_refuses_lists_its_problems_and_no_stage(
    tmp_path, fixture_model_dir, sample_data_dir
):
    args = plan_args(tmp_path, fixture_model_dir, sample_data_dir, "train.dflash.block_size=8")
    refused = run_cli(args, cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "the run would be refused before any stage" in refused.stdout
    assert "train.dflash" in refused.stdout
    assert not any(line.startswith("  download") for line in refused.stdout.splitlines())


@pytest.mark.slow
def test_a_plan_says_another_run_holds_the_work_dir(tmp_path, fixture_model_dir, sample_data_dir):
    work = tmp_path / "work"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from eaglet import work_dir_lock; "
         f"work_dir_lock.acquire({str(work)!r}); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        plan = run_cli(plan_args(tmp_path, fixture_model_dir, sample_data_dir), cwd=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert f"pid {holder.pid}" in plan.stdout and "would exit 75" in plan.stdout
    assert any(line.startswith("  download ") for line in plan.stdout.splitlines())


def test_a_refresh_plans_later_stages_on_what_the_refreshed_stage_wrote_before(
    tmp_path, fixture_model_dir, sample_data_dir
):
    config = small_pipeline(tmp_path / "work", fixture_model_dir, sample_data_dir)
    run_every_stage(config)
    plan = {p.stage: p for p in plan_run(config, refresh_from="train")}
    assert plan["hidden_states"].state == "Cached"
    assert plan["train"].state == "runs"
    assert plan["train"].reasons == ["refresh asked for (refresh_from)"]
    assert plan["evaluate"].state == "runs" and plan["evaluate"].reasons == [
        "refresh asked for (refresh_from)"
    ]
