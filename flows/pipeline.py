"""The eaglet pipeline: the stage tasks of `eaglet.stages` wired in order, the run report at
the end, and the state each run ends in: Completed (its τ and method), Cached (every stage
reused), Planned (a plan-only run), or Failed with eaglet's own line (the stage, its error,
what to do). Nothing here does the work."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

from prefect import Task, flow
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentUpdate
from prefect.runtime import deployment, flow_run
from prefect.states import Completed, Failed, State

from eaglet import shutdown, work_dir_lock
from eaglet.cache import pipeline_code_version
from eaglet.config import PipelineConfig, load_config
from eaglet.failure_advice import RunOrigin, failure_headline
from eaglet.fixture.demo import demo_inputs_missing
from eaglet.preflight import run_preflight, take_passed_ahead
from eaglet.refresh import promote_completed_run
from eaglet.run_report import (
    RunRecord,
    failed_stages,
    failure_entry,
    start_run_record,
    write_run_record,
    write_run_report,
)
from eaglet.stage_reasons import plan_run
from eaglet.stages import STAGE_LIST, STAGES, RefreshFrom, StageName
from eaglet.storage import stage_dir
from eaglet_prefect.flows.crashes import report_crash
from eaglet_prefect.flows.refusals import (
    REFUSALS,
    permanent_errors_without_tracebacks,
    refusals_reported,
    refused_state,
)
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


def task_of_each_stage(*tasks: Task) -> dict[str, Task]:
    """Stage name -> its task (`tasks/<stage>.py`, named after its stage), refused unless
    each stage of `eaglet.stages` has one; the order is the stages' (`STAGE_LIST`), the one
    place it is written."""
    by_name = {task.name: task for task in tasks}
    if sorted(by_name) != sorted(STAGES) or len(tasks) != len(STAGES):
        raise ValueError(
            f"the flow's tasks are {sorted(t.name for t in tasks)}, the declared stages "
            f"{sorted(STAGES)}: import each stage's task (tasks/<stage>.py) and list it here"
        )
    return {stage: by_name[stage] for stage in STAGES}


# Each stage's task: a new stage's task is imported above and listed here.
TASKS = task_of_each_stage(download, tokenize, generate, extract, hidden_states, train, evaluate)
permanent_errors_without_tracebacks()  # eaglet's deliberate failures: their message, once
BETWEEN_STAGES = "the flow after"  # what an interrupt names once a stage has finished


def run_name() -> str:
    """The pipeline flow run's name (`run_label_of` its parameters)."""
    return run_label_of(flow_run.parameters)


def preflight(config: PipelineConfig, until: str = STAGES[-1]) -> None:
    """The preflight's report in the flow's log: the one `eaglet run` passed before the flow
    run existed, or a run of the checks now (the UI's runs, and the demo's before its inputs
    were built)."""
    lines = take_passed_ahead(config)
    if lines is None:
        if demo_inputs_missing(config):  # a run of the demo's config builds them first
            demo_setup(config)
        run_preflight(config, until=until)
        return
    for line in lines:
        print(line)


@flow(name="eaglet-pipeline", flow_run_name=run_name, log_prints=True, on_crashed=[report_crash])
def pipeline(
    config_path: str = "",
    until: StageName = STAGES[-1],
    refresh_from: RefreshFrom = "",
    plan_only: bool = False,
    retry_failed: bool = False,
    config: PipelineConfig = PipelineConfig(),  # noqa: B008 - the UI form shows these defaults
) -> State:
    """Regenerate the target's answers and train an EAGLE-3 draft on them.

    The run report (artifact `run-report`, and `WORK_DIR/run_report.md`) is written at the
    end, also when a stage fails. The form shows the run's switches first and the whole
    config last (it is most of the form's length).

    Args:
        config_path: A YAML config file on the machine that runs the flow; when given, it
            replaces `config`. Leave empty to use the form.
        until: The last stage to run (download, tokenize, generate, extract, hidden_states,
            train, evaluate).
        refresh_from: Run this stage and every one after it again even when their inputs and
            code are unchanged (a server flag or a dataset revision changed). Leave empty to
            reuse every finished stage.
        plan_only: Run nothing: say per stage whether it is Cached or why it would run (a
            code change naming the modules, a config change naming the keys, an upstream
            output change), in the log and the `run-plan` artifact; the run ends Planned.
        retry_failed: Send the samples a finished generate stage recorded as failed again,
            keeping every record already written.
        config: The whole configuration; its defaults are the demo's.
    """
    start_run()
    # `eaglet run` is a shell; its config file is the run's config (`config_path` is blank)
    origin = RunOrigin("full form" if deployment.id else "shell", config_path or None)
    try:
        if config_path:
            with refusals_reported(origin):
                config = load_config(config_path)
        if plan_only:
            return publish_plan(config, until, refresh_from or None)
        return run_stages(
            config, config_path or None, until, refresh_from or None, retry_failed, origin
        )
    except REFUSALS as exc:
        return refused_state(exc, origin)


