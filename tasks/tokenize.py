"""The tokenize stage as a Prefect task (its work: `tokenize_body.run`)."""

from __future__ import annotations

from eaglet.config import PipelineConfig
from eaglet.stage_bodies import tokenize as tokenize_body
from eaglet_prefect.tasks.caching import run_stage_task, stage_task


@stage_task("tokenize")
def tokenize(config: PipelineConfig, samples: dict, refresh: bool = False) -> dict:
    return run_stage_task(
        "tokenize", tokenize_body.run, config, {"samples": samples}, refresh=refresh
    )
