"""Shared fixtures: the fixture target model (built once per session) and the sample data.

Set EAGLET_TEST_FIXTURE_MODEL to a folder built by `eaglet fixture-model` to reuse it across
sessions while developing; CI builds it fresh.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def fixture_model_dir(tmp_path_factory) -> Path:
    reuse = os.environ.get("EAGLET_TEST_FIXTURE_MODEL")
    if reuse and (Path(reuse) / "config.json").exists():
        return Path(reuse)
    from eaglet.fixture.model import build_fixture_model

    return build_fixture_model(tmp_path_factory.mktemp("fixture") / "model", seed=0)


@pytest.fixture(scope="session")
def sample_data_dir(tmp_path_factory) -> Path:
    from eaglet.fixture.sample_data import write_sample_data

    folder = tmp_path_factory.mktemp("data")
    write_sample_data(folder, seed=0)
    return folder


def small_run_overrides(work_dir: Path, model_dir: Path, data_dir: Path) -> list[str]:
    """A pipeline small enough for a test: a few samples per source, one short epoch."""
    return [
        f"work_dir={work_dir}",
        f"target.model={model_dir}",
        f"datasets=[{{source: arith, path: {data_dir / 'arith.jsonl'}, limit: 16}}, "
        f"{{source: tools, path: {data_dir / 'tools.jsonl'}, limit: 8}}]",
        "generation.max_tokens=160",
        "reasoning.min_capture_rate=0.5",  # a handful of samples from a 2M-parameter model
        "train.epochs=1",
        "train.holdout_fraction=0.2",
        "evaluate.max_prompts=2",
        "evaluate.max_new_tokens=48",
    ]


def run_cli(args: list[str], cwd: Path = ROOT, env: dict | None = None, timeout: int = 1500):
    """Run `python -m eaglet.cli ARGS` in a fresh process, as a user would from a shell."""
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("PREFECT_HOME", str(cwd / ".prefect-home"))
    result = subprocess.run(
        [sys.executable, "-m", "eaglet.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result
