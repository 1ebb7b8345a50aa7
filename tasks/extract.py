"""The extract stage as a Prefect task: generations → `examples.jsonl` + `quality.json`.

Splits reasoning from answer on token ids, builds input ids and loss masks, reports quality
per source (as a file and as Prefect artifacts) and fails the run at the quality gate.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eaglet.config import PipelineConfig
from eaglet.extract import check_quality_gate, write_examples
from eaglet.reasoning import detect_format
from eaglet.run_report import percent
from eaglet.storage import StageOutput, stage_dir
from eaglet.target import end_token_ids, load_tokenizer
from tasks.caching import run_stage_task, stage_task


def _quality_markdown(report: dict) -> str:
    lines = [
        f"# Data quality ({report['reasoning_format']})",
        "",
        "| source | records | reasoning captured | thinking in content | truncated | "
        "reasoning share | p50 tokens | template mismatches | server text disagrees |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for source, f in report["per_source"].items():
        lines.append(
            f"| {source} | {f['records']} | {percent(f['reasoning_capture_rate'])} | "
            f"{f['thinking_in_content']} | {f['truncation_rate']:.1%} | "
            f"{f['reasoning_token_share']:.1%} | {f['sequence_tokens'].get('p50', 0):.0f} | "
            f"{f['template_mismatches']} ({f['prompt_template_mismatches']} in the prompt) | "
            f"{f['server_reasoning_disagreements']} |"
        )
    lines += [
        "",
        "Reasoning captured: of the records not truncated, those whose reasoning was split "
        "out and closed. A template mismatch: a turn the chat template renders otherwise than "
        "the ids trained on (in the prompt: the configured template did not make the prompt). "
        "Each template mismatch is in `template_mismatches.jsonl`; each disagreement between a "
        "server's text and the token split, with both texts, in `server_disagreements.jsonl`.",
    ]
    return "\n".join(lines)


@stage_task("extract")
def extract(
    config: PipelineConfig, generations: dict, prompts: dict, refresh: bool = False
) -> dict:
    logger = get_run_logger()

    def body(folder: Path) -> StageOutput:
        target = config.target
        tokenizer = load_tokenizer(target)
        reasoning_format = detect_format(
            tokenizer, config.reasoning.format, config.tokenize.chat_template_kwargs
        )
        report = write_examples(
            generations_path=stage_dir(config.work_dir, generations) / "generations.jsonl",
            prompts_paths=[
                stage_dir(config.work_dir, prompts) / "prompts.jsonl",
                # regenerate="all" only
                stage_dir(config.work_dir, generations) / "turn_prompts.jsonl",
            ],
            out_dir=folder,
            tokenizer=tokenizer,
            reasoning_format=reasoning_format,
            end_ids=set(end_token_ids(target, tokenizer)),
            chat_template_kwargs=config.tokenize.chat_template_kwargs,
        )
        create_markdown_artifact(
            _quality_markdown(report),
            key="data-quality",
            description="reasoning capture, truncation and template checks of the generations",
        )
        create_table_artifact(
            [
                {"source": s, **{k: v for k, v in f.items() if k != "sequence_tokens"}}
                for s, f in report["per_source"].items()
            ],
            key="data-quality-per-source",
            description="the data-quality figures of each dataset source",
        )
        logger.info(
            "reasoning format %s; capture rate %s, truncation %.1f%%",
            reasoning_format.name,
            percent(report["reasoning_capture_rate"]),
            100 * report["truncation_rate"],
        )
        check_quality_gate(report, reasoning_format.reasons, config.reasoning)
        return StageOutput(
            counts={"records": report["records"]},
            info={
                "target_model": str(Path(target.model).resolve())
                if Path(target.model).is_dir()
                else target.model,
                "quality": {
                    k: report[k]
                    for k in (
                        "reasoning_format",
                        "records",
                        "reasoning_capture_rate",
                        "truncation_rate",
                    )
                },
            },
        )

    return run_stage_task(
        "extract", config, {"generations": generations, "prompts": prompts}, body, refresh=refresh
    ).model_dump()
