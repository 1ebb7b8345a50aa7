"""The generate stage as a Prefect task (its work, the canary first for HTTP engines:
`eaglet.stage_bodies.generate`). A retry, a rerun after a crash or a cancelled flow run
resumes the same partial folder and sends only the prompts not written yet."""

from __future__ import annotations

from eaglet.config import PipelineConfig
from eaglet.stage_bodies import generate as generate_body
from eaglet.storage import Manifest
from eaglet_prefect.tasks.caching import run_stage_task, stage_task


def _has_failures(manifest: Manifest) -> bool:
    return manifest.counts.get("failed", 0) > 0


@stage_task("generate", retries=3, retry_delay_seconds=[10, 60, 300])  # resumes from its records
def generate(
    config: PipelineConfig, prompts: dict, refresh: bool = False, retry_failed: bool = False
) -> dict:
    """`retry_failed` reopens a complete stage folder and sends only the samples that failed
    (the flow bypasses the cache for it); `refresh` regenerates everything."""
    return run_stage_task(
        "generate",
        generate_body.run,
        config,
        {"prompts": prompts},
        refresh=refresh,
        reopen_if=_has_failures if retry_failed else None,
    )
