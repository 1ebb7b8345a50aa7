"""From generations to training examples: the token split, the loss mask, the quality report.

`input_ids` is `prompt_ids + output_ids` exactly as generated (never re-rendered text), and the
loss mask covers exactly the tokens the model produced: reasoning, closing tag, answer, tool
calls, harmony headers, end token. Everything the chat template wrote (prompt, role headers, an
injected `<think>`) is 0. Tool calls come from the split's `tool_call` parts, or from the
answer text where the tokenizer spells `<tool_call>` in pieces. A chat server's own text fields
(kept in `Generation.raw`) are cross-checked against the split: disagreements go to
`server_disagreements.jsonl` with both texts, and quality.json counts them per source.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglet.config.reasoning import ReasoningConfig
from eaglet.errors import PermanentError
from eaglet.reasoning import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ReasoningFormat,
    ReasoningSplit,
    ToolCallSyntax,
)
from eaglet.records.examples import Example
from eaglet.records.generations import Generation
from eaglet.records.io import read_jsonl, record_line
from eaglet.records.prompts import Prompt
from eaglet.sampling_plan import sampling_label, template_kwargs
from eaglet.stages import (
    EXAMPLES_FILE,
    QUALITY_FILE,
    SERVER_DISAGREEMENTS_FILE,
    TEMPLATE_MISMATCHES_FILE,
)
from eaglet.storage import write_json_atomic

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Text that shows thinking leaked into the answer: the seeds' bug in a record.
LEAKED_THINKING = ("<think>", "</think>")


class QualityGateError(PermanentError, RuntimeError):
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


def tool_call_from_part(
    text: str, recipient: str | None, syntax: ToolCallSyntax | None = None
) -> dict[str, Any]:
    """One call from a `tool_call` part's text: a harmony body addressed to `recipient`
    (`functions.NAME`), a call in the format's special-token `syntax` (DeepSeek, Kimi-K2),
    or a `<tool_call>{json}</tool_call>` block."""
    if recipient is None and syntax is not None:
        return syntax.parse(text)
    if recipient is not None:
        name = recipient.removeprefix("functions.")
        try:
            return {"name": name, "arguments": json.loads(text)}
        except json.JSONDecodeError:
            return {"name": name, "unparsed": text}
    inner = text.strip().removeprefix(TOOL_CALL_OPEN).removesuffix(TOOL_CALL_CLOSE).strip()
    try:
        return json.loads(inner)
    except json.JSONDecodeError:
        return {"unparsed": inner}


def _server_reasoning_field(raw: dict[str, Any]) -> str | None:
    return next(
        (n for n in ("reasoning", "reasoning_content") if isinstance(raw.get(n), str)), None
    )


def server_reasoning_text(raw: dict[str, Any]) -> str | None:
    """The reasoning text a server returned, under whichever name it used, if any."""
    field = _server_reasoning_field(raw)
    return raw[field] if field else None


# A server's text fields, as the openai engine keeps them in `Generation.raw`.
SERVER_TEXT_FIELDS = ("content", "reasoning", "reasoning_content")


@dataclass(frozen=True)
class ServerTexts:
    """A chat server's text for one generation, judged against eaglet's token split."""

    reasoning_field: str | None  # "reasoning" or "reasoning_content"; None: no such field
    reasoning: str | None
    content: str | None
    # No reasoning field, and the thinking sits in `content` (no reasoning parser ran):
    # the seeds' bug signature, harmless here because the split works on token ids.
    thinking_in_content: bool
    disagrees: bool  # the server's text shows other reasoning than the split


def server_texts(raw: dict[str, Any], reasoning: str) -> ServerTexts | None:
    """Judge the server's text fields against the split's (stripped) reasoning; None when the
    engine kept no text fields (local, vllm, sglang)."""
    if not any(name in raw for name in SERVER_TEXT_FIELDS):
        return None
    field = _server_reasoning_field(raw)
    content = raw["content"] if isinstance(raw.get("content"), str) else None
    holds_thinking = content is not None and (
        any(tag in content for tag in LEAKED_THINKING) or (reasoning != "" and reasoning in content)
    )
    thinking_in_content = field is None and holds_thinking
    if field is not None:
        disagrees = raw[field].strip() != reasoning
    elif thinking_in_content:
        disagrees = reasoning not in content
    else:  # the server shows no thinking at all
        disagrees = bool(reasoning)
    return ServerTexts(
        field, raw[field] if field else None, content, thinking_in_content, disagrees
    )


def _parts_text(split: ReasoningSplit, kind: str, tokenizer, separator: str) -> str:
    return separator.join(tokenizer.decode(part.ids) for part in split.of_kind(kind)).strip()


def build_example(
    generation: Generation, tokenizer, reasoning_format: ReasoningFormat, end_ids: set[int]
) -> Example:
    return _build_example(generation, tokenizer, reasoning_format, end_ids)[0]


def _build_example(
    generation: Generation, tokenizer, reasoning_format: ReasoningFormat, end_ids: set[int]
) -> tuple[Example, ReasoningSplit, ServerTexts | None]:
    """The example, with the split and the server cross-check it was built from."""
    split = reasoning_format.split(generation.output_ids, end_ids)
    assert split.all_ids() == generation.output_ids, "split must reproduce the output ids"
    separator = reasoning_format.part_separator
    reasoning = _parts_text(split, "reasoning", tokenizer, separator)
    syntax = reasoning_format.tool_syntax()
    tool_calls = [
        tool_call_from_part(tokenizer.decode(part.ids), part.recipient, syntax)
        for part in split.of_kind("tool_call")
    ]
    # Where the tags are not single tokens, the calls are still in the answer text.
    content, text_calls = parse_tool_calls(_parts_text(split, "content", tokenizer, separator))
    tool_calls += text_calls
    flags = list(split.flags)
    if generation.finish_reason == "length":
        flags.append("truncated")
    if generation.finish_reason == "loop":
        flags.append("looped")
    if not split.reasoning_closed:
        flags.append("reasoning_not_closed")
    if reasoning_format.reasons and split.reasoning_closed and not reasoning:
        flags.append("empty_reasoning")
    if any(tag in content for tag in LEAKED_THINKING):
        flags.append("thinking_in_content")
    if not generation.token_exact:
        flags.append("not_token_exact")
    server = server_texts(generation.raw, reasoning)
    if server is not None and server.disagrees:
        flags.append("server_reasoning_disagrees")
    if server is not None and server.thinking_in_content:
        flags.append("server_thinking_in_content")
    input_ids = generation.prompt_ids + generation.output_ids
    loss_mask = [0] * len(generation.prompt_ids) + [1] * len(generation.output_ids)
    example = Example(
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
    return example, split, server


def template_mismatch(
    example: Example, prompt: Prompt, tokenizer, chat_template_kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """Re-render the conversation plus the generated turn with the chat template and compare
    with `input_ids`; None when they agree, else where and how they first differ.

    A draft is trained on `input_ids` but serves on what the template renders. Two checks:
    the prompt part must be the prompt the configured template renders (a server that rendered
    with its own template or other kwargs, thinking vs non-thinking as in SpecForge #296,
    differs here), and the whole sequence must be the conversation's rendering (a template that
    drops or rewrites the reasoning differs there).
    """
    expected = example.input_ids
    served = prompt.prompt_ids
    if expected[: len(served)] != served:
        position = _first_difference(expected, served)
        return {
            "position": position,
            "in_prompt": True,
            "generated": tokenizer.decode(expected[position : position + 12]),
            "rendered": tokenizer.decode(served[position : position + 12]),
        }
    turn: dict[str, Any] = {
        "role": "assistant",
        "content": example.content,
        # Qwen3/DeepSeek templates read `reasoning_content`, gpt-oss's reads `thinking`.
        "reasoning_content": example.reasoning,
        "thinking": example.reasoning,
    }
    # A call that is not `{"name", "arguments"}` (invalid JSON, cut off) has no chat-message
    # form: it is left out, so the re-render differs from the tokens and is reported.
    calls = [c for c in example.tool_calls if {"name", "arguments"} <= c.keys()]
    if calls:
        turn["tool_calls"] = [{"type": "function", "function": call} for call in calls]
    try:
        text = tokenizer.apply_chat_template(
            [*prompt.messages, turn],
            tools=prompt.tools,
            tokenize=False,
            **template_kwargs(chat_template_kwargs, prompt.sampling),  # with the row's effort
        )
    except Exception as exc:  # a template that cannot render the turn at all
        return {
            "position": len(prompt.prompt_ids),
            "in_prompt": False,
            "generated": tokenizer.decode(example.input_ids[len(prompt.prompt_ids) :][:12]),
            "rendered": f"<the chat template failed: {type(exc).__name__}: {exc}>",
        }
    rendered = tokenizer(text, add_special_tokens=False)["input_ids"]
    if rendered[: len(expected)] == expected:
        return None
    position = _first_difference(expected, rendered)
    return {
        "position": position,
        "in_prompt": position < len(prompt.prompt_ids),
        "generated": tokenizer.decode(expected[position : position + 12]),
        "rendered": tokenizer.decode(rendered[position : position + 12]),
    }


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


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
    looped: int = 0  # stopped by the loop guard, examples or not (reasoning.looped_rows)
    looped_kept: int = 0  # of those, the ones kept as examples
    leaked: int = 0
    server_disagrees: int = 0
    server_checked: int = 0
    server_reasoning_in_field: int = 0
    server_thinking_in_content: int = 0
    template_mismatches: int = 0
    prompt_mismatches: int = 0
    thinking_in_answer: int = 0
    reasoning_tokens: int = 0
    output_tokens: int = 0


@dataclass
class QualityTally:
    """The figures of quality.json, added up one example at a time: counts, lengths and a
    few example ids per flag, never the examples themselves (a run holds millions of tokens)."""

    sources: dict[str, _SourceTally] = field(default_factory=lambda: defaultdict(_SourceTally))
    # per generation.sampling_plan setting (sampling_label): records, truncated, looped
    settings: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: {"records": 0, "truncated": 0, "looped": 0})
    )
    lengths: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    examples_by_flag: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def add(self, example: Example, reasoning_tokens: int, server: ServerTexts | None) -> None:
        """`server` is the server text cross-check of the example, if it has one."""
        tally = self.sources[example.source]
        tally.records += 1
        # Captured = reasoning split out and closed. Truncated records are judged by the
        # truncation rate instead: out of both sides of the rate, so it is at most 1; so are
        # the looping answers kept (reasoning.looped_rows: keep), cut short like them.
        truncated = example.finish_reason == "length"
        looped = example.finish_reason == "loop"
        tally.with_reasoning += (
            bool(example.reasoning)
            and "reasoning_not_closed" not in example.flags
            and not truncated
            and not looped
        )
        tally.truncated += truncated
        tally.looped += looped
        tally.looped_kept += looped
        tally.leaked += "thinking_in_content" in example.flags
        # The seeds' signature: no reasoning split out, yet thinking text sits in the answer.
        tally.thinking_in_answer += "thinking_in_content" in example.flags and not (
            example.reasoning
        )
        tally.server_disagrees += "server_reasoning_disagrees" in example.flags
        if server is not None:
            tally.server_checked += 1
            tally.server_reasoning_in_field += server.reasoning_field is not None
            tally.server_thinking_in_content += server.thinking_in_content
        tally.template_mismatches += "template_mismatch" in example.flags
        tally.prompt_mismatches += "prompt_template_mismatch" in example.flags
        tally.reasoning_tokens += reasoning_tokens
        tally.output_tokens += sum(example.loss_mask)
        self.lengths[example.source].append(len(example.input_ids))
        for flag in example.flags:
            if len(self.examples_by_flag[flag]) < 5:
                self.examples_by_flag[flag].append(example.sample_id)

    def add_setting(self, generation: Generation) -> None:
        """Count a generation record under its sampling setting (every record, dropped or not)."""
        counts = self.settings[sampling_label(generation.sampling)]
        counts["records"] += 1
        counts["truncated"] += generation.finish_reason == "length"
        counts["looped"] += generation.finish_reason == "loop"

    def add_dropped_loop(self, generation: Generation) -> None:
        """A record the loop guard stopped, left out of the examples (looped_rows: drop)."""
        self.sources[generation.source].looped += 1
        if len(self.examples_by_flag["looped"]) < 5:
            self.examples_by_flag["looped"].append(generation.sample_id)

    def report(self, reasoning_format: ReasoningFormat) -> dict[str, Any]:
        """Per-source figures a person checks before trusting the data."""
        per_source = {}
        for source, tally in sorted(self.sources.items()):
            per_source[source] = {
                "records": tally.records,
                "reasoning_capture_rate": _rate(
                    tally.with_reasoning, tally.records - tally.truncated - tally.looped_kept
                ),
                # Answers the loop guard stopped (examples only with looped_rows: keep).
                "looped": tally.looped,
                "thinking_in_content": tally.leaked,
                "server_reasoning_disagreements": tally.server_disagrees,
                # Records whose server text was cross-checked, and where that server put the
                # thinking: in a reasoning field, or inside `content` (no reasoning parser).
                "server_texts_checked": tally.server_checked,
                "server_reasoning_in_field": tally.server_reasoning_in_field,
                "server_thinking_in_content": tally.server_thinking_in_content,
                "template_mismatches": tally.template_mismatches,
                # Of those, the ones whose prompt ids are not the configured rendering.
                "prompt_template_mismatches": tally.prompt_mismatches,
                # No reasoning split out, think tags in the answer: the seeds' signature.
                "thinking_in_answer": tally.thinking_in_answer,
                "truncation_rate": tally.truncated / max(1, tally.records),
                "reasoning_token_share": tally.reasoning_tokens / max(1, tally.output_tokens),
                "sequence_tokens": _percentiles(self.lengths[source]),
            }
        tallies = self.sources.values()
        total = sum(t.records for t in tallies)
        truncated = sum(t.truncated for t in tallies)
        cut = truncated + sum(t.looped_kept for t in tallies)
        return {
            "reasoning_format": reasoning_format.name,
            "records": total,
            "reasoning_capture_rate": _rate(sum(t.with_reasoning for t in tallies), total - cut),
            "truncation_rate": truncated / max(1, total),
            "looped": sum(t.looped for t in tallies),
            "per_source": per_source,
            # generation records per generation.sampling_plan setting
            "per_sampling": {label: dict(c) for label, c in sorted(self.settings.items())},
            "example_ids_by_flag": dict(self.examples_by_flag),
        }


def check_quality_gate(report: dict[str, Any], reasons: bool, reasoning: ReasoningConfig) -> None:
    """Raise when the data crosses a threshold of `reasoning` (ReasoningConfig), naming the
    source, the setting and example sample ids. Four branches, each per source: reasoning
    captured (formats that reason), truncated, thinking in the answer without reasoning split
    out (the seeds' signature), and prompts the configured template does not render."""
    problems = []
    examples = report["example_ids_by_flag"]
    if report["records"] == 0:
        looped = sum(f.get("looped", 0) for f in report["per_source"].values())
        why = (
            f"the loop guard stopped all {looped} answers and reasoning.looped_rows drops them "
            f"(e.g. samples {examples.get('looped', [])}): the target repeats itself; check its "
            "sampling (temperature, repetition) or set reasoning.looped_rows: keep"
            if looped
            else "the generate stage wrote no record to extract from"
        )
        raise QualityGateError(f"quality gate failed: no training examples: {why}")
    for source, figures in report["per_source"].items():
        records = max(1, figures["records"])
        capture = figures["reasoning_capture_rate"]
        if reasons and capture is not None and capture < reasoning.min_capture_rate:
            problems.append(
                f"source {source!r}: reasoning captured in {capture:.1%} of records "
                f"(< reasoning.min_capture_rate={reasoning.min_capture_rate:.0%}); e.g. samples "
                f"{examples.get('empty_reasoning', []) + examples.get('reasoning_not_closed', [])}"
                ": check reasoning.format and tokenize.chat_template_kwargs (e.g. "
                "enable_thinking)"
            )
        if figures["truncation_rate"] > reasoning.max_truncation_rate:
            problems.append(
                f"source {source!r}: {figures['truncation_rate']:.1%} of records hit max_tokens "
                f"(> reasoning.max_truncation_rate={reasoning.max_truncation_rate:.0%}); e.g. "
                f"samples {examples.get('truncated', [])}. Raise generation.max_tokens or "
                "reasoning.max_truncation_rate."
            )
        leaked = figures.get("thinking_in_answer", 0) / records
        if leaked > reasoning.max_thinking_in_answer_rate:
            problems.append(
                f"source {source!r}: {leaked:.1%} of records have no reasoning split out but "
                "think tags in the answer (> reasoning.max_thinking_in_answer_rate="
                f"{reasoning.max_thinking_in_answer_rate:.0%}): the draft would learn thinking "
                f"as the answer; e.g. samples {examples.get('thinking_in_content', [])}. Set "
                "reasoning.format to the target's format (auto detects it from the template) "
                "and check tokenize.chat_template_kwargs."
            )
        mismatched = figures.get("prompt_template_mismatches", 0) / records
        if mismatched > reasoning.max_prompt_mismatch_rate:
            problems.append(
                f"source {source!r}: {mismatched:.1%} of records were generated from other "
                "prompt ids than the configured chat template renders (> "
                f"reasoning.max_prompt_mismatch_rate={reasoning.max_prompt_mismatch_rate:.0%}); "
                f"e.g. samples {examples.get('prompt_template_mismatch', [])} (see "
                f"{TEMPLATE_MISMATCHES_FILE}): give the server the target's template and "
                "tokenize.chat_template_kwargs, or use the vllm engine"
            )
    if problems:
        raise QualityGateError("quality gate failed:\n  " + "\n  ".join(problems))


# Longest text of one field in `server_disagreements.jsonl`; longer ones keep head and tail.
SERVER_TEXT_SHOWN = 2000


def _clip(text: str | None, limit: int = SERVER_TEXT_SHOWN) -> str | None:
    if text is None or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} …[{len(text) - 2 * half} chars cut]… {text[-half:]}"


