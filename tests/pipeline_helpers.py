"""Helpers of the tests that run the whole pipeline with `eaglet` (tests/test_pipeline.py,
test_stage_bodies.py): a copy of the project whose code a test may edit, and the state each
stage ended in, read from the work dir's `run.json`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import ROOT


def stage_states(work_dir: Path) -> dict[str, str]:
    """stage -> its state in the last run of `work_dir` (from `run.json`)."""
    run = json.loads((work_dir / "run.json").read_text())
    return {stage: figures["state"] for stage, figures in run["stages"].items()}


def copy_project(destination: Path) -> Path:
    """A copy of the project's code in `destination`, for a test that edits it: its
    eaglet_prefect links kept (`symlinks=True`), so eaglet_prefect.tasks is the copy's tasks/
    (copied as folders, an edit to `tasks/` would not be what runs)."""
    for part in ("eaglet", "eaglet_prefect", "tasks", "flows", "deployments"):
        shutil.copytree(
            ROOT / part,
            destination / part,
            symlinks=True,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    return destination
