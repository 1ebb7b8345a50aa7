"""The download stage's record: one conversation from a dataset."""

from __future__ import annotations

from typing import Any

from eaglet.records.io import Record


class Sample(Record):
    """One conversation from a dataset, normalised to OpenAI-style messages."""

    sample_id: str
    source: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
