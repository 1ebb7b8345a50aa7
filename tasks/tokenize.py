"""The tokenize stage as a Prefect task: samples → chat-templated `prompts.jsonl`."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from eaglet.config import PipelineConfig
from eaglet.prompts import context_length, write_prompts
from eaglet.storage import StageOutput, stage_dir
from eaglet.target import load_config as load_target_config
from eaglet.target import load_tokenizer
from tasks.caching import run_stage_task, stage_task


@stage_task("tokenize")
def tokenize(config: PipelineConfig, samples: dict, refresh: bool = False) -> dict:
    logger = get_run_logger()

    def body(folder: Path) -> StageOutput:
        tokenizer = load_tokenizer(config.target)
        try:
            context = context_length(load_target_config(config.target))
        except (OSError, ValueError):  # no readable config.json: the tokenizer alone still works
            context = None
        counts, warning = write_prompts(
            stage_dir(config.work_dir, samples) / "samples.jsonl",
            folder,
            tokenizer,
            config.tokenize,
            context,
        )
        if warning:
            logger.warning(warning)
        return StageOutput(counts=counts, info={"context_length": context})

    return run_stage_task(
        "tokenize", config, {"samples": samples}, body, refresh=refresh
    ).model_dump()
