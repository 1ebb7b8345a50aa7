"""The tokenize stage as a Prefect task: samples → chat-templated `prompts.jsonl`."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task

from eaglet.config import PipelineConfig
from eaglet.prompts import PromptError, load_tokenizer, render_prompt
from eaglet.records.io import read_jsonl, record_line
from eaglet.records.samples import Sample
from eaglet.storage import StageOutput
from tasks.caching import StageCache, report_stage_failure, run_stage_task


@task(
    name="tokenize",
    task_run_name="tokenize[{config.name}]",
    cache_policy=StageCache(stage="tokenize"),
    on_failure=[report_stage_failure],  # says what the partial folder holds, how to resume
    persist_result=True,
    result_serializer="json",
)
def tokenize(config: PipelineConfig, samples: dict, refresh: bool = False) -> dict:
    logger = get_run_logger()

    def body(folder: Path) -> StageOutput:
        target = config.target
        tokenizer = load_tokenizer(target.model, target.trust_remote_code, target.revision)
        kept = rejected = too_long = 0
        with (
            open(folder / "prompts.jsonl", "w", encoding="utf-8") as out,
            open(folder / "rejected.jsonl", "w", encoding="utf-8") as rejects,
        ):
            for sample in read_jsonl(Path(samples["path"]) / "samples.jsonl", Sample):
                try:
                    prompt = render_prompt(
                        sample,
                        tokenizer,
                        config.tokenize.chat_template_kwargs,
                        config.tokenize.regenerate,
                    )
                except PromptError as exc:
                    rejected += 1
                    rejects.write(json.dumps({"sample_id": sample.sample_id, "why": str(exc)}))
                    rejects.write("\n")
                    continue
                if len(prompt.prompt_ids) > config.tokenize.max_prompt_tokens:
                    too_long += 1
                    rejects.write(json.dumps({"sample_id": sample.sample_id, "why": "too long"}))
                    rejects.write("\n")
                    continue
                out.write(record_line(prompt))
                kept += 1
        if rejected or too_long:
            logger.warning(
                "%d samples could not be templated and %d were over %d prompt tokens; "
                "their ids and reasons are in rejected.jsonl",
                rejected,
                too_long,
                config.tokenize.max_prompt_tokens,
            )
        return StageOutput(
            counts={"records": kept, "rejected": rejected, "too_long": too_long}, info={}
        )

    return run_stage_task(
        "tokenize", config, {"samples": samples}, body, refresh=refresh
    ).model_dump()
