"""Helpers of the tests that run the whole pipeline with `eaglet` (tests/test_pipeline.py,
test_stage_bodies.py) or without Prefect: a copy of the project whose code a test may edit, the
state each stage ended in (from the work dir's `run.json`), a small pipeline's settings and
every stage of it run in order (`run_every_stage`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eaglet.config import PipelineConfig, load_config
from eaglet.stage_bodies.every_stage import run_stage_without_prefect
from eaglet.stage_context import PlainContext
from eaglet.stages import STAGE_LIST, STAGES
from eaglet.storage import Manifest
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


def small_pipeline(work_dir: Path, target: Path, data: Path, *overrides: str) -> PipelineConfig:
    """Twelve samples (eight arith, four with tools), sampled at T 0.7, one epoch, two
    held-out prompts and no evaluation set: every stage in about ten seconds."""
    return load_config(
        None,
        [
            f"work_dir={work_dir}",
            f"target.model={target}",
            f"datasets=[{{source: arith, path: {data / 'arith.jsonl'}, limit: 8}}, "
            f"{{source: tools, path: {data / 'tools.jsonl'}, limit: 4}}]",
            "generation.max_tokens=48",
            "generation.temperature=0.7",
            "reasoning.min_capture_rate=0",
            "reasoning.max_truncation_rate=1",
            "train.epochs=1",
            "train.holdout_fraction=0.25",
            "evaluate.max_prompts=2",
            "evaluate.max_new_tokens=16",
            "evaluate.sets=[]",
            *overrides,
        ],
    )


def run_every_stage(config: PipelineConfig, until: str = STAGES[-1]) -> dict[str, Manifest]:
    """Every stage up to `until` in order, without Prefect; stage -> its manifest."""
    outputs: dict[str, Manifest] = {}
    manifests = {}
    for spec in STAGE_LIST[: STAGES.index(until) + 1]:
        inputs = {name: outputs[name] for name in spec.inputs(config)}
        manifest = run_stage_without_prefect(spec.name, config, inputs, PlainContext(print))
        outputs[spec.output] = manifests[spec.name] = manifest
    return manifests
