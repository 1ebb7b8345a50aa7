"""The tokenize stage's record: the chat-templated prompt the target answers."""

from __future__ import annotations

from typing import Any

from eaglet.records.io import Record

# Sample ids of the later turns of a conversation regenerated turn by turn: `<id>#turn<k>`.
TURN_SEPARATOR = "#turn"


def conversation_id(sample_id: str) -> str:
    """The conversation a (turn) record belongs to."""
    return sample_id.split(TURN_SEPARATOR, 1)[0]


class Prompt(Record):
    """The chat-templated prompt the target answers: everything before the regenerated turn."""

    sample_id: str
    source: str
    prompt_ids: list[int]
    prompt_text: str
    # The conversation the prompt renders, for engines that take messages (openai).
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    # tokenize.regenerate="all": the dataset's user/tool messages after each later assistant
    # turn, one list per turn still to regenerate (see eaglet/turns.py).
    followups: list[list[dict[str, Any]]] = []
    # generation.sampling_plan: the entry this row is generated with (eaglet/sampling_plan.py)
    sampling: dict[str, Any] | None = None
