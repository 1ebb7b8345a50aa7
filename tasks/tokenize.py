"""The tokenize stage as a Prefect task (its work: `eaglet.stage_bodies.tokenize`)."""

from __future__ import annotations

from eaglet.config import PipelineConfig
from eaglet_prefect.tasks.caching import run_stage_task, stage_task


@stage_task("tokenize")
def tokenize(config: PipelineConfig, samples: dict, refresh: bool = False) -> dict:
    return run_stage_task("tokenize", config, {"samples": samples}, refresh=refresh)
