"""The tokenize stage: samples → chat-templated `prompts.jsonl`."""

from __future__ import annotations

from pathlib import Path

from eaglet.config import PipelineConfig
from eaglet.prompt_rendering import context_length, write_prompts
from eaglet.stage_context import StageContext
from eaglet.stages import SAMPLES_FILE
from eaglet.storage import Manifest, StageOutput, stage_dir
from eaglet.target import load_config as load_target_config
from eaglet.target import load_tokenizer


def run(
    ctx: StageContext, config: PipelineConfig, inputs: dict[str, Manifest], folder: Path
) -> StageOutput:
    tokenizer = load_tokenizer(config.target)
    try:
        context = context_length(load_target_config(config.target))
    except (OSError, ValueError):  # no readable config.json: the tokenizer alone still works
        context = None
    counts, warning = write_prompts(
        stage_dir(config.work_dir, inputs["samples"]) / SAMPLES_FILE,
        folder,
        tokenizer,
        config.tokenize,
        context,
        config.generation,
    )
    if warning:
        ctx.warning(warning)
    return StageOutput(counts=counts, info={"context_length": context})
