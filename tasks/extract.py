"""The extract stage as a Prefect task (its work: `eaglet.stage_bodies.extract`); it fails
the run at the quality gate."""

from __future__ import annotations

from eaglet.config import PipelineConfig
from eaglet_prefect.tasks.caching import run_stage_task, stage_task


@stage_task("extract")
def extract(
    config: PipelineConfig, generations: dict, prompts: dict, refresh: bool = False
) -> dict:
    inputs = {"generations": generations, "prompts": prompts}
    return run_stage_task("extract", config, inputs, refresh=refresh)
