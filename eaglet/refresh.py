"""A draft that follows its target: which draft is current, whether its target changed, whether
it still serves the new one, and its promotion (the core of the watch and refresh flows).

- The current draft: `WORK_DIR/draft.json` (`PromotedDraft`), written whenever a draft is
  promoted: a run that measured its draft promotes it (`promote_completed_run`), but a run a
  refresh starts leaves that to the refresh, which promotes only a draft that beat the current
  one; without a record, the last run's train stage's draft, with the τ its evaluate stage
  measured on the named sets.
- The watch (`target_change`): the target's fingerprint now, in the parts the train stage reads
  (`TRAINED_PARTS`, by content: `eaglet.fingerprints`), against those the current draft was
  trained on. A hub id is fingerprinted by its id and revision, never downloaded.
- The decision (`verdict`): the current draft measured on the new target, per named evaluation
  set (greedy, the same k), against its τ at training: kept when no set fell by more than
  `refresh.max_drop`.
- Training again (`retrain_config`): the pipeline for the new target from the current draft
  (`train.init_from`, its vocabulary grown by the new data's tokens), for
  `refresh.epochs_fraction` of `train.epochs`, on `refresh.samples` samples.
- Promotion (`promote`): a new draft replaces the current one only when its τ on the new target
  beats the current draft's there; `draft.json` is written whole (`write_json_atomic`), so a
  refresh that fails leaves the current draft as it was.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from eaglet.config import PipelineConfig
from eaglet.fingerprints import target_parts
from eaglet.run_report import RunRecord, StageEntry, finished_stages, read_run_record
from eaglet.stages import DRAFT_FOLDER, PRODUCER, REPORT_FILE, TARGET_PART_OF
from eaglet.storage import read_manifest, stage_folder, write_json_atomic

PROMOTED_FILE = "draft.json"
# The parts of the target the train stage reads (`eaglet.stages`): a change to one of them is
# a change to the target the draft follows.
TRAINED_PARTS = ("weights", "tokenizer", "generation_config")
CHANGED_EVENT = "eaglet.target.changed"
TRAIN, EVALUATE = PRODUCER["draft"], PRODUCER["report"]  # the stages that write and score it


class RefreshError(ValueError):
    """A refresh that cannot decide: no current draft, or no named set to measure it on."""


class PromotedDraft(BaseModel):
    """`WORK_DIR/draft.json`: the draft that serves the target now, and what it was measured
    on."""

    train_key: str = Field(description="the train stage folder of the draft")
    draft: str = Field(description="its vLLM export, relative to the work dir")
    target_model: str = Field(description="the target it was trained for")
    target: dict[str, str] = Field(description="that target's parts (TRAINED_PARTS)")
    tau: dict[str, float] = Field(description="τ per named evaluation set on that target")
    promoted: float = Field(default_factory=time.time)
    why: str = ""
    served: list[dict[str, Any]] = Field(
        default_factory=list,
        description="later targets it was measured on and kept for: target parts, τ, when",
    )


def trained_parts(config: PipelineConfig) -> dict[str, str]:
    """The target's fingerprint now, in the parts the train stage reads."""
    parts = target_parts(config.target.model, config.target.revision, config.work_dir)
    return {part: parts[part] for part in TRAINED_PARTS}


def set_taus(report: dict[str, Any]) -> dict[str, float]:
    """τ per named evaluation set from an evaluate report (or `evaluate_sets`' result)."""
    sets = report.get("sets", {}) if "tau" in report else report  # a report.json holds its own
    return {name: float(figures["tau"]) for name, figures in sets.items()}


