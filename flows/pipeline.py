"""The eaglet pipeline: the stage tasks of `eaglet.stages` wired in order, and the run report at
the end. Nothing here does the work."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

from prefect import Task, flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import deployment, flow_run
from prefect.states import Completed, State

from eaglet import shutdown, work_dir_lock
from eaglet.config import PipelineConfig, load_config
from eaglet.failure_advice import StartedFrom
from eaglet.fixture.demo import demo_inputs_missing
from eaglet.preflight import run_preflight, take_passed_ahead
from eaglet.run_report import (
    failure_entry,
    start_run_record,
    write_run_record,
    write_run_report,
)
from eaglet.stage_reasons import plan_run
from eaglet.stages import STAGE_LIST, STAGES, RefreshFrom, StageName
from eaglet.storage import stage_dir
from eaglet_prefect.flows.crashes import report_crash
from eaglet_prefect.flows.refusals import permanent_errors_without_tracebacks, refusals_reported
from eaglet_prefect.flows.run_names import run_label_of
from eaglet_prefect.flows.superseded import mark_failures_superseded
from eaglet_prefect.tasks.caching import partial_folder, result_storage_path, stage_failure
from eaglet_prefect.tasks.demo_setup import demo_setup
from eaglet_prefect.tasks.download import download
from eaglet_prefect.tasks.evaluate import evaluate
from eaglet_prefect.tasks.extract import extract
from eaglet_prefect.tasks.generate import generate
from eaglet_prefect.tasks.hidden_states import hidden_states, map_hidden_state_shards
from eaglet_prefect.tasks.tokenize import tokenize
from eaglet_prefect.tasks.train import train


def tasks_in_stage_order(*tasks: Task) -> dict[str, Task]:
    """Stage name -> its task (`tasks/<stage>.py`, named after its stage), refused unless the
    tasks are those of `eaglet.stages`, one each, in the same order."""
    names = tuple(task.name for task in tasks)
    if names != STAGES:
        raise ValueError(
            f"the flow's tasks are {list(names)}, the declared stages {list(STAGES)}: "
            "import each stage's task (tasks/<stage>.py) and list it in the stages' order"
        )
    return dict(zip(names, tasks, strict=True))


# Each stage's task: a new stage's task is imported above and listed here in its place.
TASKS = tasks_in_stage_order(download, tokenize, generate, extract, hidden_states, train, evaluate)
permanent_errors_without_tracebacks()  # eaglet's deliberate failures: their message, once
BETWEEN_STAGES = "the flow after"  # what an interrupt names once a stage has finished


def run_name() -> str:
    """The pipeline flow run's name (`run_label_of` its parameters)."""
    return run_label_of(flow_run.parameters)


def preflight(config: PipelineConfig, until: str = "evaluate") -> None:
    """The preflight's report in the flow's log: the one `eaglet run` passed before the flow
    run existed, or a run of the checks now (the UI's runs)."""
    lines = take_passed_ahead(config)
    if lines is None:
        if demo_inputs_missing(config):  # a UI run of the demo's config builds them first
            demo_setup(config)
        run_preflight(config, until=until)
        return
    for line in lines:
        print(line)


def interrupted_entry(
    stage: str, config: PipelineConfig, inputs: dict, exc: BaseException, seconds: float
) -> dict:
    """The `run.json` entry of a stage stopped by SIGINT/SIGTERM: its partial folder's files
    without counting their records (a 10 GB file would take longer than the exit may)."""
    key, partial = partial_folder(stage, config, inputs)
    entry = {**failure_entry(key, Path("/nonexistent"), str(exc), seconds), "state": "Crashed"}
    entry["path"] = str(partial)
    if partial.is_dir():
        files = sorted(p for p in partial.rglob("*") if p.is_file())
        entry["partial"] = {
            "exists": True,
            "files": len(files),
            "bytes": sum(p.stat().st_size for p in files),
            "listed": [str(p.relative_to(partial)) for p in files[:10]],
            "records": {},
            "failed_sample_ids": [],
        }
    return entry


