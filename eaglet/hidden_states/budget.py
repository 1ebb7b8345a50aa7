"""Disk budget of the hidden_states stage, checked before any work: what the shards will take
against the free space of the work dir's filesystem. Pure functions, also used by `eaglet
doctor` and the preflight."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from eaglet.errors import PermanentError
from eaglet.hidden_states.feature_encoding import bytes_per_token, check_storage

MARGIN_FRACTION = 0.05  # safetensors headers, index, progress records, filesystem slack
MARGIN_BYTES = 64 << 20


class DiskBudgetError(PermanentError, RuntimeError):
    """The work dir's filesystem cannot hold what the stage would write."""


@dataclass
class DiskBudget:
    needed: int
    free: int
    path: str
    storage: str
    tokens: int

    @property
    def fits(self) -> bool:
        return self.needed <= self.free


def estimate_bytes(num_tokens: int, hidden_size: int, storage: str) -> int:
    """Bytes the stage writes for `num_tokens` tokens of a target with `hidden_size`, stored
    as `storage`, plus a margin."""
    check_storage(storage)
    raw = num_tokens * bytes_per_token(hidden_size, storage)
    return int(raw * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


def _existing_parent(path: Path) -> Path:
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return path


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def disk_budget(
    work_dir: Path, num_tokens: int, hidden_size: int, storage: str, already_written: int = 0
) -> DiskBudget:
    """The estimate against `shutil.disk_usage` of the filesystem holding `work_dir` (bytes
    of finished shards that a resume keeps count as free)."""
    needed = max(0, estimate_bytes(num_tokens, hidden_size, storage) - already_written)
    where = _existing_parent(work_dir)
    return DiskBudget(needed, shutil.disk_usage(where).free, str(where), storage, num_tokens)


def check_disk_budget(
    work_dir: Path, num_tokens: int, hidden_size: int, storage: str, already_written: int = 0
) -> DiskBudget:
    """`disk_budget`, raising `DiskBudgetError` with both numbers and the options when the
    shards would not fit."""
    budget = disk_budget(work_dir, num_tokens, hidden_size, storage, already_written)
    if not budget.fits:
        per_token = bytes_per_token(hidden_size, storage)
        raise DiskBudgetError(
            f"hidden_states needs about {human(budget.needed)} ({budget.needed} bytes: "
            f"{num_tokens} tokens x {per_token} bytes per token in storage {storage!r}, plus "
            f"margin) but {budget.path} has {human(budget.free)} ({budget.free} bytes) free. "
            "Options: fewer samples (datasets[].limit), a shorter max length "
            "(generation.max_tokens, tokenize.max_prompt_tokens), compact storage "
            "(hidden_states.storage=int8 or fp8: 4·H bytes per token against 16·H for float32), "
            "a work_dir on another disk, or online training (train.hidden_states: online) that "
            "stores no shards."
        )
    return budget
