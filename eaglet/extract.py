"""From generations to training examples: the token split, the loss mask, the quality report.

`input_ids` is `prompt_ids + output_ids` exactly as generated (never re-rendered text), and the
loss mask covers exactly the tokens the model produced: reasoning, closing tag, answer, end
token. Everything the chat template wrote (prompt, role headers, an injected `<think>`) is 0.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet.reasoning import ReasoningFormat
from eaglet.records import Example, Generation, Prompt, read_jsonl, record_line
from eaglet.storage import write_json_atomic

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Text that shows thinking leaked into the answer: the seeds' bug in a record.
LEAKED_THINKING = ("<think>", "</think>")


class QualityGateError(RuntimeError):
    """The generated data fails a configured quality threshold."""


def parse_tool_calls(content: str) -> tuple[str, list[dict[str, Any]]]:
    """Split `<tool_call>{json}</tool_call>` blocks out of the answer text."""
    calls = []
    for match in TOOL_CALL.finditer(content):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            call = {"unparsed": match.group(1)}
        calls.append(call)
    return TOOL_CALL.sub("", content).strip(), calls


def server_reasoning_text(raw: dict[str, Any]) -> str | None:
    """The reasoning text a server returned, under whichever name it used, if any."""
    for name in ("reasoning", "reasoning_content"):
        if isinstance(raw.get(name), str):
            return raw[name]
    return None


def build_example(
    generation: Generation, tokenizer, reasoning_format: ReasoningFormat, end_ids: set[int]
) -> Example:
    split = reasoning_format.split(generation.output_ids, end_ids)
    assert split.all_ids() == generation.output_ids, "split must reproduce the output ids"
    reasoning = tokenizer.decode(split.ids("reasoning")).strip()
    content, tool_calls = parse_tool_calls(tokenizer.decode(split.ids("content")).strip())
    flags = list(split.flags)
    if generation.finish_reason == "length":
        flags.append("truncated")
    if not split.reasoning_closed:
        flags.append("reasoning_not_closed")
    if reasoning_format.reasons and split.reasoning_closed and not reasoning:
        flags.append("empty_reasoning")
    if any(tag in content for tag in LEAKED_THINKING):
        flags.append("thinking_in_content")
    if not generation.token_exact:
        flags.append("not_token_exact")
    server_text = server_reasoning_text(generation.raw)
    if server_text is not None and server_text.strip() != reasoning:
        flags.append("server_reasoning_disagrees")
    input_ids = generation.prompt_ids + generation.output_ids
    loss_mask = [0] * len(generation.prompt_ids) + [1] * len(generation.output_ids)
    return Example(
        sample_id=generation.sample_id,
        source=generation.source,
        reasoning=reasoning,
        content=content,
        tool_calls=tool_calls,
        input_ids=input_ids,
        loss_mask=loss_mask,
        finish_reason=generation.finish_reason,
        flags=sorted(set(flags)),
    )


def template_mismatch(
    example: Example, prompt: Prompt, tokenizer, chat_template_kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """Re-render the conversation plus the generated turn with the chat template and compare
    with `input_ids`; None when they agree, else where and how they first differ.

    A draft is trained on `input_ids` but serves on what the template renders: a template that
    drops or rewrites the reasoning (thinking vs non-thinking, SpecForge #296) shows up here.
    """
    turn: dict[str, Any] = {
        "role": "assistant",
        "content": example.content,
        "reasoning_content": example.reasoning,
    }
    if example.tool_calls:
        turn["tool_calls"] = [{"type": "function", "function": call} for call in example.tool_calls]
    text = tokenizer.apply_chat_template(
        [*prompt.messages, turn], tools=prompt.tools, tokenize=False, **chat_template_kwargs
    )
    rendered = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = example.input_ids
    if rendered[: len(expected)] == expected:
        return None
    position = next(
        (i for i, (a, b) in enumerate(zip(expected, rendered, strict=False)) if a != b),
        min(len(expected), len(rendered)),
    )
    return {
        "position": position,
        "in_prompt": position < len(prompt.prompt_ids),
        "generated": tokenizer.decode(expected[position : position + 12]),
        "rendered": tokenizer.decode(rendered[position : position + 12]),
    }


def _percentiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": float(ordered[-1])}


def _rate(part: int, whole: int) -> float | None:
    """part/whole, or None when there is nothing to judge (every record truncated)."""
    return part / whole if whole else None


@dataclass
class _SourceTally:
    records: int = 0
    with_reasoning: int = 0
    truncated: int = 0
    leaked: int = 0
    server_disagrees: int = 0
    template_mismatches: int = 0
    reasoning_tokens: int = 0
    output_tokens: int = 0


def quality_report(
    examples: list[Example], reasoning_tokens: dict[str, int], reasoning_format: ReasoningFormat
) -> dict[str, Any]:
    """Per-source figures a person checks before trusting the data (written as quality.json)."""
    tallies: dict[str, _SourceTally] = defaultdict(_SourceTally)
    lengths: dict[str, list[int]] = defaultdict(list)
    examples_by_flag: dict[str, list[str]] = defaultdict(list)
    for example in examples:
        tally = tallies[example.source]
        tally.records += 1
        # Captured = reasoning split out and closed. Truncated records cannot close theirs
        # and are judged by the truncation rate instead.
        tally.with_reasoning += bool(example.reasoning) and "reasoning_not_closed" not in (
            example.flags
        )
        tally.truncated += example.finish_reason == "length"
        # The seeds' signature: no reasoning split out, yet thinking text sits in the answer.
        tally.leaked += "thinking_in_content" in example.flags
        tally.server_disagrees += "server_reasoning_disagrees" in example.flags
        tally.template_mismatches += "template_mismatch" in example.flags
        tally.reasoning_tokens += reasoning_tokens.get(example.sample_id, 0)
        tally.output_tokens += sum(example.loss_mask)
        lengths[example.source].append(len(example.input_ids))
        for flag in example.flags:
            if len(examples_by_flag[flag]) < 5:
                examples_by_flag[flag].append(example.sample_id)
    per_source = {}
    for source, tally in sorted(tallies.items()):
        per_source[source] = {
            "records": tally.records,
            "reasoning_capture_rate": _rate(tally.with_reasoning, tally.records - tally.truncated),
            "thinking_in_content": tally.leaked,
            "server_reasoning_disagreements": tally.server_disagrees,
            "template_mismatches": tally.template_mismatches,
            "truncation_rate": tally.truncated / tally.records,
            "reasoning_token_share": tally.reasoning_tokens / max(1, tally.output_tokens),
            "sequence_tokens": _percentiles(lengths[source]),
        }
    total = len(examples)
    return {
        "reasoning_format": reasoning_format.name,
        "records": total,
        "reasoning_capture_rate": _rate(
            sum(t.with_reasoning for t in tallies.values()),
            total - sum(t.truncated for t in tallies.values()),
        ),
        "truncation_rate": sum(t.truncated for t in tallies.values()) / max(1, total),
        "per_source": per_source,
        "example_ids_by_flag": dict(examples_by_flag),
    }


def check_quality_gate(
    report: dict[str, Any], reasons: bool, min_capture_rate: float, max_truncation_rate: float
) -> None:
    """Raise when the data crosses a threshold, naming the source and example sample ids."""
    problems = []
    examples = report["example_ids_by_flag"]
    for source, figures in report["per_source"].items():
        capture = figures["reasoning_capture_rate"]
        if reasons and capture is not None and capture < min_capture_rate:
            problems.append(
                f"source {source!r}: reasoning captured in {figures['reasoning_capture_rate']:.1%}"
                f" of records (< {min_capture_rate:.0%}); e.g. samples "
                f"{examples.get('empty_reasoning', []) + examples.get('reasoning_not_closed', [])}"
            )
        if figures["truncation_rate"] > max_truncation_rate:
            problems.append(
                f"source {source!r}: {figures['truncation_rate']:.1%} of records hit max_tokens "
                f"(> {max_truncation_rate:.0%}); e.g. samples {examples.get('truncated', [])}. "
                "Raise generation.max_tokens or reasoning.max_truncation_rate."
            )
    if problems:
        raise QualityGateError("quality gate failed:\n  " + "\n  ".join(problems))


def write_examples(
    generations_path: Path,
    prompts_path: Path,
    out_dir: Path,
    tokenizer,
    reasoning_format: ReasoningFormat,
    end_ids: set[int],
    chat_template_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """Build every example into `examples.jsonl`, template mismatches into
    `template_mismatches.jsonl`, and the quality report into `quality.json`; return the report."""
    prompt_by_id = {p.sample_id: p for p in read_jsonl(prompts_path, Prompt)}
    examples, reasoning_tokens = [], {}
    with (
        open(out_dir / "examples.jsonl", "w", encoding="utf-8") as out,
        open(out_dir / "template_mismatches.jsonl", "w", encoding="utf-8") as mismatches,
    ):
        for generation in read_jsonl(generations_path, Generation):
            example = build_example(generation, tokenizer, reasoning_format, end_ids)
            prompt = prompt_by_id[example.sample_id]
            mismatch = template_mismatch(example, prompt, tokenizer, chat_template_kwargs)
            if mismatch is not None:
                example.flags = sorted({*example.flags, "template_mismatch"})
                mismatches.write(json.dumps({"sample_id": example.sample_id, **mismatch}) + "\n")
            split = reasoning_format.split(generation.output_ids, end_ids)
            reasoning_tokens[example.sample_id] = len(split.ids("reasoning"))
            out.write(record_line(example))
            examples.append(example)
    report = quality_report(examples, reasoning_tokens, reasoning_format)
    write_json_atomic(out_dir / "quality.json", report)
    return report


# Span styles of the loss-mask viewer: (label, ANSI colour). Masked spans are dim.
_SPAN_STYLE = {
    "prompt": ("masked", "2"),
    "think_open": ("trained:tag", "35"),
    "reasoning": ("trained:reasoning", "36"),
    "think_close": ("trained:tag", "35"),
    "content": ("trained:answer", "32"),
    "end": ("trained:end", "33"),
}


def render_loss_mask(
    example: Example,
    tokenizer,
    reasoning_format: ReasoningFormat,
    end_ids: set[int],
    color: bool = False,
) -> str:
    """The sequence with masked and trained spans marked, reasoning and answer told apart."""
    prompt_length = len(example.input_ids) - sum(example.loss_mask)
    output_ids = example.input_ids[prompt_length:]
    spans = [("prompt", example.input_ids[:prompt_length])]
    spans += [(part.kind, part.ids) for part in reasoning_format.split(output_ids, end_ids).parts]
    lines = [
        f"sample {example.sample_id} ({example.source}) finish={example.finish_reason} "
        f"flags={example.flags}",
        f"{len(example.input_ids)} tokens: {prompt_length} masked, "
        f"{sum(example.loss_mask)} trained",
    ]
    position = 0
    for kind, ids in spans:
        label, ansi = _SPAN_STYLE[kind]
        mask_values = set(example.loss_mask[position : position + len(ids)])
        assert mask_values <= ({0} if kind == "prompt" else {1}), "mask disagrees with span"
        text = tokenizer.decode(ids)
        shown = f"\x1b[{ansi}m{text}\x1b[0m" if color else text
        lines.append(f"[{label} {position}:{position + len(ids)}] {shown}")
        position += len(ids)
    return "\n".join(lines)
