"""SIGKILL at random moments inside every stage, then a rerun: the result equals an
uninterrupted run's, with no duplicates, no orphaned temporary files and no leftover processes.

`eaglet run` runs as a user runs it, in its own process group (the temporary Prefect server
the CLI starts is in it). A watcher sees a stage start by its `WORK_DIR/<stage>/<key>.partial`
folder, waits a random part of that stage's duration (measured in the uninterrupted run) and
kills the whole group with SIGKILL. The next stage is killed in the next run, which first
resumes what the kill interrupted, so each seed kills seven runs in a row and then lets one
finish. The final files are compared by content with the uninterrupted run's: records by
sample id (JSONL), tensors exactly (safetensors), reports field by field.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest

from eaglet.stages import STAGES
from tests.reliability.conftest import (
    kill_group,
    kill_marked,
    records_by_id,
    start_run,
    temporary_leftovers,
    wait_for_no_marked_processes,
)
from tests.reliability.run_helpers import disk_signature, run_args, stage_state

pytestmark = pytest.mark.slow  # no clock bound: beside other tests (each run's own marker)

# One seed in CI (seven kills, one per stage, ~2 min); more with EAGLET_KILL_SEEDS="1 2 3".
SEEDS = [int(seed) for seed in os.environ.get("EAGLET_KILL_SEEDS", "1").split()]
POLL_S = 0.005
RUN_TIMEOUT_S = 900
# Files whose content depends on the clock (timings, plots, checkpoints kept only to resume).
VOLATILE = {"manifest.json", "metrics.jsonl", "loss.png", "acceptance.png"}
STAGE_FOLDER = re.compile(r"^\S*?/([a-z_]+)/[0-9a-f]{20}(?=/|$)")
VOLATILE_KEYS = {"elapsed_s", "seconds", "started", "finished", "requests_per_s", "time"}


def watch_uninterrupted_run(folder: Path, args: list[str]) -> dict[str, float]:
    """Run to the end, watching each stage: stage -> seconds from its `.partial` folder
    appearing to its finished folder appearing (0 when the watcher never saw the partial)."""
    work_dir = folder / "work"
    process, marker = start_run(args, folder, folder / "run.log")
    seen: dict[str, float] = {}
    windows: dict[str, float] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while process.poll() is None and time.monotonic() < deadline:
            now = time.monotonic()
            for stage in STAGES:
                if stage in windows:
                    continue
                partial, finished = stage_state(work_dir, stage)
                if partial and stage not in seen:
                    seen[stage] = now
                if finished:
                    windows[stage] = now - seen.get(stage, now)
            time.sleep(POLL_S)
        assert process.poll() == 0, (folder / "run.log").read_text()[-4000:]
    finally:
        if process.poll() is None:
            kill_group(process)
        kill_marked(marker)
    return windows


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, fixture_model_dir, sample_data_dir):
    """The reference run: its folder and each stage's duration as the watcher saw it."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    windows = watch_uninterrupted_run(folder, run_args(folder, fixture_model_dir, sample_data_dir))
    return folder / "work", windows


def kill_inside(stage: str, folder: Path, args: list[str], delay_s: float) -> dict:
    """Start a run, wait until it touches `stage` (or a later one: a stage finished by an
    earlier run is skipped), SIGKILL the group `delay_s` later. What happened: whether the
    kill landed while the stage's partial folder was there, and processes left alive."""
    work_dir = folder / "work"
    watched = STAGES[STAGES.index(stage) :]
    before = disk_signature(work_dir, watched)
    # An earlier kill that landed after this stage finished: kill as soon as the run touches
    # a later stage.
    done_before = stage_state(work_dir, stage)[1] and not stage_state(work_dir, stage)[0]
    process, marker = start_run(args, folder, folder / "run.log")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while disk_signature(work_dir, watched) == before:
            assert process.poll() is None, (
                f"the run ended before {stage} started: " + (folder / "run.log").read_text()[-3000:]
            )
            assert time.monotonic() < deadline, f"{stage} did not start in {RUN_TIMEOUT_S} s"
            time.sleep(POLL_S)
        # Wait out the delay, but never past the stage's end: a resumed stage is shorter
        # than the reference run's, and a kill that overshot it could finish the next stage.
        until = time.monotonic() + (0.0 if done_before else delay_s)
        while time.monotonic() < until and stage_state(work_dir, stage)[0]:
            time.sleep(POLL_S)
        inside = stage_state(work_dir, stage)[0]
        kill_group(process)
        leftover = wait_for_no_marked_processes(marker)
    finally:
        if process.poll() is None:
            kill_group(process)
        kill_marked(marker)
    return {
        "stage": stage,
        "delay_s": round(delay_s, 3),
        "inside": inside,
        "done_before": done_before,
        "leftover": leftover,
    }


