"""The download stage as a Prefect task (its work: `eaglet.stage_bodies.download`)."""

from __future__ import annotations

from eaglet.config import PipelineConfig
from eaglet_prefect.tasks.caching import run_stage_task, stage_task


@stage_task("download", retries=2, retry_delay_seconds=[5, 30])  # hub downloads fail transiently
def download(config: PipelineConfig, refresh: bool = False) -> dict:
    return run_stage_task("download", config, {}, refresh=refresh)
