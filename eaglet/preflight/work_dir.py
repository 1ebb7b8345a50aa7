"""`work_dir`: a folder (or creatable), writable, with `MIN_FREE_BYTES` free; and the disk
budget of the hidden_states shards there (`eaglet.hidden_states.budget`), as an upper
bound: every sample at full length.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from eaglet.config.pipeline import PipelineConfig
from eaglet.preflight.report import PreflightReport, first_line

MIN_FREE_BYTES = 1 << 30


def check_work_dir(config: PipelineConfig, report: PreflightReport) -> None:
    work_dir = Path(config.work_dir)
    if work_dir.exists() and not work_dir.is_dir():
        report.problems.append(
            f"work_dir: {work_dir} is a file, not a folder: set work_dir to a folder (every "
            "stage writes there)"
        )
        return
    existing = next((p for p in [work_dir, *work_dir.parents] if p.exists()), Path("."))
    if not existing.is_dir():
        report.problems.append(
            f"work_dir: {work_dir} cannot be created: {existing} is a file; set work_dir elsewhere"
        )
        return
    if not os.access(existing, os.W_OK | os.X_OK):
        report.problems.append(
            f"work_dir: {existing} is not writable by this user: set work_dir to a folder "
            "you can write"
        )
        return
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        report.problems.append(
            f"work_dir: only {free / 2**30:.2f} GiB free under {existing.resolve()}: free "
            "space or move work_dir"
        )
        return
    report.passed.append(f"work_dir {work_dir}: usable, {free / 2**30:.1f} GiB free")


def check_disk_budget(
    config: PipelineConfig, model_config: Any, rows: list[int | None], report: PreflightReport
) -> None:
    """The hidden_states shards' upper bound (every sample at full length) against the free
    space; a warning when it may not fit (real lengths are known only after generation)."""
    from eaglet.hidden_states.budget import disk_budget, human

    if config.train.hidden_states == "online":
        report.passed.append("disk budget: online training stores no hidden-state shards")
        return
    hidden = getattr(model_config, "hidden_size", None)
    if not rows or not isinstance(hidden, int):
        return
    known = [r for r in rows if r is not None]
    if len(known) < len(rows):
        report.warnings.append(
            "disk budget: the number of samples is not known before download (a hub dataset "
            "without limit); checked by the hidden_states stage"
        )
        return
    per_sample = config.tokenize.max_prompt_tokens + config.generation.max_tokens
    tokens = sum(known) * per_sample
    storage = config.hidden_states.storage
    try:
        budget = disk_budget(Path(config.work_dir), tokens, hidden, storage)
    except (ValueError, OSError) as exc:
        report.warnings.append(f"disk budget: not checked ({first_line(exc)})")
        return
    line = (
        f"disk budget: hidden_states needs at most {human(budget.needed)} ({sum(known)} "
        f"samples x {per_sample} tokens, storage {storage}); {human(budget.free)} free under "
        f"{budget.path}"
    )
    if budget.fits:
        report.passed.append(line)
        return
    report.warnings.append(
        f"{line}: may not fit (an upper bound); the hidden_states stage checks the real "
        "figure before it writes. Options: datasets[].limit, shorter max lengths, "
        "hidden_states.storage=int8, another disk"
    )
    report.recommendations.append(
        "use online training (train.hidden_states=online): the draft then gets the "
        "target's hidden states batch by batch while it trains and stores none, "
        f"saving up to {human(budget.needed)} here"
    )
