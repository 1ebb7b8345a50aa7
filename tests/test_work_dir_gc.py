"""`eaglet gc WORK_DIR` deletes only what nothing uses (issue 46): it lists first and removes
only with --yes; it keeps the last run's folders, every key the work dir's current config
computes (after `--until extract` too), and what another work dir uses through a symlink;
it never lists a folder eaglet did not write, never goes through a symlink, and what it lists
is what it removes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet.run_report import LINKS_FILE, start_run_record, write_run_record
from eaglet.stage_reasons import plan_run
from tests.conftest import run_cli
from tests.pipeline_helpers import run_every_stage, small_pipeline


def key(n: int) -> str:
    return f"{n:020x}"


def eaglets_folder(path: Path, manifest: bool = True) -> None:
    path.mkdir(parents=True)
    (path / "data.bin").write_bytes(b"x" * 1000)
    if manifest:
        (path / "manifest.json").write_text("{}")


def work_dir_with_history(root: Path) -> Path:
    work = root / "work"
    for name in (key(1), key(2), key(3)):  # extract: old, the last run's, another old
        eaglets_folder(work / "extract" / name)
    eaglets_folder(work / "extract" / f"{key(2)}.partial", manifest=False)
    eaglets_folder(work / "extract" / f"{key(4)}.partial", manifest=False)
    eaglets_folder(work / "extract" / f"{key(2)}.replaced-17")
    eaglets_folder(work / "generate" / key(5))
    eaglets_folder(work / "train" / f"{key(6)}.partial", manifest=False)
    eaglets_folder(work / "train" / "my_best_draft_backup", manifest=False)  # the user's
    eaglets_folder(work / "train" / key(7), manifest=False)  # a key's name, no manifest
    run = {"stages": {"extract": {"key": key(2)}, "generate": {"key": key(5)},
                      "train": {"key": key(6), "state": "Failed"}}}  # fmt: skip
    (work / "run.json").write_text(json.dumps(run))
    return work


def listed(stdout: str) -> list[str]:
    return sorted(line.split()[-1] for line in stdout.splitlines() if line.startswith("  "))


@pytest.mark.slow  # seconds of subprocess or timeouts: outside the fast suite
def test_gc_lists_eaglets_folders_first_and_removes_only_those_with_yes(tmp_path):
    work = work_dir_with_history(tmp_path)
    shown = run_cli(["gc", str(work)], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    wanted = [f"extract/{key(1)}", f"extract/{key(2)}.replaced-17", f"extract/{key(3)}",
              f"extract/{key(4)}.partial"]  # fmt: skip
    assert listed(shown.stdout) == wanted
    assert "4 folders" in shown.stdout and "--yes" in shown.stdout
    assert (work / "extract" / key(1)).is_dir()  # nothing removed yet

    removed = run_cli(["gc", str(work), "--yes"], cwd=tmp_path)
    assert removed.returncode == 0, removed.stderr
    assert listed(removed.stdout) == wanted and "removed 4 folders" in removed.stdout
    left = sorted(str(p.relative_to(work)) for p in work.glob("*/*"))
    assert left == [
        f"extract/{key(2)}", f"extract/{key(2)}.partial", f"generate/{key(5)}",
        f"train/{key(6)}.partial", f"train/{key(7)}", "train/my_best_draft_backup",
    ]  # fmt: skip


def test_gc_without_a_run_record_removes_nothing(tmp_path):
    work = work_dir_with_history(tmp_path)
    (work / "run.json").unlink()
    refused = run_cli(["gc", str(work), "--yes"], cwd=tmp_path)
    assert refused.returncode == 2 and "no run.json" in refused.stderr
    assert (work / "extract" / key(1)).is_dir()


def test_symlinks_are_never_followed_and_said(tmp_path):
    from eaglet.work_dir_gc import survey

    work = work_dir_with_history(tmp_path)
    elsewhere = tmp_path / "elsewhere" / key(9)
    eaglets_folder(elsewhere)
    (work / "extract" / key(8)).symlink_to(elsewhere)
    found = survey(work)
    assert all(item.folder.name != key(8) for item in found.superseded)
    assert found.not_followed == [f"extract/{key(8)} -> {elsewhere}"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, fixture_model_dir, sample_data_dir) -> Path:
    """A small pipeline run through every stage, with the records a run writes."""
    root = tmp_path_factory.mktemp("finished")
    config = small_pipeline(root / "A", fixture_model_dir, sample_data_dir)
    run = start_run_record(config, None, "evaluate", None)
    for stage, manifest in run_every_stage(config).items():
        run["stages"][stage] = {"key": manifest.key, "state": "Completed"}
    write_run_record(root / "A", run)
    return root


def run_until_extract(work: Path, fixture_model_dir: Path, data: Path) -> None:
    """What `eaglet run --until extract` leaves: its config, a run.json of four stages."""
    config = small_pipeline(work, fixture_model_dir, data)
    run = start_run_record(config, None, "extract", None)
    for stage, manifest in run_every_stage(config, until="extract").items():
        run["stages"][stage] = {"key": manifest.key, "state": "Cached"}
    write_run_record(work, run)


def test_after_a_run_until_extract_the_current_configs_later_folders_are_kept(
    finished, tmp_path, fixture_model_dir, sample_data_dir
):
    from eaglet.work_dir_gc import remove, survey

    work = tmp_path / "A"
    shutil.copytree(finished / "A", work)
    run_until_extract(work, fixture_model_dir, sample_data_dir)
    config = small_pipeline(work, fixture_model_dir, sample_data_dir)
    plan = {p.stage: p for p in plan_run(config)}
    assert {p.state for p in plan.values()} == {"Cached"}  # what --plan calls Cached ...
    found = survey(work)
    assert found.superseded == [] and found.kept == 7  # ... gc keeps
    eaglets_folder(work / "train" / key(1))  # a folder of an earlier key goes
    assert [i.folder.name for i in survey(work).superseded] == [key(1)]
    remove(survey(work).superseded, work)
    assert {p.state for p in plan_run(config)} == {"Cached"}


def test_what_another_work_dir_uses_through_a_symlink_is_kept(
    finished, tmp_path, fixture_model_dir, sample_data_dir
):
    """B shares A's hidden states (`B/hidden_states -> A/hidden_states`): gc of B never
    touches them, and gc of A keeps the folder B's last run used even once A's own config
    moved on; while a run holds B, nothing of A's hidden_states is removed."""
    from eaglet import work_dir_lock
    from eaglet.work_dir_gc import survey

    a, b = tmp_path / "A", tmp_path / "B"
    shutil.copytree(finished / "A", a)
    shared = next(p for p in (a / "hidden_states").iterdir() if p.is_dir()).name
    b.mkdir()
    (b / "hidden_states").symlink_to(a / "hidden_states")
    config = small_pipeline(b, fixture_model_dir, sample_data_dir)
    run = start_run_record(config, None, "evaluate", None)  # records the link in A
    run["stages"]["hidden_states"] = {"key": shared, "state": "Cached"}
    write_run_record(b, run)
    assert (a / "hidden_states" / LINKS_FILE).read_text() == f"{b.resolve()}\n"

    of_b = survey(b)
    assert of_b.superseded == [] and of_b.not_followed[0].startswith("hidden_states/ -> ")

    # A moves on: its config no longer names the shared folder; B's run still does
    a_run = json.loads((a / "run.json").read_text())
    a_run["stages"]["hidden_states"]["key"] = key(3)
    write_run_record(a, a_run)
    (a / "config.yaml").unlink()
    assert all(i.folder.name != shared for i in survey(a).superseded)

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from eaglet import work_dir_lock; "
         f"work_dir_lock.acquire({str(b)!r}); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert work_dir_lock.is_held(b)
        eaglets_folder(a / "hidden_states" / key(4))  # unused, but B runs now
        found = survey(a)
        assert all(i.folder.parent.name != "hidden_states" for i in found.superseded)
        assert found.held and str(b.resolve()) in found.held[0]
    finally:
        holder.kill()
        holder.wait()
    assert not work_dir_lock.is_held(b)
    assert [i.folder.name for i in survey(a).superseded if "hidden" in str(i.folder)] == [key(4)]
    assert os.path.isdir(a / "hidden_states" / shared)
