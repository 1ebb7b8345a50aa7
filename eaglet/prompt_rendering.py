"""Turning a sample into the prompt the target answers, with the target's own chat template.

With `regenerate="last"` the regenerated turn is the last assistant message: everything before
it is rendered with `add_generation_prompt=True`, so the prompt ends exactly where the target
starts writing (for thinking models, after the template's opening `<think>`). With
`regenerate="all"` the prompt is the one of the first assistant turn, and the messages the
dataset has between later assistant turns travel along as `followups` (eaglet/turns.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eaglet.config.generation import GenerationConfig
from eaglet.config.tokenize import TokenizeConfig
from eaglet.errors import PermanentError
from eaglet.records.io import read_jsonl, record_line
from eaglet.records.prompts import Prompt
from eaglet.records.samples import Sample
from eaglet.sampling_plan import choose, template_kwargs
from eaglet.stages import PROMPTS_FILE, REJECTED_FILE
from eaglet.storage import finished_folder


class PromptError(PermanentError, ValueError):
    """A sample that cannot be turned into a prompt; the message names the sample."""


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
    sample: Sample,
    tokenizer,
    chat_template_kwargs: dict[str, Any],
    regenerate: str = "last",
    sampling: dict[str, Any] | None = None,  # the row's sampling plan entry (its effort)
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
        **template_kwargs(chat_template_kwargs, sampling),
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
        sampling=sampling,
    )


def context_length(model_config: Any) -> int | None:
    """The longest sequence the target takes (`max_position_embeddings` and its aliases in a
    transformers config), or None when the config names none."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def length_problem(
    prompt: Prompt, max_prompt_tokens: int, context: int | None
) -> tuple[str, str] | None:
    """(kind, why) when the prompt must not be generated: it leaves no room for one output
    token in the model's context (it would be cut or answered from garbage positions), or it
    is over `tokenize.max_prompt_tokens`; None when it fits."""
    tokens = len(prompt.prompt_ids)
    if context is not None and tokens >= context:
        return (
            "over_context",
            f"sample {prompt.sample_id} ({prompt.source}): the prompt has {tokens} tokens, the "
            f"model's context is {context} (max_position_embeddings): nothing could be generated",
        )
    if tokens > max_prompt_tokens:
        return (
            "too_long",
            f"sample {prompt.sample_id} ({prompt.source}): the prompt has {tokens} tokens, over "
            f"tokenize.max_prompt_tokens={max_prompt_tokens}",
        )
    return None


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token stands for: the longest entry of the vocabulary (a
    byte-level entry has one character per byte, never fewer than the text it decodes to)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def too_many_characters(sample: Sample, max_tokens: int, longest_token: int) -> str | None:
    """Why `sample` is over `max_tokens` before it is tokenized (a 20 MB message would take
    the tokenizer half a minute), or None. Counts the text of user, system and tool messages,
    which every chat template keeps whole; the prompt has at least chars / `longest_token`
    tokens."""
    chars = sum(
        len(message["content"])
        for message in sample.messages
        if message.get("role") in ("user", "system", "tool")
        and isinstance(message.get("content"), str)
    )
    if chars <= max_tokens * longest_token:
        return None
    return (
        f"sample {sample.sample_id} ({sample.source}): its messages hold {chars} characters, "
        f"at least {chars // longest_token} tokens (the longest token has {longest_token} "
        f"characters), over tokenize.max_prompt_tokens={max_tokens}; not tokenized"
    )


def write_prompts(
    samples_path: Path,
    folder: Path,
    tokenizer: Any,
    tokenize: TokenizeConfig,
    context: int | None,
    generation: GenerationConfig | None = None,
) -> tuple[dict[str, int], str | None]:
    """The tokenize stage's body: each sample's prompt to `folder/prompts.jsonl`; each sample
    that cannot be templated or does not fit, with its kind and reason, to `rejected.jsonl`.
    With `generation.sampling_plan`, each prompt carries its row's entry (rendered with its
    reasoning effort). Returns the manifest counts and a warning to log (None when nothing was
    left out)."""
    counts = {"records": 0, "rejected": 0, "too_long": 0, "over_context": 0}
    longest_token = longest_token_chars(tokenizer)
    with (
        open(folder / PROMPTS_FILE, "w", encoding="utf-8") as out,
        open(folder / REJECTED_FILE, "w", encoding="utf-8") as rejects,
    ):
        for position, sample in enumerate(read_jsonl(samples_path, Sample)):
            sampling = (
                None if generation is None else choose(generation, sample.sample_id, position)
            )
            problem: tuple[str, str] | None = None
            if why := too_many_characters(sample, tokenize.max_prompt_tokens, longest_token):
                problem = ("too_long", why)
            else:
                try:
                    prompt = render_prompt(
                        sample, tokenizer, tokenize.chat_template_kwargs, tokenize.regenerate,
                        sampling,
                    )  # fmt: skip
                except PromptError as exc:
                    problem = ("template", str(exc))
                else:
                    problem = length_problem(prompt, tokenize.max_prompt_tokens, context)
            if problem is not None:
                counts["rejected" if problem[0] == "template" else problem[0]] += 1
                entry = {"sample_id": sample.sample_id, "kind": problem[0], "why": problem[1]}
                rejects.write(json.dumps(entry, ensure_ascii=False) + "\n")
                continue
            out.write(record_line(prompt))
            counts["records"] += 1
    if not (counts["rejected"] or counts["too_long"] or counts["over_context"]):
        return counts, None
    return counts, (
        f"{counts['rejected']} samples could not be templated, {counts['over_context']} were "
        f"longer than the model's context ({context} tokens) and {counts['too_long']} over "
        f"{tokenize.max_prompt_tokens} prompt tokens; their ids and reasons are in "
        f"{finished_folder(folder) / 'rejected.jsonl'}"
    )
