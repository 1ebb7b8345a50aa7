"""What a flow run of eaglet is called (`pipeline[<config name>]`, then the draft method of a
run that trains, `until` and `refresh from` when set, and `(plan)` for a plan-only run), so
that the run list tells a DFlash training from an EAGLE-3 one and a plan from a run; and the
naming of new runs as soon as they exist: Prefect names a run at
random when it is created (a Submit, a schedule) and applies the flow's `flow_run_name` only
when it starts, so a queued or scheduled run would show as `rich-mammoth`. `eaglet serve`
runs `name_new_runs` beside its runner: every few seconds it gives each not-yet-started run of
eaglet's flows its real name, and tells each run waiting for its deployment's slot
(AwaitingConcurrencySlot, a state Prefect gives no message) which run it waits for, in a
line of its log."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import LogCreate
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateName,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType

from eaglet.config import PipelineConfig, load_config
from eaglet.stages import PRODUCER, STAGES

FLOWS = ("eaglet-pipeline", "eaglet-pipeline-short-form")
NAMING_EVERY_S = 2.0
NAMED = "pipeline["  # how every name `run_label` gives begins (Prefect's own never does)
TRAINS = STAGES[STAGES.index(PRODUCER["draft"]) :]  # a run stopping at one of these trains a draft


def run_label(name: str, parameters: dict[str, Any], method: str | None = None) -> str:
    """`pipeline[<config name>]`, then `method` when the run trains, `until` and `refresh
    from` when they are set, and `(plan)` for a plan-only run."""
    label = f"{NAMED}{name}]"
    until = parameters.get("until") or STAGES[-1]
    if method and until in TRAINS:
        label += f" {method}"
    if until != STAGES[-1]:
        label += f" until {until}"
    if parameters.get("refresh_from"):
        label += f" refresh from {parameters['refresh_from']}"
    if parameters.get("plan_only"):
        label += " (plan)"
    return label


def run_label_of(parameters: dict[str, Any]) -> str:
    """The name of a run with these parameters (the full form's `config`, or a config file's
    name; the short form's base is its `config_path`, else the demo's defaults)."""
    try:
        if parameters.get("config_path"):
            config = load_config(parameters["config_path"])
        else:
            config = PipelineConfig.model_validate(parameters.get("config") or {})
    except (ValueError, OSError):  # the flow itself reports the bad config when it starts
        return run_label("?", parameters)
    return run_label(config.name, parameters, config.train.method)


def name_waiting_runs() -> None:
    """Rename every scheduled or pending run of eaglet's flows that does not carry its name
    yet."""
    waiting = FlowRunFilter(
        state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING])
        )
    )
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=list(FLOWS))),
            flow_run_filter=waiting,
            limit=200,
        )
        for run in runs:
            if run.name.startswith(NAMED):  # named already: its config file is not read again
                continue
            name = run_label_of(dict(run.parameters))
            if run.name != name:
                client.update_flow_run(run.id, name=name)


WAITING = "AwaitingConcurrencySlot"


def explain_waiting_runs(told: set[str]) -> None:
    """Log, once on each run of eaglet's flows waiting for its deployment's slot (ids in
    `told`), which run of the deployment holds it."""
    eaglet = FlowFilter(name=FlowFilterName(any_=list(FLOWS)))
    state = FlowRunFilterState(name=FlowRunFilterStateName(any_=[WAITING]))
    logs = []
    with get_client(sync_client=True) as client:
        waiting = client.read_flow_runs(
            flow_filter=eaglet, flow_run_filter=FlowRunFilter(state=state), limit=200
        )
        for run in waiting:
            if str(run.id) in told or run.deployment_id is None:
                continue
            running = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))
            holders = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[run.deployment_id])),
                flow_run_filter=FlowRunFilter(state=running),
                limit=5,
            )
            if not holders:  # between two runs: the slot frees within seconds
                continue
            names = ", ".join(f"{h.name} (flow run {h.id})" for h in holders)
            message = (
                f"waits for {names}: this deployment runs one flow run at a time; this one "
                "starts when that one ends"
            )
            logs.append(LogCreate(name="eaglet", level=20, message=message,
                                  timestamp=datetime.now(UTC), flow_run_id=run.id))  # fmt: skip
            told.add(str(run.id))
        if logs:
            client.create_logs(logs)


def name_new_runs(stop: threading.Event) -> None:
    """Start a daemon thread that names waiting runs, and tells a run waiting for its
    deployment's slot what it waits for, every `NAMING_EVERY_S` until `stop`; a failed round
    (a busy server) is tried again at the next."""
    told: set[str] = set()

    def loop() -> None:
        while not stop.wait(NAMING_EVERY_S):
            try:
                name_waiting_runs()
                explain_waiting_runs(told)
            except Exception:  # noqa: BLE001 - names are cosmetic: never stop serving
                continue

    threading.Thread(target=loop, name="eaglet-run-names", daemon=True).start()
