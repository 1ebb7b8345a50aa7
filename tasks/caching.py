"""The one cache policy of every stage task, and the call that runs a stage into its folder.

Prefect's cache key for a stage task is the stage key of `eaglet.cache` (config subset +
upstream manifest hashes + code hash of the stage's modules), so Prefect reports a stage as
Cached exactly when its folder would be reused. The key also names the stage folder, and the
Prefect record sits inside the work dir: deleting a work dir clears its cache too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy

from eaglet.cache import code_hash, stage_config, stage_key
from eaglet.config import PipelineConfig
from eaglet.storage import Manifest, StageOutput, read_manifest, run_stage, stage_folder

UPSTREAM: dict[str, tuple[str, ...]] = {
    "download": (),
    "tokenize": ("samples",),
    "generate": ("prompts",),
    "extract": ("generations", "prompts"),
    "hidden_states": ("examples",),
    "train": ("features",),
    "evaluate": ("draft", "prompts"),
}


def upstream_manifests(stage: str, inputs: dict[str, Any]) -> list[Manifest]:
    return [Manifest.model_validate(inputs[name]) for name in UPSTREAM[stage]]


@dataclass
class StageCache(CachePolicy):
    """Cache key = the stage key; a key whose folder is gone is never reported as Cached."""

    stage: str = ""

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str | None:
        config = PipelineConfig.model_validate(inputs["config"])
        key = stage_key(self.stage, config, upstream_manifests(self.stage, inputs))
        name = f"{self.stage}-{key}"
        # A record whose stage folder was deleted would hand back a manifest of missing files:
        # drop it so Prefect runs the task again.
        if read_manifest(stage_folder(Path(config.work_dir), self.stage, key)) is None:
            (result_storage_path(config) / name).unlink(missing_ok=True)
        return name


def result_storage_path(config: PipelineConfig) -> Path:
    path = Path(config.work_dir).resolve() / ".prefect-results"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_stage_task(
    stage: str,
    config: PipelineConfig,
    inputs: dict[str, Any],
    body: Callable[[Path], StageOutput],
    resume_partial: bool = False,
    refresh: bool = False,
) -> Manifest:
    """Run one stage into `WORK_DIR/<stage>/<key>/` (or reuse it) and return its manifest."""
    upstream = upstream_manifests(stage, inputs)
    return run_stage(
        work_dir=Path(config.work_dir),
        stage=stage,
        key=stage_key(stage, config, upstream),
        code_hash=code_hash(stage, config),
        config=stage_config(stage, config),
        upstream=upstream,
        body=body,
        resume_partial=resume_partial,
        refresh=refresh,
    )
