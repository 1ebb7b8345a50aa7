"""The download stage as a Prefect task: datasets → `samples.jsonl` (one row per unique id)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from eaglet.config import PipelineConfig
from eaglet.datasets import write_samples
from eaglet.storage import StageOutput
from tasks.caching import run_stage_task, stage_task


@stage_task("download", retries=2, retry_delay_seconds=[5, 30])  # hub downloads fail transiently
def download(config: PipelineConfig, refresh: bool = False) -> dict:
    logger = get_run_logger()

    def body(folder: Path) -> StageOutput:
        # Skipped and duplicate rows: counted in the manifest, listed with why in rejected.jsonl.
        counts, info = write_samples(
            config.datasets, folder / "samples.jsonl", folder / "rejected.jsonl", logger.info
        )
        return StageOutput(counts=counts, info=info)

    return run_stage_task("download", config, {}, body, refresh=refresh).model_dump()
