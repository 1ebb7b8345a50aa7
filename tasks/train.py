"""The train stage as a Prefect task: feature shards (or, online, examples the target turns into
features as training goes) → an EAGLE-3 draft that vLLM/SGLang load. With
train.nproc_per_node > 1 the trainer runs under torchrun and its output is streamed here.

Training state lives in the stage's partial folder, so a retry or a rerun after a crash
resumes from the last checkpoint with the same draft vocabulary.
"""

from __future__ import annotations

from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)

from eaglet.config import PipelineConfig
from eaglet.draft.export import write_exports
from eaglet.draft.launch import feature_disk, pipeline_job, run_training
from eaglet.hidden_states.vllm import started_server
from eaglet.progress import Throttle
from eaglet.storage import StageOutput, stage_dir
from tasks.artifacts import final_path, publish_plot
from tasks.caching import run_stage_task, stage_task


@stage_task("train", retries=1)  # resumes from the last checkpoint
def train(
    config: PipelineConfig,
    features: dict | None = None,
    examples: dict | None = None,
    refresh: bool = False,
) -> dict:
    """Offline (train.hidden_states: offline) from the hidden_states stage's `features`;
    online from the extract stage's `examples`, the target computing features as it trains."""
    logger = get_run_logger()
    online = config.train.hidden_states == "online"
    if online and examples is None or not online and features is None:
        raise ValueError(
            f"train.hidden_states={config.train.hidden_states} needs the "
            f"{'examples' if online else 'features'} stage output"
        )
    features_dir = None if online else stage_dir(config.work_dir, features)
    examples_path = stage_dir(config.work_dir, examples) / "examples.jsonl" if online else None
    progress_id = create_progress_artifact(
        progress=0.0, key="train-progress", description="train: starting"
    )
    throttle = Throttle()

    def progress(update: dict) -> None:
        if not throttle.ready(force=update["step"] == update["stop_at"]):
            return
        eta = timedelta(seconds=round(update["eta_s"]))
        line = (
            f"train step {update['step']}/{update['stop_at']}, loss {update['loss']:.4f}, "
            f"{update['tokens_per_s']:.0f} tokens/s, ETA {eta}"
        )
        logger.info("%s, acc %s", line, [round(a, 3) for a in update["acc"]])
        update_progress_artifact(
            progress_id, progress=100.0 * update["step"] / update["stop_at"], description=line
        )

    def body(folder: Path) -> StageOutput:
        # Online with hidden_states.vllm_python: a vLLM server of eaglet's own serves the
        # features while training runs (otherwise `run` is `config`).
        with started_server(config, folder, logger.info) if online else nullcontext(config) as run:
            job = pipeline_job(
                run,
                folder,
                features_dir=features_dir,
                features_info=None if online else features["info"],
                examples_path=examples_path,
            )
            summary = run_training(job, config.train.nproc_per_node, progress, logger.info)
        summary["exports"] = write_exports(folder / "draft", config.target, config.train.ttt_length)
        info = {
            **summary,
            **feature_disk(config, features_dir, examples_path),
            "aux_layer_ids": job["aux_layer_ids"],
            "aux_layer_convention": job["aux_layer_convention"],
        }
        for name in ("draft_dir", "state_dir", "metrics_path", "loss_plot"):  # once finished
            if info.get(name):
                info[name] = str(final_path(Path(info[name])))
        create_markdown_artifact(
            "# Draft training\n\n" + "\n".join(f"- **{k}**: {v}" for k, v in info.items()),
            key="draft-training",
            description="the trained draft: vocabulary, samples, loss, exports and their folders",
        )
        publish_plot(
            folder / "loss.png",
            key="training-loss",
            description="training loss per step (held-out loss per epoch with train.keep_best)",
        )
        return StageOutput(counts={"records": int(summary.get("train_samples", 0))}, info=info)

    upstream = {"examples": examples} if online else {"features": features}
    return run_stage_task(
        "train", config, upstream, body, resume_partial=True, refresh=refresh
    ).model_dump()
