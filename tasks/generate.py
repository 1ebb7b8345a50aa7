"""The generate stage as a Prefect task: prompts → append-only `generations.jsonl`.

Every record is flushed as it arrives; a rerun after a crash or a cancel resumes the same
partial folder and sends only the prompts whose ids are not written yet.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from eaglet.config import PipelineConfig
from eaglet.engines import make_engine
from eaglet.records import Generation, Prompt, read_jsonl, record_line, repair_and_read_ids
from eaglet.storage import StageOutput
from tasks.caching import StageCache, run_stage_task


@task(
    name="generate",
    task_run_name="generate[{config.name}]",
    cache_policy=StageCache(stage="generate"),
    persist_result=True,
    result_serializer="json",
    retries=3,  # a retry resumes from the records already on disk
    retry_delay_seconds=[10, 60, 300],
)
def generate(config: PipelineConfig, prompts: dict, refresh: bool = False) -> dict:
    logger = get_run_logger()

    def body(folder: Path) -> StageOutput:
        out_path = folder / "generations.jsonl"
        done = repair_and_read_ids(out_path)
        todo = [
            p
            for p in read_jsonl(Path(prompts["path"]) / "prompts.jsonl", Prompt)
            if p.sample_id not in done
        ]
        total = len(done) + len(todo)
        logger.info("%d of %d prompts already generated; %d to go", len(done), total, len(todo))
        progress_id = create_progress_artifact(
            progress=100.0 * len(done) / max(1, total), description="generate: records written"
        )
        engine = make_engine(config) if todo else None
        started, written, output_tokens, last_report = time.time(), 0, 0, 0.0
        with open(out_path, "a", encoding="utf-8") as out:
            for record in engine.generate(todo) if engine else []:
                out.write(record_line(record))
                out.flush()
                written += 1
                output_tokens += len(record.output_ids)
                now = time.time()
                if now - last_report > 5 or written == len(todo):
                    last_report = now
                    elapsed = max(now - started, 1e-9)
                    rate = written / elapsed
                    logger.info(
                        "generate %d/%d: %.2f req/s, %.0f output tok/s, ETA %.0f s",
                        len(done) + written,
                        total,
                        rate,
                        output_tokens / elapsed,
                        (len(todo) - written) / max(rate, 1e-9),
                    )
                    update_progress_artifact(
                        progress_id, progress=100.0 * (len(done) + written) / max(1, total)
                    )
        finish: dict[str, int] = {}
        for record in read_jsonl(out_path, Generation):
            finish[record.finish_reason] = finish.get(record.finish_reason, 0) + 1
        return StageOutput(
            counts={"records": sum(finish.values()), "truncated": finish.get("length", 0)},
            info={
                "finish_reasons": finish,
                "engine": config.generation.engine,
                "resumed_from": len(done),
            },
        )

    return run_stage_task(
        "generate", config, {"prompts": prompts}, body, resume_partial=True, refresh=refresh
    ).model_dump()
