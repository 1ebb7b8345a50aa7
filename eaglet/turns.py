"""Regenerating every assistant turn of a conversation in order (`tokenize.regenerate="all"`).

Turn 1 is the tokenize stage's prompt. The prompt of turn k+1 is the conversation so far plus
the target's own turn k (its answer as `content`, its reasoning as `reasoning_content` for
templates that keep it) plus the dataset's next user/tool messages, rendered with the chat
template, so later turns follow from what the target itself said. A turn that failed, was cut
at max_tokens or never closed its reasoning ends its conversation there.

Turn records are ordinary generation records; the sample id of turn k > 1 is `<id>#turn<k>`.
Generation runs in rounds (all first turns, then all second turns, ...), each round resuming
from the records on disk like any generate run, so a killed run resumes mid-conversation.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eaglet.config import PipelineConfig
from eaglet.generation import GenerationProgress, GenerationSummary, run_generation, run_sync
from eaglet.reasoning import ReasoningFormat, detect_format
from eaglet.records.generations import Generation
from eaglet.records.io import read_jsonl, repair_and_read_ids, write_jsonl
from eaglet.records.prompts import TURN_SEPARATOR, Prompt, conversation_id
from eaglet.sampling_plan import template_kwargs
from eaglet.stages import FAILED_FILE, GENERATIONS_FILE, TURN_PROMPTS_FILE
from eaglet.target import end_token_ids

# Parts of a split that are the answer the next turn's template renders as `content`.
ANSWER_PARTS = ("content", "tool_call")


def turn_number(sample_id: str) -> int:
    _, _, turn = sample_id.partition(TURN_SEPARATOR)
    return int(turn) if turn else 1


def assistant_message(
    generation: Generation, tokenizer, reasoning_format: ReasoningFormat, end_ids: set[int]
) -> dict[str, Any] | None:
    """The target's turn as a chat message, or None when it cannot be continued."""
    if generation.finish_reason != "stop":
        return None
    split = reasoning_format.split(generation.output_ids, end_ids)
    if not split.reasoning_closed:
        return None
    answer = [t for part in split.parts if part.kind in ANSWER_PARTS for t in part.ids]
    message: dict[str, Any] = {"role": "assistant", "content": tokenizer.decode(answer).strip()}
    reasoning = tokenizer.decode(split.ids("reasoning")).strip()
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def next_turn_prompt(
    prompt: Prompt,
    generation: Generation,
    tokenizer,
    reasoning_format: ReasoningFormat,
    end_ids: set[int],
    chat_template_kwargs: dict[str, Any],
) -> Prompt | None:
    """The prompt of the turn after `prompt`, answered by `generation`; None at the end."""
    if not prompt.followups:
        return None
    answer = assistant_message(generation, tokenizer, reasoning_format, end_ids)
    if answer is None:
        return None
    messages = [*prompt.messages, answer, *prompt.followups[0]]
    text = tokenizer.apply_chat_template(
        messages,
        tools=prompt.tools,
        add_generation_prompt=True,
        tokenize=False,
        **template_kwargs(chat_template_kwargs, prompt.sampling),
    )
    turn = turn_number(prompt.sample_id) + 1
    return Prompt(
        sample_id=f"{conversation_id(prompt.sample_id)}{TURN_SEPARATOR}{turn}",
        source=prompt.source,
        prompt_ids=tokenizer(text, add_special_tokens=False)["input_ids"],
        prompt_text=text,
        messages=messages,
        tools=prompt.tools,
        followups=prompt.followups[1:],
        sampling=prompt.sampling,  # every turn of a conversation samples alike
    )


async def run_turn_by_turn_generation(
    engine: Any,
    first_turns: list[Prompt],
    out_path: Path,
    failed_path: Path,
    next_prompt: Callable[[Prompt, Generation], Prompt | None],
    progress: Callable[[GenerationProgress], None] | None = None,
    max_failure_fraction: float | None = None,
) -> tuple[GenerationSummary, list[Prompt]]:
    """Generate turn after turn until no conversation has one left; returns the summary of
    the whole run and the prompts of the later turns (to write next to the records)."""
    known: dict[str, Prompt] = {}
    later_turns: list[Prompt] = []
    round_prompts = first_turns
    total = None
    failed_ids: set[str] = set()
    for round_number in itertools.count(1):  # ends when no conversation has a turn left
        known.update((p.sample_id, p) for p in round_prompts)
        summary = await run_generation(
            engine,
            [p for p in known.values() if p.sample_id not in failed_ids],
            out_path,
            failed_path,
            progress,
            max_failure_fraction,
            append_failures=round_number > 1,
        )
        total = _merge(total, summary)
        failed_ids |= repair_and_read_ids(failed_path)
        records = {g.sample_id: g for g in read_jsonl(out_path, Generation)}
        round_prompts = []
        for prompt in known.values():
            following = f"{conversation_id(prompt.sample_id)}{TURN_SEPARATOR}"
            following += str(turn_number(prompt.sample_id) + 1)
            if following in known or prompt.sample_id not in records:
                continue
            upcoming = next_prompt(prompt, records[prompt.sample_id])
            if upcoming is not None:
                round_prompts.append(upcoming)
        if not round_prompts:
            break
        later_turns += round_prompts
    assert total is not None
    total.total = len(known)
    total.already_done = len(known.keys() & records.keys()) - total.written
    return total, later_turns


def _merge(total: GenerationSummary | None, summary: GenerationSummary) -> GenerationSummary:
    """One summary for all rounds: what each round wrote, failed or truncated, added up."""
    if total is None:
        return summary
    total.written += summary.written
    total.failed += summary.failed
    total.truncated += summary.truncated
    total.output_tokens += summary.output_tokens
    total.elapsed_s += summary.elapsed_s
    total.stopped_early |= summary.stopped_early
    for reason, count in summary.finish_reasons.items():
        total.finish_reasons[reason] = total.finish_reasons.get(reason, 0) + count
    total.failure_examples += summary.failure_examples[: 3 - len(total.failure_examples)]
    return total


def generate_every_turn(
    config: PipelineConfig,
    engine: Any,
    tokenizer,
    first_turns: list[Prompt],
    folder: Path,
    progress: Callable[[GenerationProgress], None] | None = None,
) -> GenerationSummary:
    """The generate stage for `regenerate="all"`: records of every turn in
    `generations.jsonl`, the later turns' prompts in `turn_prompts.jsonl`."""
    reasoning_format = detect_format(
        tokenizer, config.reasoning.format, config.tokenize.chat_template_kwargs
    )
    end_ids = set(end_token_ids(config.target, tokenizer))

    def next_prompt(prompt: Prompt, generation: Generation) -> Prompt | None:
        return next_turn_prompt(
            prompt,
            generation,
            tokenizer,
            reasoning_format,
            end_ids,
            config.tokenize.chat_template_kwargs,
        )

    summary, later_turns = run_sync(
        run_turn_by_turn_generation(
            engine,
            first_turns,
            folder / GENERATIONS_FILE,
            folder / FAILED_FILE,
            next_prompt,
            progress,
            config.generation.max_failure_fraction,
        )
    )
    write_jsonl(folder / TURN_PROMPTS_FILE, later_turns)
    return summary
