"""The train stage as a Prefect task: feature shards → an EAGLE-3 draft that vLLM/SGLang load.

Training state lives in the stage's partial folder, so a retry or a rerun after a crash
resumes from the last checkpoint with the same draft vocabulary.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)

from eaglet.config import PipelineConfig
from eaglet.draft.train import TrainSettings, train_draft
from eaglet.split import is_heldout
from eaglet.storage import StageOutput
from tasks.caching import run_stage_task, stage_task


def _heldout_ids(features_dir: Path, fraction: float) -> set[str]:
    with open(features_dir / "index.jsonl", encoding="utf-8") as handle:
        ids = [json.loads(line)["sample_id"] for line in handle if line.strip()]
    return {i for i in ids if is_heldout(i, fraction)}


@stage_task("train", retries=1)  # resumes from the last checkpoint
def train(config: PipelineConfig, features: dict, refresh: bool = False) -> dict:
    logger = get_run_logger()
    features_dir = Path(features["path"])
    progress_id = create_progress_artifact(progress=0.0, description="train: steps done")
    last = [0.0]

    def progress(update: dict) -> None:
        if time.time() - last[0] < 5 and update["step"] != update["total_steps"]:
            return
        last[0] = time.time()
        logger.info(
            "train step %d/%d loss %.4f acc %s %.0f tok/s",
            update["step"],
            update["total_steps"],
            update["loss"],
            [round(a, 3) for a in update.get("acc", [])],
            update.get("tokens_per_s", 0),
        )
        update_progress_artifact(
            progress_id, progress=100.0 * update["step"] / update["total_steps"]
        )

    def body(folder: Path) -> StageOutput:
        settings = config.train
        summary = train_draft(
            hidden_states_dir=features_dir,
            target_model_dir=Path(config.target.model),
            out_dir=folder,
            settings=TrainSettings(
                epochs=settings.epochs,
                lr=settings.lr,
                batch_size=settings.batch_size,
                ttt_length=settings.ttt_length,
                draft_vocab_size=settings.draft_vocab_size,
                max_seq_len=settings.max_seq_len,
                seed=settings.seed,
            ),
            aux_layer_ids=features["info"]["aux_layer_ids"],
            aux_layer_convention=features["info"]["aux_layer_convention"],
            exclude_sample_ids=_heldout_ids(features_dir, settings.holdout_fraction),
            progress=progress,
            resume=True,
        )
        create_markdown_artifact(
            "# Draft training\n\n" + "\n".join(f"- **{k}**: {v}" for k, v in summary.items()),
            key="draft-training",
        )
        info = {
            **summary,
            "aux_layer_ids": features["info"]["aux_layer_ids"],
            "aux_layer_convention": features["info"]["aux_layer_convention"],
        }
        return StageOutput(counts={"records": int(summary.get("train_samples", 0))}, info=info)

    return run_stage_task(
        "train", config, {"features": features}, body, resume_partial=True, refresh=refresh
    ).model_dump()
