"""`tokenize`: how the prompts are rendered with the target's chat template, and which
assistant turns are regenerated (`TokenizeConfig`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from eaglet.config_fields import Strict


class TokenizeConfig(Strict):
    model_config = ConfigDict(title="Tokenize (chat template)")  # the UI form's heading

    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments for apply_chat_template (e.g. enable_thinking).",
    )
    max_prompt_tokens: int = Field(
        768, ge=8, description="Prompts longer than this are dropped and counted in the manifest."
    )
    regenerate: Literal["last", "all"] = Field(
        "last",
        description="Which assistant turns to regenerate: 'last' drops the final assistant turn "
        "and asks the target to answer the conversation so far; 'all' regenerates every "
        "assistant turn in order, feeding the target its own earlier answers (one training "
        "example per turn).",
    )
