"""The download stage: datasets → `samples.jsonl` (one row per unique id); skipped and duplicate
rows counted in the manifest and listed with why in `rejected.jsonl`."""

from __future__ import annotations

from pathlib import Path

from eaglet.config import PipelineConfig
from eaglet.datasets import write_samples
from eaglet.stage_context import StageContext
from eaglet.stages import REJECTED_FILE, SAMPLES_FILE
from eaglet.storage import Manifest, StageOutput


def run(
    ctx: StageContext, config: PipelineConfig, inputs: dict[str, Manifest], folder: Path
) -> StageOutput:
    counts, info = write_samples(
        config.datasets, folder / SAMPLES_FILE, folder / REJECTED_FILE, ctx.info
    )
    return StageOutput(counts=counts, info=info)