def server_disagreement_line(example: Example, server: ServerTexts) -> dict[str, Any]:
    """Both readings of one sample, side by side (texts clipped to SERVER_TEXT_SHOWN)."""
    return {
        "sample_id": example.sample_id,
        "source": example.source,
        "split_reasoning": _clip(example.reasoning),
        "split_content": _clip(example.content),
        "server_reasoning_field": server.reasoning_field,
        "server_reasoning": _clip(server.reasoning),
        "server_content": _clip(server.content),
        "server_thinking_in_content": server.thinking_in_content,
    }


def write_examples(
    generations_path: Path,
    prompts_paths: list[Path],
    out_dir: Path,
    tokenizer,
    reasoning_format: ReasoningFormat,
    end_ids: set[int],
    chat_template_kwargs: dict[str, Any],
    looped_rows: str = "drop",
) -> dict[str, Any]:
    """Build every example into `examples.jsonl` (but the answers the loop guard stopped,
    with `looped_rows` "drop"), template mismatches into
    `template_mismatches.jsonl`, samples whose server text disagrees with the split into
    `server_disagreements.jsonl`, and the quality report into `quality.json`; return the
    report. `prompts_paths` hold the prompts of every record: the tokenize stage's, and the
    later turns' ones the generate stage wrote (`turn_prompts.jsonl`, regenerate="all")."""
    prompt_by_id = {
        p.sample_id: p for path in prompts_paths if path.exists() for p in read_jsonl(path, Prompt)
    }
    quality = QualityTally()
    with (
        open(out_dir / EXAMPLES_FILE, "w", encoding="utf-8") as out,
        open(out_dir / TEMPLATE_MISMATCHES_FILE, "w", encoding="utf-8") as mismatches,
        open(out_dir / SERVER_DISAGREEMENTS_FILE, "w", encoding="utf-8") as disagreements,
    ):
        for generation in read_jsonl(generations_path, Generation):
            quality.add_setting(generation)
            if generation.finish_reason == "loop" and looped_rows == "drop":
                quality.add_dropped_loop(generation)
                continue
            example, split, server = _build_example(
                generation, tokenizer, reasoning_format, end_ids
            )
            if server is not None and server.disagrees:
                line = server_disagreement_line(example, server)
                disagreements.write(json.dumps(line, ensure_ascii=False) + "\n")
            prompt = prompt_by_id[example.sample_id]
            mismatch = template_mismatch(example, prompt, tokenizer, chat_template_kwargs)
            if mismatch is not None:
                flags = {"template_mismatch"}
                if mismatch["in_prompt"]:
                    flags.add("prompt_template_mismatch")
                example.flags = sorted({*example.flags, *flags})
                mismatches.write(json.dumps({"sample_id": example.sample_id, **mismatch}) + "\n")
            out.write(record_line(example))
            quality.add(example, len(split.ids("reasoning")), server)
    report = quality.report(reasoning_format)
    write_json_atomic(out_dir / QUALITY_FILE, report)
    return report


