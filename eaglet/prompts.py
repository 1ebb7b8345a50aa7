"""Turning a sample into the prompt the target answers, with the target's own chat template.

With `regenerate="last"` the regenerated turn is the last assistant message: everything before
it is rendered with `add_generation_prompt=True`, so the prompt ends exactly where the target
starts writing (for thinking models, after the template's opening `<think>`). With
`regenerate="all"` the prompt is the one of the first assistant turn, and the messages the
dataset has between later assistant turns travel along as `followups` (eaglet/turns.py).
"""

from __future__ import annotations

from typing import Any

from eaglet.records.prompts import Prompt
from eaglet.records.samples import Sample


class PromptError(ValueError):
    """A sample that cannot be turned into a prompt; the message names the sample."""


def load_tokenizer(model: str, trust_remote_code: bool = False, revision: str | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        model, trust_remote_code=trust_remote_code, revision=revision
    )


def conversation_before_last_answer(sample: Sample) -> list[dict[str, Any]]:
    """Messages up to (not including) the last assistant turn; all of them if there is none."""
    messages = sample.messages
    last_assistant = max(
        (i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None
    )
    context = messages if last_assistant is None else messages[:last_assistant]
    if not context or context[-1]["role"] not in ("user", "tool"):
        raise PromptError(
            f"sample {sample.sample_id} ({sample.source}): the turn before the regenerated "
            f"answer must be a user or tool message, got "
            f"{context[-1]['role'] if context else 'nothing'}"
        )
    return context


def conversation_turns(
    sample: Sample,
) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """(messages before the first assistant turn, the messages between each assistant turn and
    the next); messages after the last assistant turn are dropped."""
    messages = sample.messages
    assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_at:
        return conversation_before_last_answer(sample), []
    segments = [messages[: assistant_at[0]]]
    segments += [messages[a + 1 : b] for a, b in zip(assistant_at, assistant_at[1:], strict=False)]
    for turn, segment in enumerate(segments, start=1):
        if not segment or segment[-1]["role"] not in ("user", "tool"):
            raise PromptError(
                f"sample {sample.sample_id} ({sample.source}): assistant turn {turn} must follow "
                f"a user or tool message, got {segment[-1]['role'] if segment else 'nothing'}"
            )
    return segments[0], segments[1:]


def render_prompt(
    sample: Sample, tokenizer, chat_template_kwargs: dict[str, Any], regenerate: str = "last"
) -> Prompt:
    if regenerate == "all":
        context, followups = conversation_turns(sample)
    else:
        context, followups = conversation_before_last_answer(sample), []
    text = tokenizer.apply_chat_template(
        context,
        tools=sample.tools,
        add_generation_prompt=True,
        tokenize=False,
        **chat_template_kwargs,
    )
    # The template wrote every special token itself: encoding must not add a BOS of its own.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Prompt(
        sample_id=sample.sample_id,
        source=sample.source,
        prompt_ids=ids,
        prompt_text=text,
        messages=context,
        tools=sample.tools,
        followups=followups,
    )


def end_token_ids(model: str, tokenizer, revision: str | None = None) -> list[int]:
    """Token ids that end the target's turn: its generation config's eos ids, else the
    tokenizer's eos token."""
    from transformers import GenerationConfig

    try:
        configured = GenerationConfig.from_pretrained(model, revision=revision).eos_token_id
    except OSError:  # no generation_config.json
        configured = None
    if configured is None:
        configured = tokenizer.eos_token_id
    ids = configured if isinstance(configured, list) else [configured]
    return [int(i) for i in ids if i is not None]
