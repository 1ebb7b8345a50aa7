"""The extract stage as a Prefect task: generations → `examples.jsonl` + `quality.json`.

Splits reasoning from answer on token ids, builds input ids and loss masks, reports quality
per source (as a file and as Prefect artifacts) and fails the run at the quality gate.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eaglet.config import PipelineConfig
from eaglet.extract import build_example, check_quality_gate, quality_report
from eaglet.prompts import end_token_ids, load_tokenizer
from eaglet.reasoning import detect_format
from eaglet.records import Generation, read_jsonl, record_line
from eaglet.storage import StageOutput, write_json_atomic
from tasks.caching import StageCache, run_stage_task


def _quality_markdown(report: dict) -> str:
    lines = [
        f"# Data quality ({report['reasoning_format']})",
        "",
        "| source | records | reasoning captured | thinking in content | truncated | "
        "reasoning share | p50 tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for source, f in report["per_source"].items():
        lines.append(
            f"| {source} | {f['records']} | {f['reasoning_capture_rate']:.1%} | "
            f"{f['thinking_in_content']} | {f['truncation_rate']:.1%} | "
            f"{f['reasoning_token_share']:.1%} | {f['sequence_tokens'].get('p50', 0):.0f} |"
        )
    return "\n".join(lines)


@task(
    name="extract",
    cache_policy=StageCache(stage="extract"),
    persist_result=True,
    result_serializer="json",
)
def extract(config: PipelineConfig, generations: dict, refresh: bool = False) -> dict:
    logger = get_run_logger()

    def body(folder: Path) -> StageOutput:
        target = config.target
        tokenizer = load_tokenizer(target.model, target.trust_remote_code, target.revision)
        reasoning_format = detect_format(
            tokenizer, config.reasoning.format, config.tokenize.chat_template_kwargs
        )
        end_ids = set(end_token_ids(target.model, tokenizer, target.revision))
        examples, reasoning_tokens = [], {}
        with open(folder / "examples.jsonl", "w", encoding="utf-8") as out:
            for generation in read_jsonl(
                Path(generations["path"]) / "generations.jsonl", Generation
            ):
                example = build_example(generation, tokenizer, reasoning_format, end_ids)
                split = reasoning_format.split(generation.output_ids, end_ids)
                reasoning_tokens[example.sample_id] = len(split.ids("reasoning"))
                out.write(record_line(example))
                examples.append(example)
        report = quality_report(examples, reasoning_tokens, reasoning_format)
        write_json_atomic(folder / "quality.json", report)
        create_markdown_artifact(_quality_markdown(report), key="data-quality")
        create_table_artifact(
            [
                {"source": s, **{k: v for k, v in f.items() if k != "sequence_tokens"}}
                for s, f in report["per_source"].items()
            ],
            key="data-quality-per-source",
        )
        logger.info(
            "reasoning format %s; capture rate %.1f%%, truncation %.1f%%",
            reasoning_format.name,
            100 * report["reasoning_capture_rate"],
            100 * report["truncation_rate"],
        )
        check_quality_gate(
            report,
            reasoning_format.reasons,
            config.reasoning.min_capture_rate,
            config.reasoning.max_truncation_rate,
        )
        return StageOutput(
            counts={"records": len(examples)},
            info={
                "quality": {
                    k: report[k]
                    for k in (
                        "reasoning_format",
                        "records",
                        "reasoning_capture_rate",
                        "truncation_rate",
                    )
                }
            },
        )

    return run_stage_task(
        "extract", config, {"generations": generations}, body, refresh=refresh
    ).model_dump()
