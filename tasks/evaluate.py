"""The evaluate stage as a Prefect task: held-out prompts → acceptance length τ of the draft,
beside an untrained draft's τ, as `report.json`, a PNG plot and Prefect artifacts."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eaglet.config import PipelineConfig
from eaglet.draft.evaluate import evaluate_draft, plot_acceptance
from eaglet.records.io import read_jsonl
from eaglet.records.prompts import Prompt
from eaglet.split import is_heldout
from eaglet.storage import StageOutput, stage_dir, write_json_atomic
from eaglet.target import end_token_ids, load_tokenizer
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
        tokenizer = load_tokenizer(config.target)
        common = dict(
            target_model_dir=Path(config.target.model),
            prompts=heldout,
            num_speculative_tokens=settings.num_speculative_tokens,
            max_new_tokens=settings.max_new_tokens,
            eos_token_ids=end_token_ids(config.target, tokenizer),
            aux_layer_ids=draft["info"]["aux_layer_ids"],
        )
        draft_dir = stage_dir(config.work_dir, draft) / "draft"
        trained = evaluate_draft(draft_dir, **common, untrained_seed=0)
        baseline = trained.pop("untrained")
        report = {
            "draft": trained,
            "untrained": baseline,
            "prompts": len(heldout),
            "tau": trained["tau"],
            "untrained_tau": baseline["tau"],
        }
        write_json_atomic(folder / "report.json", report)
        plot_acceptance(trained, folder / "acceptance.png")
        logger.info(
            "acceptance length tau %.3f (untrained draft %.3f) on %d held-out prompts",
            trained["tau"],
            baseline["tau"],
            len(heldout),
        )
        create_markdown_artifact(
            f"# Draft evaluation\n\nτ = **{trained['tau']:.3f}** (untrained draft "
            f"{baseline['tau']:.3f}) over {len(heldout)} held-out prompts, "
            f"k = {settings.num_speculative_tokens}.\n\nPlot: `{folder.parent / folder.name}`",
            key="draft-evaluation",
        )
        create_table_artifact(
            [
                {"position": i + 1, "acceptance": a}
                for i, a in enumerate(trained.get("per_position_acceptance", []))
            ],
            key="acceptance-per-position",
        )
        return StageOutput(
            counts={"records": len(heldout)},
            info={"tau": trained["tau"], "untrained_tau": baseline["tau"]},
        )

    return run_stage_task(
        "evaluate", config, {"draft": draft, "prompts": prompts}, body, refresh=refresh
    ).model_dump()
