"""The generate stage's record: what the target produced for one prompt."""

from __future__ import annotations

from typing import Any, Literal

from eaglet.records.io import Record
from eaglet.records.prompts import Prompt

# "loop": the loop guard ended a repeating answer (eaglet.loop_guard)
FinishReason = Literal["stop", "length", "loop", "error"]


class Generation(Record):
    """What the target produced for one prompt, token-exact where the engine allows."""

    sample_id: str
    source: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: FinishReason
    engine: str
    token_exact: bool = True
    raw: dict[str, Any] = {}
    # generation.sampling_plan: the entry the row was generated with, from its prompt
    sampling: dict[str, Any] | None = None

    @classmethod
    def answering(
        cls,
        prompt: Prompt,
        output_ids: list[int],
        finish_reason: FinishReason,
        engine: str,
        token_exact: bool = True,
        raw: dict[str, Any] | None = None,
    ) -> Generation:
        """The record of `prompt` answered with `output_ids`."""
        return cls(
            sample_id=prompt.sample_id,
            source=prompt.source,
            prompt_ids=prompt.prompt_ids,
            output_ids=output_ids,
            finish_reason=finish_reason,
            engine=engine,
            token_exact=token_exact,
            raw=raw or {},
            sampling=prompt.sampling,
        )
