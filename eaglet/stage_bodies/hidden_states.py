"""The hidden_states stage: examples → safetensors feature shards (the shard-by-shard work is
`eaglet.hidden_states.stage`). With `execution.task_runner: dask` the shards were built by
mapped shard tasks first, and this only verifies them by size and indexes them."""

from __future__ import annotations

from pathlib import Path

from eaglet.config import PipelineConfig
from eaglet.hidden_states.stage import stage_body
from eaglet.stage_context import StageContext
from eaglet.stages import EXAMPLES_FILE
from eaglet.storage import Manifest, StageOutput, stage_dir


def run(
    ctx: StageContext, config: PipelineConfig, inputs: dict[str, Manifest], folder: Path
) -> StageOutput:
    set_progress = ctx.progress("hidden-states-progress", "hidden_states: tokens done")
    mapped = config.execution.task_runner == "dask"  # shard tasks verified or built each shard
    body = stage_body(
        config,
        stage_dir(config.work_dir, inputs["examples"]) / EXAMPLES_FILE,
        ctx.info,
        lambda fraction: set_progress(fraction, None),
        verify_hash=not mapped,
    )
    return body(folder)