# Span styles of the loss-mask viewer: (label, ANSI colour), one for every part kind of every
# reasoning format, and the prompt. Masked spans are dim.
_SPAN_STYLE = {
    "prompt": ("masked", "2"),
    "think_open": ("trained:tag", "35"),
    "reasoning": ("trained:reasoning", "36"),
    "think_close": ("trained:tag", "35"),
    "content": ("trained:answer", "32"),
    "tool_call": ("trained:tool_call", "34"),
    "tool_section": ("trained:tag", "35"),
    "header": ("trained:header", "35"),
    "message_end": ("trained:tag", "35"),
    "end": ("trained:end", "33"),
}


def loss_mask_spans(
    example: Example, tokenizer, reasoning_format: ReasoningFormat, end_ids: set[int]
) -> list[dict[str, Any]]:
    """The sequence as spans: kind (prompt, reasoning, content, ...), label (masked or
    trained:...), [start, end) positions, and text."""
    prompt_length = len(example.input_ids) - sum(example.loss_mask)
    output_ids = example.input_ids[prompt_length:]
    parts = [("prompt", example.input_ids[:prompt_length])]
    parts += [(part.kind, part.ids) for part in reasoning_format.split(output_ids, end_ids).parts]
    spans, position = [], 0
    for kind, ids in parts:
        mask_values = set(example.loss_mask[position : position + len(ids)])
        assert mask_values <= ({0} if kind == "prompt" else {1}), "mask disagrees with span"
        spans.append({
            "kind": kind, "label": _SPAN_STYLE[kind][0], "start": position,
            "end": position + len(ids), "text": tokenizer.decode(ids),
        })  # fmt: skip
        position += len(ids)
    return spans


def render_loss_mask(
    example: Example,
    tokenizer,
    reasoning_format: ReasoningFormat,
    end_ids: set[int],
    color: bool = False,
) -> str:
    """The sequence with masked and trained spans marked, reasoning and answer told apart."""
    trained = sum(example.loss_mask)
    lines = [
        f"sample {example.sample_id} ({example.source}) finish={example.finish_reason} "
        f"flags={example.flags}",
        f"{len(example.input_ids)} tokens: {len(example.input_ids) - trained} masked, "
        f"{trained} trained",
    ]
    for span in loss_mask_spans(example, tokenizer, reasoning_format, end_ids):
        ansi = _SPAN_STYLE[span["kind"]][1]
        shown = f"\x1b[{ansi}m{span['text']}\x1b[0m" if color else span["text"]
        lines.append(f"[{span['label']} {span['start']}:{span['end']}] {shown}")
    return "\n".join(lines)
