"""The download stage as a Prefect task: datasets → `samples.jsonl` (one row per unique id)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from eaglet.config import PipelineConfig
from eaglet.datasets import read_samples
from eaglet.records.io import record_line
from eaglet.storage import StageOutput
from tasks.caching import StageCache, report_stage_failure, run_stage_task


@task(
    name="download",
    task_run_name="download[{config.name}]",
    cache_policy=StageCache(stage="download"),
    on_failure=[report_stage_failure],  # says what the partial folder holds, how to resume
    persist_result=True,
    result_serializer="json",
    retries=2,  # hub downloads fail transiently
    retry_delay_seconds=[5, 30],
)
def download(config: PipelineConfig, refresh: bool = False) -> dict:
    logger = get_run_logger()

    def body(folder: Path) -> StageOutput:
        seen: set[str] = set()
        per_source: dict[str, int] = {}
        duplicates = 0
        with open(folder / "samples.jsonl", "w", encoding="utf-8") as out:
            for spec in config.datasets:
                for sample in read_samples(spec):
                    if sample.sample_id in seen:
                        duplicates += 1
                        continue
                    seen.add(sample.sample_id)
                    per_source[sample.source] = per_source.get(sample.source, 0) + 1
                    out.write(record_line(sample))
                logger.info(
                    "read %d samples from %s (%s)",
                    per_source.get(spec.source, 0),
                    spec.path,
                    spec.source,
                )
        return StageOutput(
            counts={"records": len(seen), "duplicates": duplicates},
            info={"per_source": per_source},
        )

    return run_stage_task("download", config, {}, body, refresh=refresh).model_dump()