def publish_plan(config: PipelineConfig, until: str, refresh_from: str | None) -> State:
    """The plan of a run (`eaglet.stage_reasons.plan_run`) as log lines and an artifact; the
    run ends in a Completed state named Planned, its message which stages would run."""
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
    runs = [p.stage for p in plans if p.state == "runs"]
    message = (
        f"plan: {', '.join(runs)} would run, {len(plans) - len(runs)} of {len(plans)} stages "
        "Cached or skipped; nothing ran"
        if runs
        else f"plan: all {len(plans)} stages Cached; nothing ran"
    )
    result = {"plan": [{"stage": p.stage, "state": p.state, "reasons": p.reasons} for p in plans]}
    return Completed(name="Planned", message=message, data=result)


def start_run() -> None:
    """What every flow run of eaglet does first: a flow run replaces the SIGTERM handler with
    Prefect's own for its duration; eaglet's (`eaglet run`, eaglet/shutdown.py) saves a
    checkpoint and exits within seconds."""
    shutdown.claim_signals()
    shutdown.set_stage("the preflight")


def record_code_version() -> None:
    """The code this run ran (`pipeline_code_version`: the commit, `+modified`, the stages'
    code hash) as its flow version, and as its deployment's version when that says otherwise:
    `eaglet serve` registers the version once, and a run of code edited since (each run
    imports it anew) showed the old one. Called once the stages ran: their keys parsed their
    modules already (parsing at the run's start raced Prefect's own loading of the flow in
    another thread: Python 3.11's "AST constructor recursion depth mismatch"). A version is
    never worth a failed run: a failure to record it is logged."""
    if not flow_run.id:
        return
    try:
        version = pipeline_code_version()
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, flow_version=version)
            if deployment.id and deployment.version != version:
                client.update_deployment(deployment.id, DeploymentUpdate(version=version))
    except Exception as exc:  # noqa: BLE001 - cosmetic, see above
        print(f"the run's code version was not recorded: {type(exc).__name__}: {exc}")


