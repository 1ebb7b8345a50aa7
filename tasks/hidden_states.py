"""The hidden_states stage as a Prefect task: examples → safetensors feature shards."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from eaglet.config import PipelineConfig
from eaglet.hidden_states.hf import extract_hidden_states
from eaglet.records.examples import Example
from eaglet.records.io import read_jsonl
from eaglet.storage import StageOutput
from tasks.caching import StageCache, report_stage_failure, run_stage_task


@task(
    name="hidden_states",
    task_run_name="hidden_states[{config.name}]",
    cache_policy=StageCache(stage="hidden_states"),
    on_failure=[report_stage_failure],  # says what the partial folder holds, how to resume
    persist_result=True,
    result_serializer="json",
    retries=1,  # a killed worker: the partial folder is rebuilt from scratch
)
def hidden_states(config: PipelineConfig, examples: dict, refresh: bool = False) -> dict:
    logger = get_run_logger()

    last_report = [0.0]

    def progress(done: int, total: int, elapsed: float) -> None:
        if elapsed - last_report[0] < 5 and done < total:
            return
        last_report[0] = elapsed
        rate = done / max(elapsed, 1e-9)
        logger.info(
            "hidden states %d/%d samples, %.1f samples/s, ETA %.0f s",
            done,
            total,
            rate,
            (total - done) / max(rate, 1e-9),
        )

    def body(folder: Path) -> StageOutput:
        settings = config.hidden_states
        info = extract_hidden_states(
            read_jsonl(Path(examples["path"]) / "examples.jsonl", Example),
            model_dir=config.target.model,
            out_dir=folder,
            aux_layer_ids=settings.aux_layer_ids,
            shard_tokens=settings.shard_tokens,
            batch_size=settings.batch_size,
            store_dtype=settings.dtype,
            model_dtype=config.target.dtype,
            trust_remote_code=config.target.trust_remote_code,
            progress=progress,
        )
        return StageOutput(counts={"records": info["samples"], "tokens": info["tokens"]}, info=info)

    return run_stage_task(
        "hidden_states", config, {"examples": examples}, body, refresh=refresh
    ).model_dump()
