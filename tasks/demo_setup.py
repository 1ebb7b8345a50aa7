"""The demo's set-up as a task of its own: a UI run of the demo's config on a fresh checkout
builds the fixture model (minutes) and the sample data here, so the run page shows a task,
log lines with rate and ETA, and a progress bar from the first seconds instead of nothing."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from eaglet.config import PipelineConfig
from eaglet.fixture.demo import ensure_demo_inputs
from eaglet_prefect.tasks.context import progress_bar


@task(name="demo-setup", task_run_name="demo-setup")
def demo_setup(config: PipelineConfig) -> list[str]:
    """Build what the demo's config points at and is missing; the paths built."""
    logger = get_run_logger()
    progress_id = create_progress_artifact(
        0.0, key="demo-setup-progress", description="the demo's fixture model: training steps"
    )

    def progress(done: int, total: int) -> None:
        text = f"{progress_bar(done / total)} the demo's fixture model: {done}/{total} steps"
        update_progress_artifact(progress_id, 100.0 * done / total, description=text)

    built = ensure_demo_inputs(config, log=logger.info, progress=progress)
    update_progress_artifact(progress_id, 100.0, description=f"{progress_bar(1.0)} built")
    return [str(path) for path in built]
