"""The extract stage: generations → `examples.jsonl` + `quality.json`.

Splits reasoning from answer on token ids, builds input ids and loss masks, reports quality
per source (as a file and as artifacts) and fails the run at the quality gate.
"""

from __future__ import annotations

from pathlib import Path

from eaglet.config import PipelineConfig
from eaglet.extract import check_quality_gate, write_examples
from eaglet.reasoning import detect_format
from eaglet.report_figures import percent
from eaglet.stage_context import StageContext
from eaglet.stages import (
    GENERATIONS_FILE,
    PROMPTS_FILE,
    SERVER_DISAGREEMENTS_FILE,
    TEMPLATE_MISMATCHES_FILE,
    TURN_PROMPTS_FILE,
)
from eaglet.storage import Manifest, StageOutput, stage_dir
from eaglet.target import end_token_ids, load_tokenizer

# The figures of quality.json the manifest repeats.
QUALITY_FIGURES = ("reasoning_format", "records", "reasoning_capture_rate", "truncation_rate")


def quality_markdown(report: dict) -> str:
    lines = [
        f"# Data quality ({report['reasoning_format']})",
        "",
        "| source | records | reasoning captured | thinking in content | truncated | looped | "
        "reasoning share | p50 tokens | template mismatches | server text disagrees |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for source, f in report["per_source"].items():
        lines.append(
            f"| {source} | {f['records']} | {percent(f['reasoning_capture_rate'])} | "
            f"{f['thinking_in_content']} | {f['truncation_rate']:.1%} | {f.get('looped', 0)} | "
            f"{f['reasoning_token_share']:.1%} | {f['sequence_tokens'].get('p50', 0):.0f} | "
            f"{f['template_mismatches']} ({f['prompt_template_mismatches']} in the prompt) | "
            f"{f['server_reasoning_disagreements']} |"
        )
    lines += [
        "",
        "Reasoning captured: of the records not truncated, those whose reasoning was split "
        "out and closed. Looped: answers the loop guard stopped (generation.loop_guard; "
        "examples only with reasoning.looped_rows: keep). A template mismatch: a turn the "
        "chat template renders otherwise than the ids trained on (in the prompt: the "
        "configured template did not make the prompt). "
        f"Each template mismatch is in `{TEMPLATE_MISMATCHES_FILE}`; each disagreement between "
        f"a server's text and the token split, with both texts, in `{SERVER_DISAGREEMENTS_FILE}`.",
    ]
    settings = report.get("per_sampling", {})
    if set(settings) - {"generation settings"}:  # generation.sampling_plan was used
        lines += ["", "| sampling (generation.sampling_plan) | records | truncated | looped |"]
        lines.append("|---|---|---|---|")
        lines += [
            f"| {label} | {c['records']} | {c['truncated']} | {c['looped']} |"
            for label, c in settings.items()
        ]
    return "\n".join(lines)


def per_source_rows(per_source: dict[str, dict]) -> list[dict]:
    """The per-source figures as a table a pane shows whole: a row per figure, a column per
    source (a column per figure, a row per source, was wider than the artifact's pane)."""
    figures = dict.fromkeys(k for f in per_source.values() for k in f if k != "sequence_tokens")
    return [
        {"figure": k} | {s: round(v, 3) if isinstance(v := f.get(k), float) else v
                         for s, f in per_source.items()}
        for k in figures
    ]  # fmt: skip


def run(
    ctx: StageContext, config: PipelineConfig, inputs: dict[str, Manifest], folder: Path
) -> StageOutput:
    target = config.target
    tokenizer = load_tokenizer(target)
    reasoning_format = detect_format(
        tokenizer, config.reasoning.format, config.tokenize.chat_template_kwargs
    )
    generations = stage_dir(config.work_dir, inputs["generations"])
    report = write_examples(
        generations_path=generations / GENERATIONS_FILE,
        prompts_paths=[
            stage_dir(config.work_dir, inputs["prompts"]) / PROMPTS_FILE,
            generations / TURN_PROMPTS_FILE,  # regenerate="all" only
        ],
        out_dir=folder,
        tokenizer=tokenizer,
        reasoning_format=reasoning_format,
        end_ids=set(end_token_ids(target, tokenizer)),
        chat_template_kwargs=config.tokenize.chat_template_kwargs,
        looped_rows=config.reasoning.looped_rows,
    )
    ctx.markdown(
        "data-quality",
        quality_markdown(report),
        "reasoning capture, truncation and template checks of the generations",
    )
    ctx.table(
        "data-quality-per-source",
        per_source_rows(report["per_source"]),
        "the data-quality figures of each dataset source (a column each)",
    )
    ctx.info(
        f"reasoning format {reasoning_format.name}; capture rate "
        f"{percent(report['reasoning_capture_rate'])}, truncation "
        f"{100 * report['truncation_rate']:.1f}%"
    )
    check_quality_gate(report, reasoning_format.reasons, config.reasoning)
    model = Path(target.model)
    return StageOutput(
        counts={"records": report["records"]},
        info={
            "target_model": str(model.resolve()) if model.is_dir() else target.model,
            "quality": {k: report[k] for k in QUALITY_FIGURES},
        },
    )
