"""Run speculators 0.9.0's EAGLE-3 trainer on CPU and report its training throughput.

    .spec-venv/bin/python benchmarks/speculators_train.py --threads N -- <speculators train args>

Runs in the speculators venv (never imports eaglet). Sets torch's threads, applies three
runtime patches so the accelerator-only trainer runs on CPU, calls
`speculators.train.cli.main(TrainConfig.resolve(args))`, and prints one line
`SPECULATORS_RESULT {json}`. CPU needs `--draft-attn-impl sdpa --loss-implementation eager`
(flex-attention backward and the Triton loss need a GPU) and `--num-workers 0` (or few) on a
small machine. The data comes from benchmarks/speculators_data.py.

Tokens are counted as the trainer sees them: a forward pre-hook on the draft sums the real
(non-padding, `document_ids != -1`) positions of every batch it is called with in training
mode, over all epochs - the same count speculators' own per-step `tokens_per_s` profile uses.
Its eagle3 collate drops the first token of each sample (the shift), so this is sum(seq_len - 1)
over the training rows per epoch when nothing is truncated; validation batches are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _parse(argv: list[str]) -> tuple[int, list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: speculators_train.py --threads N -- <speculators train args>")
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, required=True)
    return parser.parse_args(argv[:split]).threads, argv[split + 1 :]


def main() -> None:
    threads, train_argv = _parse(sys.argv[1:])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)  # before torch is imported, so its pools start at N

    import speculators.train.trainer as trainer_mod
    import torch
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    torch.set_num_threads(threads)

    # CPU patches (speculators assumes an accelerator):
    # 1. the trainer moves the model and each batch to get_local_rank() (0 -> cuda:0)
    trainer_mod.get_local_rank = lambda: "cpu"
    # 2. its step timer calls torch.accelerator.synchronize(), which raises with no accelerator
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda device=None: None
    # 3. with no accelerator it autocasts on device "cuda"; autocast on the CPU instead
    trainer_mod.Trainer.device_type = property(lambda self: "cpu", lambda self, value: None)

    cfg = TrainConfig.resolve(train_argv)
    save_path = Path(cfg.trainer.save_path)
    if _epoch_dirs(save_path) and not cfg.trainer.no_resume_from_checkpoint:
        raise SystemExit(
            f"{save_path} already holds checkpoints (speculators would resume "
            "from them); use a fresh --save-path or --no-resume-from-checkpoint"
        )

    stats = {
        "tokens": 0,
        "loss_tokens": 0,
        "steps": 0,
        "epochs_run": 0,
        "train_loop_s": 0.0,
        "run_training_start": None,
    }

    def count_tokens(module, args, kwargs):  # forward pre-hook on the draft
        if module.training:
            real = kwargs["document_ids"] != -1  # [1, total_seq_len]
            stats["tokens"] += int(real.sum())
            mask = kwargs.get("loss_mask")
            if mask is not None:
                stats["loss_tokens"] += int((mask.bool() & real).sum())
            stats["steps"] += 1

    orig_init = trainer_mod.Trainer.__init__
    orig_train_epoch = trainer_mod.Trainer.train_epoch
    orig_run_training = trainer_mod.Trainer.run_training

    def init(self, model, *args, **kwargs):
        orig_init(self, model, *args, **kwargs)
        model.register_forward_pre_hook(count_tokens, with_kwargs=True)

    def train_epoch(self, *args, **kwargs):  # fetch + forward + backward + optimizer steps
        t0 = time.perf_counter()
        try:
            return orig_train_epoch(self, *args, **kwargs)
        finally:
            stats["train_loop_s"] += time.perf_counter() - t0
            stats["epochs_run"] += 1

    def run_training(self, *args, **kwargs):
        stats["run_training_start"] = time.perf_counter()
        return orig_run_training(self, *args, **kwargs)

    trainer_mod.Trainer.__init__ = init
    trainer_mod.Trainer.train_epoch = train_epoch
    trainer_mod.Trainer.run_training = run_training

    t0 = time.perf_counter()
    train_main(cfg)
    main_s = time.perf_counter() - t0

    start = stats["run_training_start"]
    # setup: config, draft + verifier weights, data loaders, optimizer (until run_training)
    setup_s = (start - t0) if start is not None else None
    run_training_s = (t0 + main_s - start) if start is not None else None
    loop_s = stats["train_loop_s"]
    epochs = _epoch_dirs(save_path)
    final = save_path / str(max(epochs)) if epochs else None
    result = {
        "main_s": round(main_s, 3),  # the whole speculators main() call
        "setup_s": None if setup_s is None else round(setup_s, 3),
        "train_loop_s": round(loop_s, 3),  # sum of train_epoch calls (no validation / saving)
        "val_and_checkpoint_s": (
            None if run_training_s is None else round(run_training_s - loop_s, 3)
        ),
        "train_tokens": stats["tokens"],  # real positions the draft trained on, all epochs
        "train_loss_tokens": stats["loss_tokens"],  # of which loss-masked (supervised)
        "train_steps": stats["steps"],
        "tokens_per_s": round(stats["tokens"] / loop_s, 1) if loop_s > 0 else None,
        "tokens_per_s_main": round(stats["tokens"] / main_s, 1) if main_s > 0 else None,
        "epochs": cfg.trainer.epochs,
        "epochs_run": stats["epochs_run"],
        "threads": threads,
        "final_checkpoint": None if final is None else str(final),
    }
    print("SPECULATORS_RESULT " + json.dumps(result), flush=True)


def _epoch_dirs(save_path: Path) -> list[int]:
    """Numbered epoch checkpoint folders (config.json + model.safetensors) under save_path."""
    if not save_path.is_dir():
        return []
    return [
        int(d.name)
        for d in save_path.iterdir()
        if d.name.isdigit() and not d.is_symlink() and (d / "model.safetensors").exists()
    ]


if __name__ == "__main__":
    main()