@flow(name="eaglet-pipeline", flow_run_name=run_name, log_prints=True, on_crashed=[report_crash])
def pipeline(
    config: PipelineConfig = PipelineConfig(),  # noqa: B008 - the UI form shows these defaults
    config_path: str = "",
    until: StageName = "evaluate",
    refresh_from: RefreshFrom = "",
    retry_failed: bool = False,
    plan_only: bool = False,
) -> dict | State:
    """Regenerate the target's answers and train an EAGLE-3 draft on them.

    The run report (artifact `run-report`, and `WORK_DIR/run_report.md`) is written at the
    end, also when a stage fails.

    Args:
        config: The whole configuration; its defaults are the demo's.
        config_path: A YAML config file on the machine that runs the flow; when given, it
            replaces `config`. Leave empty to use the form.
        until: The last stage to run (download, tokenize, generate, extract, hidden_states,
            train, evaluate).
        refresh_from: Run this stage and every one after it again even when their inputs and
            code are unchanged (a server flag or a dataset revision changed). Leave empty to
            reuse every finished stage.
        retry_failed: Send the samples a finished generate stage recorded as failed again,
            keeping every record already written.
        plan_only: Run nothing: say per stage whether it is Cached or why it would run (a
            code change naming the modules, a config change naming the keys, an upstream
            output change), in the log and the `run-plan` artifact.
    """
    start_run()
    if config_path:
        with refusals_reported():
            config = load_config(config_path)
    if plan_only:
        return publish_plan(config, until, refresh_from or None)
    started_from = "full form" if deployment.id else "shell"  # `eaglet run`: a shell
    return run_stages(
        config, config_path or None, until, refresh_from or None, retry_failed, started_from
    )


def publish_plan(config: PipelineConfig, until: str, refresh_from: str | None) -> dict:
    """The plan of a run (`eaglet.stage_reasons.plan_run`) as log lines and an artifact."""
    plans = plan_run(config, until, refresh_from)
    for stage in plans:
        print(stage.line().strip())
    rows = ["| stage | plan | why |", "|---|---|---|"]
    rows += [f"| {p.stage} | {p.state} | {'; '.join(p.reasons)} |" for p in plans]
    create_markdown_artifact(
        f"# Plan for {config.work_dir}\n\nNothing ran.\n\n" + "\n".join(rows) + "\n",
        key="run-plan",
        description=f"eaglet {config.name}: per stage, Cached or why it would run",
    )
    return {"plan": [{"stage": p.stage, "state": p.state, "reasons": p.reasons} for p in plans]}


def start_run() -> None:
    """What every flow run of eaglet does first: a flow run replaces the SIGTERM handler with
    Prefect's own for its duration; eaglet's (`eaglet run`, eaglet/shutdown.py) saves a
    checkpoint and exits within seconds."""
    shutdown.claim_signals()
    shutdown.set_stage("the preflight")


