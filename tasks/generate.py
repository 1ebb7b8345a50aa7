"""The generate stage as a Prefect task: prompts → append-only `generations.jsonl`.

HTTP engines first pass the canary (a handful of real requests, the reasoning split checked),
so a broken server setup fails in the first minute. Every record is flushed as it arrives; a
retry, a rerun after a crash or a cancelled flow run resumes the same partial folder and sends
only the prompts whose ids are not written yet. Failed samples are listed in a table artifact.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.exceptions import ObjectNotFound

from eaglet.canary import run_canary
from eaglet.config import PipelineConfig
from eaglet.engines.registry import engine_spec, make_engine
from eaglet.generation import (
    Failure,
    GenerationProgress,
    TooManyFailuresError,
    run_generation_sync,
)
from eaglet.records.io import read_jsonl
from eaglet.records.prompts import Prompt
from eaglet.storage import Manifest, StageOutput, stage_dir
from eaglet.target import load_tokenizer
from eaglet.turns import generate_every_turn
from tasks.caching import run_stage_task, stage_task


def _failed_samples_artifact(failed_path: Path) -> None:
    if not failed_path.exists() or failed_path.stat().st_size == 0:
        return
    rows = [row.model_dump() for row in read_jsonl(failed_path, Failure)][:500]
    create_table_artifact(
        rows,
        key="generate-failed-samples",
        description="samples the server refused; a rerun retries them",
    )


def secret_api_key(config: PipelineConfig) -> str | None:
    """The API key held by the Prefect Secret block `generation.api_key_secret`, if named."""
    name = config.generation.api_key_secret
    if not name:
        return None
    from prefect.blocks.system import Secret

    try:
        return str(Secret.load(name).get())
    except (ValueError, ObjectNotFound) as exc:
        raise ValueError(
            f"generation.api_key_secret={name!r}: no Prefect Secret block of that name on this "
            f"Prefect server; create it (UI: Blocks > Secret, or "
            f"`Secret(value=...).save({name!r})`) or use generation.api_key_env"
        ) from exc


def _has_failures(manifest: Manifest) -> bool:
    return manifest.counts.get("failed", 0) > 0


@stage_task("generate", retries=3, retry_delay_seconds=[10, 60, 300])  # resumes from its records
def generate(
    config: PipelineConfig, prompts: dict, refresh: bool = False, retry_failed: bool = False
) -> dict:
    """`retry_failed` reopens a complete stage folder and sends only the samples that failed
    (the flow bypasses the cache for it); `refresh` regenerates everything."""
    logger = get_run_logger()

    def body(folder: Path) -> StageOutput:
        prompts_path = stage_dir(config.work_dir, prompts) / "prompts.jsonl"
        all_prompts = list(read_jsonl(prompts_path, Prompt))
        tokenizer = load_tokenizer(config.target)
        api_key = secret_api_key(config)
        if engine_spec(config.generation.engine).needs_server:
            canary = run_canary(config, tokenizer, all_prompts, api_key=api_key)
            logger.info("canary:\n%s", canary.render())
            canary.raise_if_failed()
        progress_id = create_progress_artifact(
            0.0, key="generate-progress", description="generate: records written"
        )

        def progress(update: GenerationProgress) -> None:
            logger.info("generate %s", update.describe())
            update_progress_artifact(progress_id, 100.0 * update.done / max(1, update.total))

        failed_path = folder / "failed.jsonl"
        engine = make_engine(config, tokenizer, api_key=api_key)
        try:
            if config.tokenize.regenerate == "all":
                summary = generate_every_turn(
                    config, engine, tokenizer, all_prompts, folder, progress
                )
            else:
                summary = run_generation_sync(
                    engine,
                    all_prompts,
                    folder / "generations.jsonl",
                    failed_path,
                    progress=progress,
                    max_failure_fraction=config.generation.max_failure_fraction,
                )
        except TooManyFailuresError:
            _failed_samples_artifact(failed_path)
            raise
        _failed_samples_artifact(failed_path)
        figures = summary.as_dict()
        return StageOutput(
            counts={
                "records": figures["written"] + figures["already_done"],
                "failed": figures["failed"],
                "truncated": figures["finish_reasons"].get("length", 0),
            },
            info={"engine": config.generation.engine, **figures},
        )

    return run_stage_task(
        "generate",
        config,
        {"prompts": prompts},
        body,
        resume_partial=True,
        refresh=refresh,
        reopen_if=_has_failures if retry_failed else None,
    ).model_dump()
