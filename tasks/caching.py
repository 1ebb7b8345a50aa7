"""The one declaration of every stage task (`stage_task`), its cache policy, the call that runs
a stage into its folder, and the on_failure hook that says what a failed stage left behind and
how to resume.

Prefect's cache key for a stage task is the stage key of `eaglet.cache` (config subset +
upstream manifest hashes + code hash of the stage's modules), so Prefect reports a stage as
Cached exactly when its folder would be reused. The key also names the stage folder, and the
Prefect record sits inside the work dir: deleting a work dir clears its cache too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import Task, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import CachePolicy
from prefect.client.schemas.objects import TaskRun
from prefect.context import TaskRunContext
from prefect.states import State

from eaglet.cache import stage_key
from eaglet.config import PipelineConfig
from eaglet.errors import is_transient
from eaglet.run_report import failure_entry, failure_note, read_run_record
from eaglet.stage_runner import run_stage_body
from eaglet.stages import STAGE, StageBody, upstream_names
from eaglet.storage import PARTIAL_SUFFIX, Manifest, reusable_stage, stage_folder
from eaglet_prefect.tasks.context import PrefectContext


def upstream_manifests(stage: str, inputs: dict[str, Any]) -> list[Manifest]:
    """The manifests of the earlier stages `stage` was handed (task parameters by output name)."""
    return list(given_inputs(stage, inputs).values())


def given_inputs(stage: str, inputs: dict[str, Any]) -> dict[str, Manifest]:
    given = [name for name in upstream_names(stage) if inputs.get(name) is not None]
    return {name: Manifest.model_validate(inputs[name]) for name in given}


@dataclass
class StageCache(CachePolicy):
    """Cache key = the stage key; a key whose folder is gone is never reported as Cached."""

    stage: str = ""

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str | None:
        config = PipelineConfig.model_validate(inputs["config"])
        key = stage_key(self.stage, config, upstream_manifests(self.stage, inputs))
        name = f"{self.stage}-{key}"
        # A record whose stage folder was deleted would hand back a manifest of missing files:
        # drop it so Prefect runs the task again.
        # So would a folder whose files no longer match its manifest (run_stage then says what).
        # And Prefect unpickles a record whose file names the pickle serializer, whatever the
        # task declares: a work dir may come from elsewhere, so only JSON records are read.
        record = result_storage_path(config) / name
        if not reusable_stage(Path(config.work_dir), self.stage, key) or not _json_record(record):
            record.unlink(missing_ok=True)
        return name


def _json_record(path: Path) -> bool:
    """True unless `path` is a Prefect result record with another serializer than JSON (or
    not a record at all)."""
    if not path.exists():
        return True
    try:
        return json.loads(path.read_bytes())["metadata"]["serializer"]["type"] == "json"
    except (ValueError, KeyError, TypeError, OSError):
        return False


def result_storage_path(config: PipelineConfig) -> Path:
    path = Path(config.work_dir).resolve() / ".prefect-results"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_stage_task(
    stage: str,
    body: StageBody,
    config: PipelineConfig,
    inputs: dict[str, Any],
    refresh: bool = False,
    reopen_if: Callable[[Manifest], bool] | None = None,
) -> dict[str, Any]:
    """Run one stage's `body` (which its task module imports) into `WORK_DIR/<stage>/<key>/`
    (or reuse the folder) with the Prefect context, and return its manifest as the task's
    result."""
    given = given_inputs(stage, inputs)
    manifest = run_stage_body(stage, body, config, given, PrefectContext(), refresh, reopen_if)
    return manifest.model_dump()


def partial_folder(stage: str, config: PipelineConfig, inputs: dict[str, Any]) -> tuple[str, Path]:
    """The key of a stage and the `.partial` folder its task writes into."""
    key = stage_key(stage, config, upstream_manifests(stage, inputs))
    final = stage_folder(Path(config.work_dir), stage, key)
    return key, final.with_name(key + PARTIAL_SUFFIX)


def failure_message(state: State) -> tuple[str, bool]:
    """`ErrorType: message` of a failed task run state (its exception when it has one), and
    whether a retry with the same parameters can succeed: the one fact (`is_transient`) that
    also decides Prefect's automatic retries (`retry_only_transient`), so the advice, the
    log and the state message never disagree."""
    error = state.result(raise_on_failure=False)
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}", is_transient(error)
    return state.message or state.name, False


def stage_failure(
    stage: str, config: PipelineConfig, inputs: dict[str, Any], state: State, seconds: float
) -> dict[str, Any]:
    """The `run.json` entry of a failed stage: its error and what its partial folder holds."""
    key, partial = partial_folder(stage, config, inputs)
    error, retry_can_succeed = failure_message(state)
    return failure_entry(key, partial, error, seconds, retry_can_succeed)


def report_stage_failure(task: Task, task_run: TaskRun, state: State) -> None:
    """on_failure hook of every stage task: log and publish (artifact `<stage>-failure`) what
    failed, what the partial folder holds and the command that resumes. The partial folder is
    left as it is: a rerun resumes (generate, train) or rebuilds it."""
    stage = task.name
    parameters = TaskRunContext.get().parameters
    config = PipelineConfig.model_validate(parameters["config"])
    started = task_run.start_time.timestamp() if task_run.start_time else time.time()
    entry = stage_failure(stage, config, parameters, state, time.time() - started)
    note = failure_note(stage, entry, read_run_record(Path(config.work_dir)))
    get_run_logger().error(note)
    create_markdown_artifact(
        note,
        key=f"{stage.replace('_', '-')}-failure",
        description=f"{stage} failed: partial outputs and how to resume",
    )


def retry_only_transient(task: Task, task_run: TaskRun, state: State) -> bool:
    """Prefect's `retry_condition_fn` of every stage task: retry a transient fault (connection,
    timeout, 429, 5xx, a killed worker), never a deterministic one (a canary or config error,
    the quality gate, failures that were all 4xx): that would fail again, only later."""
    error = state.result(raise_on_failure=False)
    retry = isinstance(error, BaseException) and is_transient(error)
    if not retry and task.retries:
        get_run_logger().error(
            "%s failed for a reason a retry cannot mend (%s): not retrying",
            task.name,
            type(error).__name__ if isinstance(error, BaseException) else state.name,
        )
    return retry


# Task tags: every stage task has `eaglet-stage:<stage>`; one that holds a device also
# `eaglet-device`. A tag concurrency limit on it (UI: Concurrency → Task Run → +, or `prefect
# concurrency-limit create eaglet-device 1`) lets that many such tasks run at once across every
# run and deployment (one per GPU). None is set by default: a killed run's slot is held until
# its lease expires.
DEVICE_TAG = "eaglet-device"


def stage_tags(stage: str) -> list[str]:
    return [f"eaglet-stage:{stage}"] + ([DEVICE_TAG] if STAGE[stage].holds_device else [])


def stage_task(stage: str, retries: int = 0, retry_delay_seconds: list[float] | None = None):
    """The Prefect task declaration of a stage: named `<stage>[<config name>]`, tagged by stage
    and device, cached by the stage key, its result persisted as JSON (the manifest), the
    failure hook above, and `retries` (with `retry_delay_seconds`) for transient faults only."""
    return task(
        name=stage,
        tags=stage_tags(stage),
        task_run_name=stage + "[{config.name}]",
        cache_policy=StageCache(stage=stage),
        on_failure=[report_stage_failure],  # says what the partial folder holds, how to resume
        persist_result=True,
        result_serializer="json",
        retries=retries,
        retry_delay_seconds=retry_delay_seconds or 0,
        retry_condition_fn=retry_only_transient,
    )
