"""A retried run that completes leaves no failure standing: the failure, crash and refusal
artifacts of its earlier attempts (`<stage>-failure`, `run-crashed`, `run-refused`) are
rewritten to say they were superseded and when, their old text kept below, so the run page
does not show a red report beside a Completed state."""

from __future__ import annotations

from datetime import UTC, datetime
from uuid import UUID

FAILURE_KEYS = ("run-crashed", "run-refused")  # and every `<stage>-failure`
SUPERSEDED = "**Superseded**"


def mark_failures_superseded(flow_run_id: UUID | str) -> int:
    """Rewrite every failure artifact of the flow run not yet marked (superseded first, then
    what it said); how many were."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    at = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    superseded = f"{SUPERSEDED}: a later attempt of this run completed at {at}; what follows is an "
    superseded += "earlier attempt's report.\n\n---\n\n"
    marked = 0
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        for artifact in found:
            text = artifact.data if isinstance(artifact.data, str) else ""
            key = artifact.key or ""
            failure = key.endswith("-failure") or key in FAILURE_KEYS
            if not failure or text.startswith(SUPERSEDED):
                continue
            client.update_artifact(
                artifact.id,
                ArtifactUpdate(
                    data=superseded + text,
                    description=f"superseded: a later attempt completed ({artifact.description})",
                ),
            )
            marked += 1
    return marked
