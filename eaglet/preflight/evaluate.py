"""What the evaluate stage needs, checked when the run goes that far: held-out samples
(`train.holdout_fraction` against the datasets' rows) and each named evaluation set
(`evaluate.sets`) there and in its format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglet.config.pipeline import PipelineConfig
from eaglet.local_paths import is_hub_dataset
from eaglet.preflight.report import PreflightReport, first_line


def check_eval_sets(
    config: PipelineConfig, report: PreflightReport, model_config: Any = None
) -> None:
    """Each named evaluation set's file is there and in its format (read now: sets are small),
    rather than failing after training; prompts over the target's context by the hard bound
    (`eaglet.eval_sets.too_long_to_tokenize`) are counted: they are left out of τ."""
    from eaglet.eval_sets import EvalSetError, read_set, too_long_to_tokenize
    from eaglet.prompt_rendering import context_length

    context = context_length(model_config) if model_config is not None else None

    for i, spec in enumerate(config.evaluate.sets):
        key = f"evaluate.sets[{i}] ({spec.name})"
        if is_hub_dataset(spec.path) and not Path(spec.path).exists():
            report.passed.append(f"{key}: hub dataset {spec.path} (read by the evaluate stage)")
            continue
        if not Path(spec.path).is_file():
            report.problems.append(
                f"{key}: file {spec.path} not found: fix evaluate.sets[{i}].path, or remove the "
                "set (evaluate.sets: [] measures the held-out prompts only)"
            )
            continue
        try:
            prompts = read_set(spec)
        except (EvalSetError, OSError, ValueError) as exc:
            report.problems.append(f"{key}: {first_line(exc)}")
            continue
        over = [p.prompt_id for p in prompts if too_long_to_tokenize(p, context)]
        if over:
            report.warnings.append(
                f"{key}: {len(over)} prompt(s) over the target's {context}-token context "
                f"({', '.join(over[:5])}{', ...' if len(over) > 5 else ''}): left out of its τ"
            )
        if not prompts:
            report.problems.append(f"{key}: {spec.path} holds no prompts")
        elif len(over) == len(prompts):
            report.problems.append(f"{key}: {spec.path} holds no prompt that fits the target")
        else:
            report.passed.append(f"{key}: {spec.path} ({len(prompts)} prompts)")


def check_holdout(config: PipelineConfig, rows: list[int | None], report: PreflightReport) -> None:
    """evaluate measures τ on the held-out samples: none held out fails it after training."""
    fraction = config.train.holdout_fraction
    if fraction == 0:
        report.problems.append(
            "train.holdout_fraction=0 holds no sample out, and evaluate measures the draft on "
            "held-out samples: set it above 0 (0.05 is usual), or run --until train"
        )
        return
    known = [r for r in rows if r is not None]
    if known and len(known) == len(rows):
        total = sum(known)
        expected = total * fraction
        if expected < 1:  # the split is by id hash: some may still be held out
            report.warnings.append(
                f"train.holdout_fraction={fraction:g} of at most {total} samples holds out "
                f"{expected:.2f} on average: evaluate may find none after training; raise it "
                f"to at least {min(1.0, 2 / max(1, total)):.2g} or add samples"
            )
