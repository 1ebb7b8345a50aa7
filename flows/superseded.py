"""A retried run that completes leaves no failure standing: the failure, crash and refusal
artifacts of its earlier attempts (`<stage>-failure`, `run-crashed`, `run-refused`) are
rewritten to say they were superseded and when, their old text kept below, so the run page
does not show a red report beside a Completed state."""

from __future__ import annotations

from datetime import UTC, datetime
from uuid import UUID

FAILURE_KEYS = ("run-crashed", "run-refused")  # and every `<stage>-failure`
SUPERSEDED = "**Superseded**"


def is_failure_key(key: str | None) -> bool:
    return bool(key) and (key.endswith("-failure") or key in FAILURE_KEYS)


def superseded_markdown(old: str, when: datetime) -> str:
    """The artifact's new text: superseded first, then what it said."""
    at = when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (
        f"{SUPERSEDED}: a later attempt of this run completed at {at}; what follows is an "
        f"earlier attempt's report.\n\n---\n\n{old}"
    )


def mark_failures_superseded(flow_run_id: UUID | str) -> int:
    """Rewrite every failure artifact of the flow run not yet marked; how many were."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    now = datetime.now(UTC)
    marked = 0
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        for artifact in found:
            text = artifact.data if isinstance(artifact.data, str) else ""
            if not is_failure_key(artifact.key) or text.startswith(SUPERSEDED):
                continue
            client.update_artifact(
                artifact.id,
                ArtifactUpdate(
                    data=superseded_markdown(text, now),
                    description=f"superseded: a later attempt completed ({artifact.description})",
                ),
            )
            marked += 1
    return marked
