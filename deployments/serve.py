"""Serve eaglet's deployments from one process: the whole pipeline (its full form, and a short
form of the settings most runs change), generation alone, and the two that keep a draft
following its target (`watch`, hourly, and `refresh`, started by its trigger on
`eaglet.target.changed`: deployments/follow.py).

    python deployments/serve.py        (or: eaglet serve)

Runs started from the Prefect UI or API execute in this process. For a work pool setup use
`deployments/prefect.yaml` instead.

Each deployment runs one flow run at a time: a second one (a double click, a schedule firing
during a manual run) waits in AwaitingConcurrencySlot and starts when the first ends, instead
of failing on the work-dir lock.

A run is named (`pipeline[<config name>]`) as soon as it exists, queued or scheduled, not only
once it starts (`flows/run_names.py`).

Schedules added in the UI outlive a restart: serving registers each deployment anew, which
may replace its schedules with the ones given (none), so the schedules the server holds for it
are read first and given back.
"""

from __future__ import annotations

import threading

from prefect import serve
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentScheduleCreate
from prefect.client.schemas.objects import ConcurrencyLimitConfig
from prefect.exceptions import ObjectNotFound

from eaglet.cache import pipeline_code_version
from eaglet.stages import PRODUCER
from eaglet_prefect.deployments.follow import refresh_trigger, watch_schedule
from eaglet_prefect.flows.follow import refresh, watch
from eaglet_prefect.flows.pipeline import pipeline
from eaglet_prefect.flows.run_names import name_new_runs
from eaglet_prefect.flows.short_form import short_form

# Runs of one deployment write the same work dir (its lock admits one): queue, never collide.
ONE_RUN_AT_A_TIME = ConcurrencyLimitConfig(limit=1, collision_strategy="ENQUEUE")


def existing_schedules(
    deployment: str, flow_name: str = pipeline.name
) -> list[DeploymentScheduleCreate]:
    """The schedules the Prefect server holds for `<flow>/<deployment>` (added in the UI or
    by an earlier serve), active or not; none for a deployment it does not know."""
    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(f"{flow_name}/{deployment}")
        except ObjectNotFound:
            return []
    return [
        DeploymentScheduleCreate(
            schedule=s.schedule,
            active=s.active,
            max_scheduled_runs=s.max_scheduled_runs,
            parameters=s.parameters,
            slug=s.slug,
        )
        for s in found.schedules
    ]


def main() -> None:
    version = pipeline_code_version()  # the code these deployments run, edits included
    stop_naming = threading.Event()
    name_new_runs(stop_naming)  # a queued or scheduled run shows its name, not a random one
    try:
        serve_deployments(version)
    finally:
        stop_naming.set()


def serve_deployments(version: str) -> None:
    serve(
        pipeline.to_deployment(
            name="pipeline",
            description="The whole pipeline: download to evaluate.",
            tags=["eaglet"],
            version=version,
            schedules=existing_schedules("pipeline"),
            concurrency_limit=ONE_RUN_AT_A_TIME,
        ),
        short_form.to_deployment(
            name="pipeline-short-form",
            description="The whole pipeline with only the settings most runs change (target, "
            "datasets, engine and endpoints, epochs, work dir) over a base config; blank keeps "
            "the base's. Every setting is in the form of `pipeline`.",
            tags=["eaglet"],
            version=version,
            schedules=existing_schedules("pipeline-short-form", short_form.name),
            concurrency_limit=ONE_RUN_AT_A_TIME,
        ),
        pipeline.to_deployment(
            name="generate-only",
            description="Download, tokenize and generate; stops before extraction.",
            parameters={"until": PRODUCER["generations"]},
            tags=["eaglet", "generation"],
            version=version,
            schedules=existing_schedules("generate-only"),
            concurrency_limit=ONE_RUN_AT_A_TIME,
        ),
        watch.to_deployment(
            name="watch",
            description="Fingerprint a work dir's target; emit eaglet.target.changed when its "
            "draft was trained on another one (never downloads or trains). Hourly.",
            tags=["eaglet", "follow"],
            version=version,
            schedules=existing_schedules("watch", watch.name)
            or [DeploymentScheduleCreate(schedule=watch_schedule(), active=True)],
        ),
        refresh.to_deployment(
            name="refresh",
            description="Measure the work dir's draft on its changed target; keep it, or train "
            "from it and promote the better draft. Started by eaglet.target.changed, or by hand.",
            tags=["eaglet", "follow"],
            version=version,
            schedules=existing_schedules("refresh", refresh.name),
            concurrency_limit=ONE_RUN_AT_A_TIME,
            triggers=[refresh_trigger()],
        ),
    )


if __name__ == "__main__":
    main()
