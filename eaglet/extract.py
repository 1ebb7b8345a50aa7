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
from typing import Any

from eaglet.reasoning import ReasoningFormat
from eaglet.records import Example, Generation

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


def _percentiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": float(ordered[-1])}


@dataclass
class _SourceTally:
    records: int = 0
    with_reasoning: int = 0
    truncated: int = 0
    leaked: int = 0
    server_disagrees: int = 0
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
        tally.with_reasoning += bool(example.reasoning)
        tally.truncated += example.finish_reason == "length"
        # The seeds' signature: no reasoning split out, yet thinking text sits in the answer.
        tally.leaked += "thinking_in_content" in example.flags
        tally.server_disagrees += "server_reasoning_disagrees" in example.flags
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
            "reasoning_capture_rate": tally.with_reasoning / tally.records,
            "thinking_in_content": tally.leaked,
            "server_reasoning_disagreements": tally.server_disagrees,
            "truncation_rate": tally.truncated / tally.records,
            "reasoning_token_share": tally.reasoning_tokens / max(1, tally.output_tokens),
            "sequence_tokens": _percentiles(lengths[source]),
        }
    total = len(examples)
    return {
        "reasoning_format": reasoning_format.name,
        "records": total,
        "reasoning_capture_rate": sum(t.with_reasoning for t in tallies.values()) / max(1, total),
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
        if reasons and figures["reasoning_capture_rate"] < min_capture_rate:
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
