"""The evaluate stage as a Prefect task: held-out prompts → acceptance length τ of the draft,
beside an untrained draft's τ (and, with evaluate.serving=vllm, τ served by vLLM), as
`report.json`, a PNG plot and Prefect artifacts."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eaglet.config import PipelineConfig
from eaglet.draft.evaluate import evaluation_report
from eaglet.progress import Throttle
from eaglet.records.io import read_jsonl
from eaglet.records.prompts import Prompt
from eaglet.split import is_heldout
from eaglet.storage import StageOutput, stage_dir
from eaglet.target import end_token_ids, load_tokenizer
from tasks.artifacts import final_path, publish_plot
from tasks.caching import run_stage_task, stage_task


@stage_task("evaluate")
def evaluate(config: PipelineConfig, draft: dict, prompts: dict, refresh: bool = False) -> dict:
    logger = get_run_logger()

    def body(folder: Path) -> StageOutput:
        settings = config.evaluate
        fraction = config.train.holdout_fraction
        heldout = [
            p.prompt_ids
            for p in read_jsonl(stage_dir(config.work_dir, prompts) / "prompts.jsonl", Prompt)
            if is_heldout(p.sample_id, fraction)
        ][: settings.max_prompts]
        if not heldout:
            raise ValueError(
                f"no held-out prompts: train.holdout_fraction={fraction} left none of "
                f"{prompts['counts']['records']} prompts for evaluation; raise it"
            )
        draft_dir = stage_dir(config.work_dir, draft) / "draft"  # the vLLM export
        eos = end_token_ids(config.target, load_tokenizer(config.target))
        # layer ids from the draft's own config: what a server reads
        throttle = Throttle()

        def progress(update: dict) -> None:
            if throttle.ready(force=update["done"] == update["total"]):
                logger.info(
                    "evaluate %d/%d prompt passes (%s), %.2f prompts/s, ETA %s",
                    update["done"],
                    update["total"],
                    update["pass"],
                    update["done"] / max(update["elapsed_s"], 1e-9),
                    timedelta(seconds=round(update["eta_s"])),
                )

        report = evaluation_report(
            settings, config.target, draft_dir, heldout, eos, None, folder, progress
        )
        trained, baseline = report["draft"], report["untrained"]
        served = report.get("served")
        line = (
            f"acceptance length tau {trained['tau']:.3f} (untrained draft {baseline['tau']:.3f}; "
            f"{trained['emitted_tau']:.3f} output tokens per round) on {len(heldout)} held-out "
            f"prompts, k = {settings.num_speculative_tokens}"
        )
        if served is not None:
            line += f"; served by vLLM: tau {served['tau']:.3f} (gap {report['serving_gap']:.3f})"
        logger.info("%s", line)
        by_k = ", ".join(f"k={k}: {tau:.3f}" for k, tau in report["tau_by_k"].items())
        create_markdown_artifact(
            f"# Draft evaluation\n\n{line}.\n\nOffline tau by k: {by_k}.\n\n"
            f"Report: `{final_path(folder / 'report.json')}`",
            key="draft-evaluation",
            description="acceptance length tau of the trained draft against an untrained one",
        )
        create_table_artifact(
            [
                {"position": i + 1, "acceptance": a}
                for i, a in enumerate(trained.get("per_position_acceptance", []))
            ],
            key="acceptance-per-position",
            description="the share of drafted tokens accepted at each speculative position",
        )
        publish_plot(
            folder / "acceptance.png",
            key="acceptance-plot",
            description="acceptance per speculative position, trained and untrained draft",
        )
        return StageOutput(
            counts={"records": len(heldout)},
            info={
                "tau": trained["tau"],
                "emitted_tau": trained["emitted_tau"],
                "untrained_tau": baseline["tau"],
                **({"served_tau": served["tau"]} if served is not None else {}),
            },
        )

    return run_stage_task(
        "evaluate", config, {"draft": draft, "prompts": prompts}, body, refresh=refresh
    ).model_dump()