def current_draft(work_dir: Path) -> PromotedDraft | None:
    """The draft that serves the target now: `draft.json`, else the last run's train stage's
    (None when no run trained one)."""
    work_dir = Path(work_dir)
    promoted = work_dir / PROMOTED_FILE
    if promoted.is_file():
        return PromotedDraft.model_validate_json(promoted.read_text())
    run = read_run_record(work_dir)
    try:
        stages = run["stages"] if run is not None else {}
        train = read_manifest(stage_folder(work_dir, TRAIN, stages[TRAIN]["key"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if train is None:
        return None
    tau: dict[str, float] = {}
    evaluate: StageEntry = stages.get(EVALUATE) or {"state": "not run"}
    report = stage_folder(work_dir, EVALUATE, evaluate.get("key", "")) / REPORT_FILE
    if evaluate.get("key") and report.is_file():
        tau = set_taus(json.loads(report.read_text()))
    keyed = {TARGET_PART_OF.get(path): value for path, value in train.config.items()}
    target = {part: str(keyed.get(part, "")) for part in TRAINED_PARTS}
    draft = promoted_from_run(train.key, str(train.info.get("target_model", "")), target, tau,
                              "the last run's draft")  # fmt: skip
    return draft.model_copy(update={"promoted": train.finished})


def target_change(config: PipelineConfig) -> dict[str, Any] | None:
    """What the watch emits when the target is not the one the current draft was trained on:
    the work dir, the draft, and both fingerprints (the parts that differ named); None when
    it is the same, or no draft was trained yet."""
    draft = current_draft(Path(config.work_dir))
    if draft is None:
        return None
    now = trained_parts(config)
    changed = sorted(part for part in TRAINED_PARTS if now[part] != draft.target.get(part))
    if not changed:
        return None
    return {
        "work_dir": str(Path(config.work_dir).resolve()),
        "draft": draft.draft,
        "changed": changed,
        "old": draft.target,
        "new": now,
        "target_model": config.target.model,
    }


def verdict(before: dict[str, float], now: dict[str, float], max_drop: float) -> dict[str, Any]:
    """Whether the current draft still serves the new target: per named set its τ at training,
    now, and the fall as a fraction; kept when no set fell by more than `max_drop`."""
    if not before:
        raise RefreshError(
            "the current draft has no τ on a named evaluation set to compare with: set "
            "evaluate.sets and run the pipeline once"
        )
    rows = {
        name: {"before": before[name], "now": now[name],
               "drop": (before[name] - now[name]) / before[name]}
        for name in sorted(before) if name in now
    }  # fmt: skip
    worst = max((row["drop"] for row in rows.values()), default=0.0)
    keep = worst <= max_drop
    lines = [
        f"{name}: τ {row['before']:.3f} at training, {row['now']:.3f} on the new target "
        f"({-100 * row['drop']:+.1f}%)"
        for name, row in rows.items()
    ]
    lines.append(
        f"largest fall {100 * worst:.1f}% {'<=' if keep else '>'} refresh.max_drop "
        f"{100 * max_drop:.1f}%: "
        + ("the draft keeps serving the new target" if keep else "the draft is trained again")
    )
    return {"keep": keep, "sets": rows, "worst_drop": worst, "lines": lines}


def retrain_config(config: PipelineConfig, draft_dir: Path) -> PipelineConfig:
    """The pipeline for the new target, trained from the current draft (`train.init_from`, its
    vocabulary grown) for `refresh.epochs_fraction` of the epochs (rounded up), on
    `refresh.samples` samples (split evenly over the datasets; blank: all)."""
    epochs = max(1, math.ceil(config.train.epochs * config.refresh.epochs_fraction))
    starts_from = config.train.model_copy(
        update={
            "init_from": str(Path(draft_dir).resolve()),
            "init_from_vocab": "grow",  # the words the new target uses may be new to the draft
            "epochs": epochs,
        }
    )
    update: dict[str, Any] = dict(train=starts_from)  # the section, not the stage
    samples = config.refresh.samples
    if samples is not None:
        share = math.ceil(samples / len(config.datasets))
        update["datasets"] = [
            d.model_copy(update={"limit": min(d.limit or share, share)}) for d in config.datasets
        ]
    return config.model_copy(update=update)


def promote(work_dir: Path, draft: PromotedDraft) -> None:
    """Make `draft` the current one (`draft.json`, written whole)."""
    write_json_atomic(Path(work_dir) / PROMOTED_FILE, draft.model_dump())


def keep_serving(work_dir: Path, draft: PromotedDraft, target: dict[str, str], tau: dict) -> None:
    """Record that `draft` serves the new `target` (its τ measured there): the watch compares
    with that target from now on; a later refresh still compares with its τ at training."""
    served = [*draft.served, {"target": target, "tau": tau, "at": time.time()}]
    promote(work_dir, draft.model_copy(update={"target": target, "served": served}))


def measure(config: PipelineConfig, draft_dir: Path, progress=None) -> dict[str, Any]:
    """The draft in `draft_dir` on `config`'s target and named evaluation sets, as the
    evaluate stage measures them (greedy, `evaluate.num_speculative_tokens`): per set its
    figures (`eaglet.draft.set_evaluation.evaluate_sets`)."""
    from eaglet.draft.set_evaluation import evaluate_sets
    from eaglet.target import end_token_ids, load_tokenizer

    if not config.evaluate.sets:
        raise RefreshError("a refresh measures the draft on evaluate.sets: the config names none")
    tokenizer = load_tokenizer(config.target)
    greedy = config.evaluate.model_copy(update={"temperature": 0.0})
    return evaluate_sets(
        config.evaluate.sets, Path(draft_dir), config.target, tokenizer, greedy,
        config.tokenize.chat_template_kwargs, end_token_ids(config.target, tokenizer), progress,
    )  # fmt: skip


def promoted_from_run(
    train_key: str, target_model: str, target: dict[str, str], tau: dict, why: str
) -> PromotedDraft:
    """The record of a run's draft (`train/<key>/draft`) as the current one."""
    return PromotedDraft(
        train_key=train_key,
        draft=f"{TRAIN}/{train_key}/{DRAFT_FOLDER}",
        target_model=target_model,
        target=target,
        tau=tau,
        why=why,
    )


_REFRESHING: ContextVar[bool] = ContextVar("eaglet_refreshing", default=False)


@contextmanager
def promotion_decided_by_refresh() -> Iterator[None]:
    """Within the block (a refresh running the pipeline), a completed run does not promote
    its draft: the refresh promotes it only if it beats the current one."""
    token = _REFRESHING.set(True)
    try:
        yield
    finally:
        _REFRESHING.reset(token)


def promote_completed_run(config: PipelineConfig, run: RunRecord) -> None:
    """Make the draft of a run that trained and measured it (`run.json`) the current one; not
    within a refresh."""
    if _REFRESHING.get() or not {TRAIN, EVALUATE} <= set(finished_stages(run)):
        return
    train, evaluate = run["stages"][TRAIN], run["stages"][EVALUATE]
    work_dir = Path(config.work_dir)
    report = stage_folder(work_dir, EVALUATE, evaluate["key"]) / REPORT_FILE
    tau = set_taus(json.loads(report.read_text())) if report.is_file() else {}
    promote(
        work_dir,
        promoted_from_run(train["key"], config.target.model, trained_parts(config),
                          tau, "a run trained and measured it"),
    )  # fmt: skip
