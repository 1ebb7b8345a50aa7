"""The train stage: feature shards (or, online, examples the target turns into features as
training goes) → an EAGLE-3 draft that vLLM/SGLang load. With train.nproc_per_node > 1 the
trainer runs under torchrun and its output is streamed here.

Training state lives in the stage's partial folder, so a retry or a rerun after a crash resumes
from the last checkpoint with the same draft vocabulary.
"""

from __future__ import annotations

from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

from eaglet.config import PipelineConfig
from eaglet.draft.engine_check import check_exports, engine_check_cells
from eaglet.draft.job import feature_disk, pipeline_job
from eaglet.draft.launch import run_training
from eaglet.draft.methods import draft_method
from eaglet.hidden_states.backends import hidden_states_backend
from eaglet.progress import Throttle
from eaglet.stage_context import StageContext, figures_markdown
from eaglet.stages import DRAFT_FOLDER, EXAMPLES_FILE, LOSS_PLOT_FILE
from eaglet.storage import Manifest, StageOutput, final_path, stage_dir


def run(
    ctx: StageContext, config: PipelineConfig, inputs: dict[str, Manifest], folder: Path
) -> StageOutput:
    """Offline (train.hidden_states: offline) from the hidden_states stage's `features`;
    online from the extract stage's `examples`, the target computing features as it trains."""
    online = config.train.hidden_states == "online"
    features = None if online else inputs["features"]
    features_dir = None if features is None else stage_dir(config.work_dir, features)
    examples_path = (
        stage_dir(config.work_dir, inputs["examples"]) / EXAMPLES_FILE if online else None
    )
    set_progress = ctx.progress("train-progress", "train: starting")
    throttle = Throttle()

    def progress(update: dict) -> None:
        if not throttle.ready(force=update["step"] == update["stop_at"]):
            return
        eta = timedelta(seconds=round(update["eta_s"]))
        line = (
            f"train step {update['step']}/{update['stop_at']}, loss {update['loss']:.4f}, "
            f"{update['tokens_per_s']:.0f} tokens/s, ETA {eta}"
        )
        ctx.info(f"{line}, acc {[round(a, 3) for a in update['acc']]}")
        set_progress(update["step"] / update["stop_at"], line)

    # Online, the servers the backend starts for a stage (hidden_states.vllm.vllm_python) serve
    # the features while training runs (otherwise `run_config` is `config`).
    backend = hidden_states_backend(config.hidden_states.backend)
    serving = backend.serving(config, folder, ctx.info) if online else nullcontext(config)
    with serving as run_config:
        job = pipeline_job(
            run_config,
            folder,
            features_dir=features_dir,
            features_info=None if features is None else features.info,
            examples_path=examples_path,
        )
        summary = run_training(job, progress=progress, log_line=ctx.info)
    method = draft_method(config.train.method)
    # engine -> folder (beside `draft/`) of every export, so tools outside find each
    k = method.positions(config.train)
    summary["exports"] = method.exports(folder / DRAFT_FOLDER, config.target, k)
    # before any export is recorded: the conventions engines read silently (vLLM's own parse
    # is the evaluate stage's, which knows the vLLM venv); a broken one fails the stage here
    summary["engine_checks"] = check_exports(
        method, folder, summary["exports"], job.aux_layer_ids, config.target, k
    )
    info = {
        "method": method.name,
        **summary,
        **feature_disk(config, features_dir, examples_path),
        "aux_layer_ids": job.aux_layer_ids,
        "aux_layer_convention": job.aux_layer_convention,
    }
    for name in ("draft_dir", "state_dir", "metrics_path", "loss_plot"):  # once finished
        if info.get(name):
            info[name] = str(final_path(Path(info[name])))
    ctx.markdown(
        "draft-training",
        figures_markdown("Draft training", {n: v for n, v in info.items() if n != "engine_checks"}),
        "the trained draft: vocabulary, samples, loss, exports and their folders",
    )
    ctx.table(
        "engine-check",
        [engine_check_cells(row) for row in summary["engine_checks"]],
        "each export held to the conventions its engine reads silently (architecture string, "
        "layer ids, block size, vocabulary); vLLM's own parse follows in evaluate",
    )
    ctx.image(
        "training-loss",
        folder / LOSS_PLOT_FILE,
        "training loss per step (held-out loss per epoch with train.keep_best)",
    )
    return StageOutput(counts={"records": int(summary.get("train_samples", 0))}, info=info)
