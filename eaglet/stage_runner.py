"""Run one stage's body (`eaglet/stage_bodies/<stage>.py`) into its folder
`WORK_DIR/<stage>/<key>/`, or reuse the folder when it is complete: the same call under a
Prefect task (`tasks/caching.py`, handed the body its task module imports) and without one
(`eaglet.stage_bodies.every_stage`: tests, benchmarks, scripts)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from eaglet.cache import code_hash, code_modules, stage_config, stage_key
from eaglet.config import PipelineConfig
from eaglet.stage_context import StageContext
from eaglet.stage_reasons import why_it_runs
from eaglet.stages import STAGE, StageBody
from eaglet.storage import Manifest, run_stage


def run_stage_body(
    stage: str,
    body: StageBody,
    config: PipelineConfig,
    inputs: dict[str, Manifest],
    context: StageContext,
    refresh: bool = False,
    reopen_if: Callable[[Manifest], bool] | None = None,
) -> Manifest:
    """`inputs`: the manifests of the earlier stages' outputs it reads, by output name. The
    body must be code the stage's key covers (its task module imports it), or a fix to it
    would never re-run the stage: one that is not is refused before anything runs."""
    spec = STAGE[stage]
    upstream = list(inputs.values())
    modules = code_modules(stage, config)
    if body.__module__ not in modules:
        raise ValueError(
            f"stage {stage}: its body {body.__module__}.{body.__qualname__} is not part of "
            f"the stage's code key (the import closure of its task module, tasks/{stage}.py); "
            "import the body there"
        )
    why = why_it_runs(stage, config, upstream, refresh, modules)
    if why:
        context.info(f"{stage} runs: {'; '.join(why)}")
    return run_stage(
        work_dir=Path(config.work_dir),
        stage=stage,
        key=stage_key(stage, config, upstream),
        code_hash=code_hash(stage, config),
        config=stage_config(stage, config),
        upstream=upstream,
        body=lambda folder: body(context, config, inputs, folder),
        resume_partial=spec.resumes,
        refresh=refresh,
        reopen_if=reopen_if,
        records_file=spec.records_file,
        code_modules=modules,
        why=why,
        warn=context.warning,
        read_later=spec.read_later,
    )
