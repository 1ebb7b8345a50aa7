"""Which samples are held out of training for evaluation: a pure function of the sample id."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from eaglet.records.prompts import conversation_id


def is_heldout(sample_id: str, fraction: float) -> bool:
    """True for about `fraction` of ids, always the same ones, whatever the order or the run.
    The turns of one conversation are held out together."""
    key = conversation_id(sample_id)
    bucket = int(hashlib.sha256(f"holdout:{key}".encode()).hexdigest()[:8], 16)
    return bucket / 0x1_0000_0000 < fraction


def heldout_ids(sample_ids: Iterable[str], fraction: float) -> set[str]:
    """The ids among `sample_ids` held out of training (for evaluation), as `is_heldout` says."""
    return {sample_id for sample_id in sample_ids if is_heldout(sample_id, fraction)}
