"""`eaglet gc WORK_DIR`: lists the stage folders the last run did not use, removes them only
with --yes, and keeps the last run's folders and the partial folder it would resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli


def work_dir_with_history(root: Path) -> Path:
    work = root / "work"
    for path in (
        "extract/old1", "extract/new1", "extract/new1.partial", "extract/old2.partial",
        "extract/new1.replaced-17", "generate/g1", "train/t2.partial",
    ):  # fmt: skip
        (work / path).mkdir(parents=True)
        (work / path / "data.bin").write_bytes(b"x" * 1000)
    run = {"stages": {"extract": {"key": "new1"}, "generate": {"key": "g1"},
                      "train": {"key": "t2", "state": "Failed"}}}  # fmt: skip
    (work / "run.json").write_text(json.dumps(run))
    return work


@pytest.mark.slow  # seconds of subprocess or timeouts: outside the fast suite
def test_gc_lists_first_and_removes_only_with_yes(tmp_path):
    work = work_dir_with_history(tmp_path)
    listed = run_cli(["gc", str(work)], cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    names = sorted(line.split()[-1] for line in listed.stdout.splitlines() if line.startswith("  "))
    assert names == ["extract/new1.replaced-17", "extract/old1", "extract/old2.partial"]
    assert "3 folders" in listed.stdout and "--yes" in listed.stdout
    assert (work / "extract" / "old1").is_dir()  # nothing removed yet

    removed = run_cli(["gc", str(work), "--yes"], cwd=tmp_path)
    assert removed.returncode == 0, removed.stderr
    assert "removed 3 folders" in removed.stdout
    left = sorted(str(p.relative_to(work)) for p in work.glob("*/*"))
    assert left == ["extract/new1", "extract/new1.partial", "generate/g1", "train/t2.partial"]


def test_gc_without_a_run_record_removes_nothing(tmp_path):
    work = work_dir_with_history(tmp_path)
    (work / "run.json").unlink()
    refused = run_cli(["gc", str(work), "--yes"], cwd=tmp_path)
    assert refused.returncode == 2 and "no run.json" in refused.stderr
    assert (work / "extract" / "old1").is_dir()