def stage_files(folder: Path) -> dict[str, Path]:
    return {
        str(path.relative_to(folder)): path
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name not in VOLATILE and "state" not in path.parts[-2:-1]
    }


def without_volatile(value):
    """`value` without timings, and with stage folders named without their work dir and key
    (keys hash upstream manifests, whose timestamps differ from run to run)."""
    if isinstance(value, dict):
        return {k: without_volatile(v) for k, v in value.items() if k not in VOLATILE_KEYS}
    if isinstance(value, list):
        return [without_volatile(v) for v in value]
    if isinstance(value, str):
        return STAGE_FOLDER.sub(r"<work>/\1/<key>", value)
    return value


def assert_same_content(name: str, ours: Path, theirs: Path) -> None:
    if name.endswith(".jsonl"):
        mine, duplicates = records_by_id(ours)
        reference, _ = records_by_id(theirs)
        assert not duplicates, f"{name}: records written twice: {duplicates[:5]}"
        assert mine.keys() == reference.keys(), (
            f"{name}: missing {sorted(reference.keys() - mine.keys())[:5]}, "
            f"extra {sorted(mine.keys() - reference.keys())[:5]}"
        )
        for key, record in reference.items():
            assert without_volatile(mine[key]) == without_volatile(record), f"{name}: {key} differs"
    elif name.endswith(".safetensors"):
        import torch
        from safetensors.torch import load_file

        mine, reference = load_file(ours), load_file(theirs)
        assert mine.keys() == reference.keys(), name
        for key, tensor in reference.items():
            assert torch.equal(mine[key], tensor), f"{name}: tensor {key} differs"
    elif name.endswith(".json"):
        mine, reference = json.loads(ours.read_text()), json.loads(theirs.read_text())
        assert without_volatile(mine) == without_volatile(reference), f"{name} differs"
    else:
        assert ours.read_bytes() == theirs.read_bytes(), f"{name} differs"


def final_folders(work_dir: Path) -> dict[str, Path]:
    run = json.loads((work_dir / "run.json").read_text())
    return {stage: Path(entry["path"]) for stage, entry in run["stages"].items()}


@pytest.mark.parametrize("seed", SEEDS)
def test_sigkill_inside_every_stage_then_rerun_equals_an_uninterrupted_run(
    seed, uninterrupted, tmp_path, fixture_model_dir, sample_data_dir
):
    reference_dir, windows = uninterrupted
    rng = random.Random(seed)
    args = run_args(tmp_path, fixture_model_dir, sample_data_dir)
    kills = []
    for stage in STAGES:
        delay = rng.uniform(0.0, 0.9 * windows.get(stage, 0.0))
        kills.append(kill_inside(stage, tmp_path, args, delay))
    print(f"seed {seed} kills: {kills}")
    leftovers = {k["stage"]: k["leftover"] for k in kills if k["leftover"]}
    assert not leftovers, f"processes outlived the killed process group: {leftovers}"
    inside = [k["stage"] for k in kills if k["inside"]]
    # Where each kill lands is random: a resumed stage runs shorter than the reference run's,
    # so a kill may land just after its stage, and the watcher may miss a stage that takes a
    # few milliseconds. At least one long stage is killed inside its partial folder.
    assert {"generate", "hidden_states", "train"} & set(inside), kills

    log = tmp_path / "run.log"
    offset = log.stat().st_size if log.exists() else 0
    process, marker = start_run(args, tmp_path, log)
    try:
        assert process.wait(timeout=RUN_TIMEOUT_S) == 0, log.read_text()[-4000:]
        assert not wait_for_no_marked_processes(marker), "processes outlived a finished run"
    finally:
        if process.poll() is None:
            kill_group(process)
        kill_marked(marker)
    # The killed run's work-dir lock was taken over, and the run said so.
    assert "took over the lock of a run that ended" in log.read_bytes()[offset:].decode()

    work_dir = tmp_path / "work"
    assert not temporary_leftovers(work_dir), temporary_leftovers(work_dir)
    ours, reference = final_folders(work_dir), final_folders(reference_dir)
    assert ours.keys() == reference.keys() == set(STAGES)
    for stage in STAGES:
        mine, theirs = stage_files(ours[stage]), stage_files(reference[stage])
        assert mine.keys() == theirs.keys(), f"{stage}: {sorted(mine.keys() ^ theirs.keys())}"
        for name in theirs:
            assert_same_content(f"{stage}/{name}", mine[name], theirs[name])
