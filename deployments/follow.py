"""The loop that keeps a draft following its target, as deployments: `watch` (hourly) emits
`eaglet.target.changed` when a work dir's target is not the one its draft was trained on, and
`refresh` carries a trigger on that event that starts it for that work dir (`flows/follow.py`
holds both flows).

The trigger is the deployment's own (Prefect makes it an automation named after it, and
registering the deployment again updates it in place, never doubles it): `eaglet serve`
registers both deployments, `prefect deploy` of `deployments/prefect.yaml` the same ones.
"""

from __future__ import annotations

from datetime import timedelta

from prefect.client.schemas.schedules import IntervalSchedule
from prefect.events import DeploymentEventTrigger

from eaglet.refresh import CHANGED_EVENT


def watch_schedule() -> IntervalSchedule:
    return IntervalSchedule(interval=timedelta(hours=1))


def refresh_trigger() -> DeploymentEventTrigger:
    """On each `eaglet.target.changed`, a run of the refresh deployment for the event's work
    dir."""
    return DeploymentEventTrigger(
        name="eaglet: refresh a draft when its target changes",
        description="The watch deployment emits the event (eaglet serve / prefect.yaml).",
        expect={CHANGED_EVENT},
        posture="Reactive",
        threshold=1,
        parameters={"work_dir": "{{ event.payload.work_dir }}"},
    )
