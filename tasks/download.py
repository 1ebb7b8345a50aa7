"""The download stage as a Prefect task (its work: `download_body.run`)."""

from __future__ import annotations

from eaglet.config import PipelineConfig
from eaglet.stage_bodies import download as download_body
from eaglet_prefect.tasks.caching import run_stage_task, stage_task


@stage_task("download", retries=2, retry_delay_seconds=[5, 30])  # hub downloads fail transiently
def download(config: PipelineConfig, refresh: bool = False) -> dict:
    return run_stage_task("download", download_body.run, config, {}, refresh=refresh)
