"""A draft that follows its target, as two flows: `watch` (scheduled) fingerprints the target and
emits `eaglet.target.changed` when it is not the one the current draft was trained on; `refresh`
(started by an automation on that event, or by hand) measures the draft on the new target and
keeps it, or trains from it and promotes the better draft. The decisions are the core's
(`eaglet.refresh`); this module wires them, logs each, and publishes an artifact a person reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from eaglet import work_dir_lock
from eaglet.config import PipelineConfig, load_config
from eaglet.refresh import (
    CHANGED_EVENT,
    TRAIN,
    current_draft,
    keep_serving,
    measure,
    promote,
    promoted_from_run,
    promotion_decided_by_refresh,
    retrain_config,
    set_taus,
    target_change,
    trained_parts,
    verdict,
)
from eaglet.run_report import CONFIG_FILE
from eaglet.stages import REPORT_FILE, STAGES
from eaglet.storage import stage_folder
from eaglet_prefect.flows.pipeline import pipeline


def work_dir_config(work_dir: str, config_path: str) -> PipelineConfig:
    """The config the work dir's draft follows: `config_path`, else the work dir's own
    `config.yaml` (its last run's); the work dir where it is now."""
    path = config_path or str(Path(work_dir) / CONFIG_FILE)
    return load_config(path, [f"work_dir={Path(work_dir).resolve()}"])


@flow(name="eaglet-watch", log_prints=True)
def watch(work_dir: str = "runs/demo", config_path: str = "") -> dict:
    """Fingerprint the target (by content, the parts the train stage reads) and emit
    `eaglet.target.changed` when the current draft was trained on another one. Downloads
    nothing and trains nothing.

    Args:
        work_dir: The work dir whose current draft (`draft.json`, else its last run's) follows
            its target.
        config_path: The config to read the target from; blank: the work dir's `config.yaml`.
    """
    config = work_dir_config(work_dir, config_path)
    change = target_change(config)
    if change is None:
        print(f"the target of {work_dir} is the one its current draft was trained on")
        return {"changed": False}
    print(
        f"the target {change['target_model']} changed ({', '.join(change['changed'])}) since "
        f"the current draft {change['draft']} was trained: emitting {CHANGED_EVENT}"
    )
    emit_event(
        event=CHANGED_EVENT,
        resource={
            "prefect.resource.id": f"eaglet.work-dir.{change['work_dir']}",
            "prefect.resource.name": change["work_dir"],
        },
        payload=change,
    )
    create_markdown_artifact(
        "# The target changed\n\n"
        + "\n".join(
            f"- {part}: `{change['old'][part]}` → `{change['new'][part]}`"
            for part in change["changed"]
        )  # fmt: skip
        + f"\n\nThe draft `{change['draft']}` was trained on the old one; `{CHANGED_EVENT}` "
        "starts a refresh, which measures it on the new target before training anything.",
        key="target-changed",
        description=f"eaglet watch of {work_dir}: what changed",
    )
    return {"changed": True, **change}


@task(name="measure-draft", task_run_name="measure-draft")
def measure_draft(config: PipelineConfig, draft_dir: str) -> dict:
    """The draft on the target and named sets (the evaluate stage's rounds)."""
    return measure(config, Path(draft_dir), progress=print)


@flow(name="eaglet-refresh", log_prints=True)
def refresh(work_dir: str = "runs/demo", config_path: str = "") -> State:
    """Measure the current draft on the (changed) target; when its τ fell by no more than
    `refresh.max_drop`, record that it serves the new target and stop; else train a draft for
    the new target from it (`train.init_from`, `refresh.samples` samples) and promote that one
    only if it beats the current draft there. A refresh that fails leaves the current draft.

    Args:
        work_dir: The work dir whose current draft follows its target.
        config_path: The config to run; blank: the work dir's `config.yaml`.
    """
    config = work_dir_config(work_dir, config_path)
    with work_dir_lock.held(config.work_dir, flow_run=str(flow_run.id)):
        draft = current_draft(Path(config.work_dir))
        if draft is None:
            return Failed(message=f"{work_dir} has no trained draft to refresh: run it first")
        promote(Path(config.work_dir), draft)  # pinned: the run below rewrites run.json
        target = trained_parts(config)
        draft_dir = Path(config.work_dir) / draft.draft
        measured = measure_draft(config, str(draft_dir))
        now = set_taus(measured)
        decided = verdict(draft.tau, now, config.refresh.max_drop)
        for line in decided["lines"]:
            print(line)
        report = f"# Refresh of {work_dir}\n\nThe current draft `{draft.draft}`:\n\n"
        table = ["| set | τ at training | τ on the new target | change |", "|---|---|---|---|"]
        table += [
            f"| {name} | {row['before']:.3f} | {row['now']:.3f} | {-100 * row['drop']:+.1f}% |"
            for name, row in decided["sets"].items()
        ]
        report += "\n".join(table) + "\n\n" + decided["lines"][-1] + "\n"
        if decided["keep"]:
            keep_serving(Path(config.work_dir), draft, target, now)
            create_markdown_artifact(report, key="refresh-report", description="kept: τ held")
            return Completed(message=f"kept {draft.draft}: {decided['lines'][-1]}")
        retrain = retrain_config(config, draft_dir)
        with promotion_decided_by_refresh():  # promoted below only if it beats the current one
            result = pipeline(config=retrain)  # a subflow: every stage of it in the UI
        stages = result["stages"]
        report_file = stage_folder(Path(config.work_dir), STAGES[-1], stages[STAGES[-1]]["key"])
        trained = set_taus(json.loads((report_file / REPORT_FILE).read_text()))
        old, new = mean(now.values()), mean(trained[name] for name in now)
        rows = "\n".join(
            f"| {name} | {now[name]:.3f} | {trained.get(name, float('nan')):.3f} |" for name in now
        )
        report += (
            "\n## After training from it\n\n| set | current draft | new draft |\n|---|---|---|\n"
            + rows + "\n\n"
        )  # fmt: skip
        if new > old:
            promote(
                Path(config.work_dir),
                promoted_from_run(
                    stages[TRAIN]["key"], config.target.model, target,
                    trained, f"refresh: τ {new:.3f} against the old draft's {old:.3f}",
                ),
            )  # fmt: skip
            verdict_line = f"promoted the new draft: mean τ {new:.3f} > {old:.3f}"
        else:
            verdict_line = f"kept the current draft: the new one's mean τ {new:.3f} <= {old:.3f}"
        print(verdict_line)
        create_markdown_artifact(
            report + verdict_line + "\n", key="refresh-report", description=verdict_line
        )
        return Completed(message=verdict_line)
