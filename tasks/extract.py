"""The extract stage as a Prefect task (its work: `extract_body.run`); it fails
the run at the quality gate."""

from __future__ import annotations

from eaglet.config import PipelineConfig
from eaglet.stage_bodies import extract as extract_body
from eaglet_prefect.tasks.caching import run_stage_task, stage_task


@stage_task("extract")
def extract(
    config: PipelineConfig, generations: dict, prompts: dict, refresh: bool = False
) -> dict:
    inputs = {"generations": generations, "prompts": prompts}
    return run_stage_task("extract", extract_body.run, config, inputs, refresh=refresh)
