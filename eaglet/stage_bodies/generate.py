"""The generate stage: prompts → append-only `generations.jsonl`.

HTTP engines first pass the canary (a handful of real requests, the reasoning split checked),
so a broken server setup fails in the first minute. Every record is flushed as it arrives; a
retry, a rerun after a crash or a cancelled run resumes the same partial folder and sends only
the prompts whose ids are not written yet. Failed samples are listed in a table artifact.
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

from eaglet.canary import run_canary
from eaglet.config import PipelineConfig
from eaglet.engines.registry import engine_spec, make_engine
from eaglet.generation import Failure, GenerationProgress, TooManyFailuresError, run_generation_sync
from eaglet.records.io import read_jsonl, sort_jsonl
from eaglet.records.prompts import Prompt, conversation_id
from eaglet.reuse import seed_generations
from eaglet.stage_context import StageContext, generation_api_key
from eaglet.stages import FAILED_FILE, GENERATIONS_FILE, PROMPTS_FILE
from eaglet.storage import Manifest, StageOutput, stage_dir
from eaglet.target import load_tokenizer
from eaglet.turns import generate_every_turn, turn_number


def _failed_samples_artifact(ctx: StageContext, failed_path: Path) -> None:
    if not failed_path.exists() or failed_path.stat().st_size == 0:
        return
    rows = [row.model_dump() for row in read_jsonl(failed_path, Failure)][:500]
    ctx.table("generate-failed-samples", rows, "samples the server refused; a rerun retries them")


def run(
    ctx: StageContext, config: PipelineConfig, inputs: dict[str, Manifest], folder: Path
) -> StageOutput:
    prompts_path = stage_dir(config.work_dir, inputs["prompts"]) / PROMPTS_FILE
    all_prompts = list(read_jsonl(prompts_path, Prompt))
    tokenizer = load_tokenizer(config.target)
    key = generation_api_key(config.generation.api_key_secret, ctx.secret)
    if engine_spec(config.generation.engine).needs_server:
        canary = run_canary(config, tokenizer, all_prompts, api_key=key)
        ctx.info(f"canary:\n{canary.render()}")
        canary.raise_if_failed()
    set_progress = ctx.progress("generate-progress", "generate: records written")

    def progress(update: GenerationProgress) -> None:
        ctx.info(f"generate {update.describe()}")
        set_progress(update.done / max(1, update.total), None)

    failed_path = folder / FAILED_FILE
    reused = 0
    if config.tokenize.regenerate != "all":  # turn by turn, each turn's prompt is new
        reused, sources = seed_generations(config, all_prompts, folder / GENERATIONS_FILE)
        if reused:
            ctx.info(
                f"generate: {reused} of {len(all_prompts)} records reused from "
                f"{', '.join(sources)} (same prompt ids, sampling, engine settings and code); "
                f"{len(all_prompts) - reused} to generate"
            )
    engine = make_engine(config, tokenizer, api_key=key)
    try:
        if config.tokenize.regenerate == "all":
            summary = generate_every_turn(config, engine, tokenizer, all_prompts, folder, progress)
        else:
            summary = run_generation_sync(
                engine,
                all_prompts,
                folder / GENERATIONS_FILE,
                failed_path,
                progress=progress,
                max_failure_fraction=config.generation.max_failure_fraction,
            )
    except TooManyFailuresError:
        _failed_samples_artifact(ctx, failed_path)
        raise
    # One order whatever was reused or finished first: the prompts', each conversation's
    # turns after it (an incremental run's file equals a fresh run's, byte for byte).
    position = {p.sample_id: i for i, p in enumerate(all_prompts)}

    def rank(sample_id: str) -> tuple[int, int]:
        return position.get(conversation_id(sample_id), len(position)), turn_number(sample_id)

    for name in (GENERATIONS_FILE, FAILED_FILE):
        sort_jsonl(folder / name, rank)
    _failed_samples_artifact(ctx, failed_path)
    return StageOutput(
        counts=_counts(folder),
        info={"engine": config.generation.engine, **summary.as_dict(), "reused": reused},
    )


def _counts(folder: Path) -> dict[str, int]:
    """The manifest's counts, read from the files as sealed (not this run's share of them:
    what was reused or written before a resume counts as in a fresh run)."""
    finish: Counter[str] = Counter()
    with open(folder / GENERATIONS_FILE, "rb") as handle:
        for line in handle:
            if line.strip():
                finish[json.loads(line)["finish_reason"]] += 1
    failed = folder / FAILED_FILE
    with open(failed, "rb") if failed.exists() else nullcontext([]) as handle:
        failures = sum(1 for line in handle if line.strip())
    return {
        "records": sum(finish.values()),
        "failed": failures,
        "truncated": finish["length"],
        "looped": finish["loop"],
    }
