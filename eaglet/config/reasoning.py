"""`reasoning`: how the target marks its reasoning, and the quality gates of the split
(`ReasoningConfig`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from eaglet.config_fields import Strict


class ReasoningConfig(Strict):
    model_config = ConfigDict(title="Reasoning split")  # the UI form's heading

    format: Literal["auto", "think_open_in_prompt", "think_in_output", "harmony", "none"] = Field(
        "auto",
        description="How the target marks its reasoning. auto = detect from the tokenizer and "
        "chat template; think_open_in_prompt = the prompt ends with <think> (Qwen3-thinking, "
        "DeepSeek-R1); think_in_output = the model writes <think> itself (Qwen3 hybrid); "
        "harmony = gpt-oss analysis/final channels; none = no reasoning.",
    )
    min_capture_rate: float = Field(
        0.8,
        ge=0.0,
        le=1.0,
        description="Quality gate: fail when, in any source, fewer records than this have "
        "their reasoning split out and closed (formats that reason; truncated records are "
        "judged by max_truncation_rate). 0.8 lets a model's sporadic quirk pass (the demo's "
        "2M-parameter target leaves about one tool answer in eight unclosed) and stops a "
        "systematic fault (a stripped tag or wrong template kwargs capture ~0%).",
    )
    max_truncation_rate: float = Field(
        0.2, ge=0.0, le=1.0, description="Quality gate: fail when more records hit max_tokens."
    )
    looped_rows: Literal["drop", "keep"] = Field(
        "drop",
        description="Records the loop guard stopped (finish_reason 'loop'): drop = no "
        "training example (counted as looped in the quality report); keep = train on the "
        "answer up to where it was stopped, like a truncated one.",
    )
    max_thinking_in_answer_rate: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="Quality gate: fail when, in any source, more records than this have no "
        "reasoning split out yet think tags in the answer (the seeds' signature: thinking "
        "trained as the answer, e.g. reasoning.format or chat_template_kwargs wrong).",
    )
    max_prompt_mismatch_rate: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="Quality gate: fail when, in any source, more records than this were "
        "generated from other prompt ids than the configured chat template renders (a server "
        "that rendered with its own template or kwargs, as in SpecForge #296).",
    )