def run_stages(
    config: PipelineConfig,
    config_path: str | None,
    until: StageName,
    refresh_from: StageName | None,
    retry_failed: bool,
    started_from: StartedFrom,
) -> State:
    """The flows' body: under the work dir's lock, the preflight, each stage up to `until`
    (`eaglet.stages`, each fed the outputs it reads), the run report. `started_from` words
    a failure's advice (the form the run came from, or a shell)."""
    # One run per work dir: runs of one deployment queue (its concurrency limit); one from
    # elsewhere is refused here naming the holder; `eaglet run` took the lock already and
    # takes it again.
    with ExitStack() as held:
        with refusals_reported():  # a refusal: one line, the `run-refused` artifact
            held.enter_context(work_dir_lock.held(config.work_dir, flow_run=str(flow_run.id)))
            preflight(config, until)  # what the config already shows fails before any stage
        record = start_run_record(config, config_path, until, refresh_from, started_from)
        outputs: dict[str, dict] = {}  # each stage's manifest by its output name
        try:
            for spec in STAGE_LIST[: STAGES.index(until) + 1]:
                if not spec.runs(config):  # hidden_states, online: train runs the target itself
                    continue
                inputs = {name: outputs[name] for name in spec.inputs(config)}
                if spec.name == "hidden_states" and config.execution.task_runner == "dask":
                    shutdown.set_stage("hidden_states")
                    map_hidden_state_shards(config, inputs["examples"])  # shard tasks first
                if spec.name == "generate" and retry_failed:
                    inputs["retry_failed"] = True
                # refresh_from re-runs that stage and every later one, whatever they read
                refresh = (
                    refresh_from is not None and spec.name in STAGES[STAGES.index(refresh_from) :]
                )
                outputs[spec.output] = run_task(spec.name, config, inputs, refresh, record)
            shutdown.set_stage("the run report")
        finally:
            create_markdown_artifact(
                write_run_report(Path(config.work_dir)),
                key="run-report",
                description=f"eaglet run {config.name}: per stage, Cached or ran, and key figures",
            )
        evaluation = outputs.get("report", {}).get("info", {})
        result = {"stages": record["stages"], "evaluation": evaluation}
        if flow_run.id and flow_run.run_count > 1:  # a Retry: earlier failures are stale
            mark_failures_superseded(flow_run.id)
        # The message is what the run page's state and the completion notification say.
        return Completed(message=completed_message(record, evaluation), data=result)


def completed_message(record: dict, evaluation: dict) -> str:
    """One line for a completed run: its τ against the untrained draft's, or where it
    stopped, and how many stages ran or came back Cached."""
    states = [entry["state"] for entry in record["stages"].values()]
    stages = f"{states.count('Cached')} of {len(states)} stages Cached"
    if evaluation.get("tau") is not None:
        figure = f"τ {evaluation['tau']:.3f}"
        if evaluation.get("untrained_tau") is not None:
            figure += f" (untrained draft {evaluation['untrained_tau']:.3f})"
        return f"{figure}; {stages}"
    return f"stopped after {record.get('until', 'evaluate')} as asked (no τ); {stages}"


def run_task(stage: str, config: PipelineConfig, inputs: dict, refresh: bool, record: dict) -> dict:
    """Run a stage's task (bypassing its cache for `refresh` and generate's `retry_failed`),
    write what it did into the run record (`run.json`) whatever the outcome, and return its
    manifest; a failed task raises its error here, so the flow fails with it."""
    started, work_dir = time.time(), Path(config.work_dir)
    try:
        # From here an interrupt names this stage and is recorded as its crash, wherever it
        # lands (it once landed between naming the stage and entering this block).
        shutdown.set_stage(stage)
        shutdown.raise_if_requested()  # an interrupt some library swallowed stops the run here
        task = TASKS[stage].with_options(
            result_storage=result_storage_path(config),
            refresh_cache=True if refresh or inputs.get("retry_failed") else None,
        )
        state = task(config, **inputs, refresh=refresh, return_state=True)
    except shutdown.Interrupted as exc:  # SIGINT/SIGTERM: the task run is marked Crashed
        if not exc.stage.startswith(BETWEEN_STAGES):  # one from before it began is not its crash
            entry = interrupted_entry(stage, config, inputs, exc, time.time() - started)
            record["stages"][stage] = entry
            write_run_record(work_dir, record)
        raise
    if not state.is_completed():
        entry = stage_failure(stage, config, inputs, state, time.time() - started)
        record["stages"][stage] = entry
        write_run_record(work_dir, record)
    manifest = state.result()  # raises the task's error
    record["stages"][stage] = {
        "state": state.name,
        "key": manifest["key"],
        "path": str(stage_dir(work_dir, manifest)),  # manifests hold it relative
        "records": manifest["counts"].get("records", 0),
        "seconds": round(time.time() - started, 2),
    }
    write_run_record(work_dir, record)
    shutdown.set_stage(f"{BETWEEN_STAGES} {stage}")  # a finished stage is not interrupted
    return manifest
