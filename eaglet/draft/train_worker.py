"""One torchrun process of a training job: `python -m eaglet.draft.train_worker JOB.json`.

Joins the process group (NCCL when training on CUDA, else gloo), trains its share of every
global batch (eaglet/draft/train.py), and on rank 0 prints progress records for the launcher
(eaglet/draft/launch.py) and writes the summary next to the job.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from eaglet.config.train import TrainConfig
from eaglet.draft.launch import PROGRESS_PREFIX, SUMMARY_FILE, run_job
from eaglet.draft.train import training_device


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m eaglet.draft.train_worker JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    train = TrainConfig.model_validate(job["train"])
    device = training_device(train)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank {rank}] %(message)s",
    )

    def progress(record: dict) -> None:
        print(PROGRESS_PREFIX + json.dumps(record), flush=True)

    try:
        summary = run_job(job, progress)
        if rank == 0:
            (Path(job["out_dir"]) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
