"""What each training step trained on, agreed across processes, and how fast each side went.

- The ledger (`LEDGER_FILE`, one line per optimizer step: `step`, `epoch`, `windows`): the
  training windows (indices into the run's data: its samples less the held-out ones, cut at
  train.max_seq_len, in order) whose features every process's micro-batches of that step
  actually held. Global rank 0 writes it; a resume cuts it back to the checkpoint's step, as
  it cuts `metrics.jsonl`, so each epoch's steps list every window exactly once, across kills
  and resumes (`tests/test_train_nodes_vllm.py` counts them).
- The stop agreement: a signal seen by one process stops every process after the same step
  (otherwise the others wait at the next step's all-reduce for a peer that left).
- `throughput`: at the end, each rank's trained samples per second of its own compute and the
  seconds it waited for features, each capture server's samples, and which side bounded the
  run (the run report's split line).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

LEDGER_FILE = "trained_windows.jsonl"
CAPTURE_BOUND_WAIT = 0.1  # ranks waiting for features this share of their step time: capture-bound


def agree(world: int, windows: list[int], stop: bool) -> tuple[list[int], bool]:
    """Every process's windows of this step (sorted) and whether any process must stop."""
    if world == 1:
        return sorted(windows), stop
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (windows, stop))
    return sorted(w for ws, _ in gathered for w in ws), any(s for _, s in gathered)


def append(out_dir: Path, step: int, epoch: int, windows: list[int]) -> None:
    with (out_dir / LEDGER_FILE).open("a") as f:
        f.write(json.dumps({"step": step, "epoch": epoch, "windows": windows}) + "\n")


def cut_back(out_dir: Path, step: int) -> None:
    """Keep the ledger's lines up to `step` (a resumed run's checkpoint)."""
    path = out_dir / LEDGER_FILE
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


def read(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / LEDGER_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def throughput(world: int, mine: dict) -> dict | None:
    """The run's rates on global rank 0 (None elsewhere): `mine` is this rank's `samples`,
    `compute_s` (its step seconds less its waits), `wait_s` and `servers` (url -> samples,
    busy_s, retries; empty when features are not served)."""
    ranks: list[Any] = [mine]
    if world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    servers: dict[str, dict] = {}
    for r in ranks:
        for url, s in r["servers"].items():
            total = servers.setdefault(url, {"samples": 0, "busy_s": 0.0, "retries": 0})
            total["samples"] += s["samples"]
            total["busy_s"] = max(total["busy_s"], s["busy_s"])  # ranks overlap in time
            total["retries"] += s["retries"]
    for s in servers.values():
        s["samples_per_s"] = s["samples"] / max(s["busy_s"], 1e-9)
    waited = sum(r["wait_s"] for r in ranks)
    stepping = sum(r["compute_s"] + r["wait_s"] for r in ranks)
    bound = "capture" if waited > CAPTURE_BOUND_WAIT * stepping else "training"
    return {
        "ranks": [
            {
                "rank": i,
                "samples": r["samples"],
                "samples_per_s": r["samples"] / max(r["compute_s"], 1e-9),
                "wait_s": r["wait_s"],
            }
            for i, r in enumerate(ranks)
        ],
        "servers": servers,
        "wait_share": waited / max(stepping, 1e-9),
        "bound": bound if servers else None,
    }
