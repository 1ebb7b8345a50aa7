"""What a crashed flow run (its process killed: kill -9, out of memory, a lost machine) leaves
in the Prefect UI: no task run still Running, and the artifact `run-crashed` naming the stage
that was running and every stage that had finished (from the run's own record, `run.json`),
and how to resume. Prefect calls `report_crash` (an `on_crashed` hook of the flows) in
the process that served the run (`eaglet serve`, a worker) when the run's own process died,
or in the run's process when it could still tell."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglet.run_report import RESTARTS_PARTIAL, RESUMES_PARTIAL, finished_stages, read_run_record


def work_dir_of(parameters: dict[str, Any]) -> Path | None:
    """The work dir a flow run's parameters name (the full form's `config`, the short
    form's `work_dir`, or a config file's), None when they name none readable."""
    from eaglet.config import load_config

    if parameters.get("work_dir"):
        return Path(parameters["work_dir"])
    try:
        if parameters.get("config_path"):
            return Path(load_config(parameters["config_path"]).work_dir)
        config = parameters.get("config") or {}
        return Path(config["work_dir"]) if config.get("work_dir") else None
    except Exception:  # a config that does not load: the run never got to a stage
        return None


def crash_markdown(
    message: str, interrupted: list[str], work_dir: Path | None, flow_run_id: str | None = None
) -> str:
    """The `run-crashed` artifact: what stopped, what was kept, how to resume. The stage that
    was running and those that had finished come from the run's record in its work dir
    (when it is this flow run's); `interrupted` (its task runs still open) is the fallback."""
    record = read_run_record(work_dir) if work_dir is not None else None
    if record is not None and flow_run_id and record.get("flow_run") not in (None, flow_run_id):
        record = None  # another run's record: a later run started in this work dir
    running = record.get("running") if record else None
    if running:
        interrupted = [running]
    finished = {stage: record["stages"][stage] for stage in finished_stages(record) if record}
    if interrupted:
        where = ", ".join(interrupted)
    elif finished:
        where = f"the flow, after {list(finished)[-1]}"
    else:
        where = "the flow, before any stage finished"
    lines = [f"# Crashed during {where}: {message}", ""]
    resumes = [f"`{s}` {RESUMES_PARTIAL.get(s, RESTARTS_PARTIAL)}" for s in interrupted]
    kept = f"the {len(finished)} stages that finished" if finished else "the stages that finished"
    lines += [
        f"**What to do:** Retry this run (the same parameters can succeed): {kept} come back "
        "Cached" + ("; " + "; ".join(resumes) if resumes else "") + ".",
        "",
    ]
    if finished:
        lines += [
            f"## Kept: {len(finished)} finished stages ({', '.join(finished)})",
            "",
            "| stage | state | folder |",
            "|---|---|---|",
        ]
        lines += [f"| {s} | {e['state']} | `{e.get('path', '')}` |" for s, e in finished.items()]
    else:
        lines.append("No stage had finished.")
    return "\n".join(lines) + "\n"


def report_crash(flow: Any, flow_run: Any, state: Any) -> None:
    """The `on_crashed` hook: every task run of `flow_run` not in a final state is marked
    Crashed (a killed process cannot say so itself), then `run-crashed` is published."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Crashed

    message = state.message or "the flow run's process ended"
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
        )
        stale = [t for t in task_runs if t.state is not None and not t.state.is_final()]
        for task_run in stale:
            client.set_task_run_state(
                task_run.id,
                Crashed(message=f"the flow run crashed while this task ran: {message}"),
                force=True,
            )
        interrupted = sorted({t.name.split("[", 1)[0] for t in stale})  # train[demo]: train
        client.create_artifact(
            ArtifactCreate(
                key="run-crashed",
                type="markdown",
                data=crash_markdown(
                    message, interrupted, work_dir_of(flow_run.parameters), str(flow_run.id)
                ),
                description="the run's process died: what was kept and how to resume",
                flow_run_id=flow_run.id,
            )
        )
