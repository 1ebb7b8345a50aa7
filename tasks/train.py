"""The train stage as a Prefect task (its work: `train_body.run`). Training state
lives in the stage's partial folder, so a retry resumes from the last checkpoint."""

from __future__ import annotations

from eaglet.config import PipelineConfig
from eaglet.stage_bodies import train as train_body
from eaglet_prefect.tasks.caching import run_stage_task, stage_task


@stage_task("train", retries=1)  # resumes from the last checkpoint
def train(
    config: PipelineConfig,
    features: dict | None = None,
    examples: dict | None = None,
    refresh: bool = False,
) -> dict:
    """Offline (train.hidden_states: offline) from the hidden_states stage's `features`;
    online from the extract stage's `examples`."""
    online = config.train.hidden_states == "online"
    if online and examples is None or not online and features is None:
        raise ValueError(
            f"train.hidden_states={config.train.hidden_states} needs the "
            f"{'examples' if online else 'features'} stage output"
        )
    inputs = {"examples": examples} if online else {"features": features}
    return run_stage_task("train", train_body.run, config, inputs, refresh=refresh)
