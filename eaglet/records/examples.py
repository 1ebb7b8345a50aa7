"""The extract stage's record: one training sequence, split and masked."""

from __future__ import annotations

from typing import Any

from eaglet.records.generations import FinishReason
from eaglet.records.io import Record


class Example(Record):
    """One training sequence: the prompt and the target's own answer, split and masked."""

    sample_id: str
    source: str
    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]] = []
    input_ids: list[int]
    loss_mask: list[int]
    finish_reason: FinishReason
    flags: list[str] = []