def run_stages(
    config: PipelineConfig,
    config_path: str | None,
    until: StageName,
    refresh_from: StageName | None,
    retry_failed: bool,
    origin: RunOrigin,
) -> State:
    """The flows' body: under the work dir's lock, the preflight, each stage up to `until`
    (`eaglet.stages`, each fed the outputs it reads), the run report. `origin` words a
    failure's advice (the form the run came from, or a shell; the YAML file its settings came
    from). A refusal is raised (the flow returns `refused_state`); a failed stage ends the run
    Failed with eaglet's own line (`failure_headline`), its error kept as the result."""
    # One run per work dir: runs of one deployment queue (its concurrency limit); one from
    # elsewhere is refused here naming the holder; `eaglet run` took the lock already and
    # takes it again.
    with ExitStack() as held:
        with refusals_reported(origin):  # a refusal: one line, the `run-refused` artifact
            held.enter_context(work_dir_lock.held(config.work_dir, flow_run=str(flow_run.id)))
            preflight(config, until)  # what the config already shows fails before any stage
        run_id = str(flow_run.id) if flow_run.id else None
        record = start_run_record(config, config_path, until, refresh_from, origin, run_id)
        outputs: dict[str, dict] = {}  # each stage's manifest by its output name
        failure: Exception | None = None
        try:
            for spec in STAGE_LIST[: STAGES.index(until) + 1]:
                if not spec.runs(config):  # hidden_states, online: train runs the target itself
                    continue
                inputs = {name: outputs[name] for name in spec.inputs(config)}
                if spec.sharded and config.execution.task_runner == "dask":
                    shutdown.set_stage(spec.name)
                    map_hidden_state_shards(config, *inputs.values())  # its shard tasks first
                if spec.retries_failed and retry_failed:
                    inputs["retry_failed"] = True
                # refresh_from re-runs that stage and every later one, whatever they read
                refresh = (
                    refresh_from is not None and spec.name in STAGES[STAGES.index(refresh_from) :]
                )
                outputs[spec.output] = run_task(spec.name, config, inputs, refresh, record)
            shutdown.set_stage("the run report")
        except Exception as exc:  # a failed stage: its task said what and where already
            if not failed_stages(record):
                raise  # not a stage's failure (a bug of the flow itself): its traceback stays
            failure = exc
        finally:
            create_markdown_artifact(
                write_run_report(Path(config.work_dir)),
                key="run-report",
                description=f"eaglet run {config.name}: per stage, Cached or ran, and key figures",
            )
        record_code_version()  # not on an interrupt: its exit is due within seconds
        if failure is not None:  # the run page's state and the notification lead with it
            stage = failed_stages(record)[0]
            headline = failure_headline(stage, record["stages"][stage], origin)
            return Failed(message=headline, data=failure)
        evaluation = outputs.get("report", {}).get("info", {})
        result = {"stages": record["stages"], "evaluation": evaluation}
        promote_completed_run(config, record)  # the current draft (eaglet.refresh)
        if flow_run.id and flow_run.run_count > 1:  # a Retry: earlier failures are stale
            mark_failures_superseded(flow_run.id)
        # The message is what the run page's state and the completion notification say; a run
        # whose every stage was reused is named Cached, so the run list tells it apart.
        states = {entry["state"] for entry in record["stages"].values()}
        return Completed(
            name="Cached" if states == {"Cached"} else "Completed",
            message=completed_message(config, record, evaluation),
            data=result,
        )


def completed_message(config: PipelineConfig, record: RunRecord, evaluation: dict) -> str:
    """One line for a completed run: the draft method and its τ against the untrained
    draft's, or where it stopped, and how many stages ran or came back Cached."""
    states = [entry["state"] for entry in record["stages"].values()]
    stages = f"{states.count('Cached')} of {len(states)} stages Cached"
    if evaluation.get("tau") is not None:
        figure = f"{evaluation.get('method', config.train.method)} draft τ {evaluation['tau']:.3f}"
        if evaluation.get("untrained_tau") is not None:
            figure += f" (untrained draft {evaluation['untrained_tau']:.3f})"
        return f"{figure}; {stages}"
    return f"stopped after {record.get('until', STAGES[-1])} as asked (no τ); {stages}"


def run_task(
    stage: str, config: PipelineConfig, inputs: dict, refresh: bool, record: RunRecord
) -> dict:
    """Run a stage's task (bypassing its cache for `refresh` and generate's `retry_failed`),
    write what it did into the run record (`run.json`) whatever the outcome, and return its
    manifest; a failed task raises its error here, so the flow fails with it."""
    started, work_dir = time.time(), Path(config.work_dir)
    record["running"] = stage  # what a crash report names if the process dies in it
    write_run_record(work_dir, record)
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
        if not state.is_completed():
            # A failure after a signal is the interrupt, which a library swallowed: torch
            # turned one raised inside its sequence conversion into "ValueError: could not
            # determine the shape of object type 'torch.storage.UntypedStorage'".
            shutdown.raise_if_requested()
    except shutdown.Interrupted as exc:  # SIGINT/SIGTERM: the task run is marked Crashed
        if not exc.stage.startswith(BETWEEN_STAGES):  # one from before it began is not its crash
            # its partial folder's files without counting their records (a 10 GB file would
            # take longer than the exit may)
            seconds = time.time() - started
            key, partial = partial_folder(stage, config, inputs)
            record["stages"][stage] = {
                **failure_entry(key, partial, str(exc), seconds, counted=False),
                "state": "Crashed",
            }
            write_run_record(work_dir, record)
        raise
    record["running"] = None
    if not state.is_completed():
        record["stages"][stage] = stage_failure(stage, config, inputs, state, time.time() - started)
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
