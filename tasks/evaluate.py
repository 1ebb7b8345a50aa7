"""The evaluate stage as a Prefect task (its work: `evaluate_body.run`)."""

from __future__ import annotations

from eaglet.config import PipelineConfig
from eaglet.stage_bodies import evaluate as evaluate_body
from eaglet_prefect.tasks.caching import run_stage_task, stage_task


@stage_task("evaluate")
def evaluate(config: PipelineConfig, draft: dict, prompts: dict, refresh: bool = False) -> dict:
    return run_stage_task(
        "evaluate", evaluate_body.run, config, {"draft": draft, "prompts": prompts}, refresh=refresh
    )
