"""Extraction: examples from token ids whatever the server's text said, the server cross-check
and its report, the loss mask against shifted next-token targets, the loss-mask viewer.

Runs on Qwen3's real tokenizer (see tests/real_tokenizers.py for where it comes from).
"""

from __future__ import annotations

import json

import torch

from eaglet.config import ReasoningConfig, TargetConfig
from eaglet.draft.methods.loss import shift_left
from eaglet.extract import (
    _SPAN_STYLE,
    SERVER_TEXT_SHOWN,
    QualityGateError,
    build_example,
    check_quality_gate,
    server_disagreement_line,
    server_texts,
    template_mismatch,
    write_examples,
)
from eaglet.reasoning import FORMATS, detect_format
from eaglet.records.examples import Example
from eaglet.records.generations import Generation
from eaglet.records.io import read_jsonl, write_jsonl
from eaglet.records.prompts import Prompt
from eaglet.target import load_tokenizer
from tests.extract_helpers import (
    gate_report,
    generation_variants,
    make_generation,
    qwen3_thinking_setup,
)

REASONING, CONTENT = "Two plus two is four.", "The answer is 4."

# The same generation as three servers return its text (the seeds' bug: (a) put the thinking
# into `content`, and a pipeline reading text fields trained on it as the answer).
NO_PARSER = {"content": "Two plus two is four.\n</think>\n\nThe answer is 4."}
REASONING_FIELD = {"reasoning": "Two plus two is four.\n", "content": "\n\nThe answer is 4."}
REASONING_CONTENT_FIELD = {
    "reasoning": None,
    "reasoning_content": "Two plus two is four.\n",
    "content": "\n\nThe answer is 4.",
}
OTHER_REASONING = {"reasoning": "Two plus two is five.", "content": "The answer is 4."}
NO_THINKING_SHOWN = {"content": "The answer is 4."}


def _trained_view(example: Example) -> tuple:
    return (
        example.input_ids,
        example.loss_mask,
        example.reasoning,
        example.content,
        example.tool_calls,
    )


def test_the_seeds_bug_replayed_gives_the_same_example_whatever_the_server_parsed():
    tokenizer, reasoning_format, prompt, end_ids = qwen3_thinking_setup()
    examples = {
        name: build_example(
            make_generation(prompt, tokenizer, raw), tokenizer, reasoning_format, end_ids
        )
        for name, raw in [
            ("no reasoning parser", NO_PARSER),
            ("reasoning", REASONING_FIELD),
            ("reasoning_content", REASONING_CONTENT_FIELD),
        ]
    }
    views = {name: _trained_view(example) for name, example in examples.items()}
    assert len(set(map(repr, views.values()))) == 1, views
    example = examples["reasoning"]
    assert (example.reasoning, example.content) == (REASONING, CONTENT)
    for name, example in examples.items():
        assert "server_reasoning_disagrees" not in example.flags, name
        assert ("server_thinking_in_content" in example.flags) == (name == "no reasoning parser")


def test_a_server_text_that_really_differs_is_flagged():
    tokenizer, reasoning_format, prompt, end_ids = qwen3_thinking_setup()
    for raw in (OTHER_REASONING, NO_THINKING_SHOWN):
        generation = make_generation(prompt, tokenizer, raw)
        example = build_example(generation, tokenizer, reasoning_format, end_ids)
        assert "server_reasoning_disagrees" in example.flags, raw
        assert (example.reasoning, example.content) == (REASONING, CONTENT)


def test_extract_writes_both_texts_of_each_disagreement_and_counts_servers_per_source(tmp_path):
    tokenizer, reasoning_format, prompt, end_ids = qwen3_thinking_setup()
    records = [
        ("a", "chat", NO_PARSER),
        ("b", "chat", REASONING_FIELD),
        ("c", "chat", REASONING_CONTENT_FIELD),
        ("d", "chat", OTHER_REASONING),
        ("e", "local", {}),  # the local engine keeps no server text: nothing to check
    ]
    write_jsonl(
        tmp_path / "generations.jsonl",
        [
            make_generation(prompt, tokenizer, raw, sample_id, source)
            for sample_id, source, raw in records
        ],
    )
    write_jsonl(
        tmp_path / "prompts.jsonl",
        [prompt.model_copy(update={"sample_id": s, "source": src}) for s, src, _ in records],
    )
    report = write_examples(
        tmp_path / "generations.jsonl",
        [tmp_path / "prompts.jsonl"],
        tmp_path,
        tokenizer,
        reasoning_format,
        end_ids,
        {},
    )
    lines = (tmp_path / "server_disagreements.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {
            "sample_id": "d",
            "source": "chat",
            "split_reasoning": REASONING,
            "split_content": CONTENT,
            "server_reasoning_field": "reasoning",
            "server_reasoning": "Two plus two is five.",
            "server_content": "The answer is 4.",
            "server_thinking_in_content": False,
        }
    ]
    chat, local = report["per_source"]["chat"], report["per_source"]["local"]
    assert chat["server_reasoning_disagreements"] == 1
    assert chat["server_texts_checked"] == 4
    assert chat["server_reasoning_in_field"] == 3
    assert chat["server_thinking_in_content"] == 1
    assert (local["server_texts_checked"], local["server_reasoning_disagreements"]) == (0, 0)
    assert json.loads((tmp_path / "quality.json").read_text()) == report
    examples = list(read_jsonl(tmp_path / "examples.jsonl", Example))
    assert {e.reasoning for e in examples} == {REASONING}


def test_disagreement_lines_clip_long_texts_keeping_head_and_tail():
    example = Example(
        sample_id="s",
        source="chat",
        reasoning="a" * 5000 + "z",
        content="short",
        input_ids=[1],
        loss_mask=[1],
        finish_reason="stop",
    )
    server = server_texts({"reasoning": "b" * 9000}, example.reasoning)
    line = server_disagreement_line(example, server)
    assert line["split_content"] == "short"
    for key, head, tail in (("split_reasoning", "a", "z"), ("server_reasoning", "b", "b")):
        assert len(line[key]) < SERVER_TEXT_SHOWN + 40
        assert line[key].startswith(head * 100) and line[key].endswith(tail)
        assert "chars cut" in line[key]


def test_first_output_token_is_a_target_and_no_prompt_token_is():
    """SpecForge #885: with targets shifted one to the left (position t predicts token t+1),
    the last prompt position predicts the first output token and counts; no position whose
    target is a prompt token counts. The draft's step 0 (the trainer's shift of 2) counts the
    first output token too."""
    tokenizer, reasoning_format, prompt, end_ids = qwen3_thinking_setup()
    generation = make_generation(prompt, tokenizer, {})
    example = build_example(generation, tokenizer, reasoning_format, end_ids)
    mask = torch.tensor([example.loss_mask])
    ids = example.input_ids
    prompt_length = len(prompt.prompt_ids)
    for shift in (1, 2):  # the target model's next token; the draft's first TTT step
        counted = shift_left(mask, shift)[0].nonzero().flatten().tolist()
        assert counted[0] == prompt_length - shift
        assert [ids[t + shift] for t in counted] == generation.output_ids
        assert all(t + shift >= prompt_length for t in counted)


def test_every_part_kind_of_every_format_has_a_loss_mask_viewer_style():
    for reasoning_format in FORMATS:
        missing = set(reasoning_format.part_kinds) - set(_SPAN_STYLE)
        assert not missing, f"{reasoning_format.name}: no _SPAN_STYLE for {missing}"


def test_a_cut_off_tool_call_is_reported_as_a_template_mismatch_not_a_crash(fixture_model_dir):
    """A call cut at max_tokens is not valid JSON and has no chat-message form; the template
    check must say the re-render differs, where a template would fail on a missing field."""
    tokenizer = load_tokenizer(TargetConfig(model=str(fixture_model_dir)))
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    output = 'ok\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    output_ids = tokenizer(output, add_special_tokens=False)["input_ids"]
    generation = Generation(
        sample_id="cut", source="tools", prompt_ids=prompt_ids, output_ids=output_ids,
        finish_reason="length", engine="local",
    )  # fmt: skip
    reasoning_format = detect_format(tokenizer)
    example = build_example(generation, tokenizer, reasoning_format, {2})
    assert example.tool_calls and "arguments" not in example.tool_calls[0]
    prompt = Prompt(
        sample_id="cut", source="tools", prompt_ids=prompt_ids, prompt_text=text,
        messages=messages, tools=tools,
    )  # fmt: skip
    mismatch = template_mismatch(example, prompt, tokenizer, {})
    assert mismatch is not None and not mismatch["in_prompt"]
    assert mismatch["generated"].lstrip().startswith("<tool_call>")


# --- the quality gate: one test per branch ---------------------------------------------------


def _gate_error(report: dict, reasons: bool, **thresholds) -> str | None:
    try:
        check_quality_gate(report, reasons, ReasoningConfig(**thresholds))
    except QualityGateError as exc:
        return str(exc)
    return None


def test_quality_gate_passes_good_data(tmp_path):
    tokenizer, reasoning_format, prompt, end_ids = qwen3_thinking_setup()
    generations = generation_variants(prompt, tokenizer, 4)
    report = gate_report(tmp_path, generations, prompt, reasoning_format, tokenizer, end_ids)
    assert _gate_error(report, reasoning_format.reasons) is None


def test_quality_gate_fails_on_low_capture(tmp_path):
    tokenizer, reasoning_format, prompt, end_ids = qwen3_thinking_setup()
    unclosed = tokenizer.encode("Still thinking, never closed.<|im_end|>", add_special_tokens=False)
    generations = generation_variants(prompt, tokenizer, 3) + generation_variants(
        prompt, tokenizer, 1, output_ids=unclosed, sample_id="open"
    )
    report = gate_report(tmp_path, generations, prompt, reasoning_format, tokenizer, end_ids)
    assert report["reasoning_capture_rate"] == 0.75
    error = _gate_error(report, True)  # default min_capture_rate 0.8
    assert error and "reasoning.min_capture_rate=80%" in error and "'open'" in error
    assert _gate_error(report, True, min_capture_rate=0.7) is None


def test_quality_gate_fails_on_truncation(tmp_path):
    tokenizer, reasoning_format, prompt, end_ids = qwen3_thinking_setup()
    generations = generation_variants(prompt, tokenizer, 2, finish_reason="length")
    report = gate_report(tmp_path, generations, prompt, reasoning_format, tokenizer, end_ids)
    error = _gate_error(report, True)
    assert error and "reasoning.max_truncation_rate=20%" in error


def test_quality_gate_fails_on_the_seeds_signature(tmp_path):
    """The target thinks, but extraction was told it does not (reasoning.format=none, as a
    wrong kwarg or format would make it): every answer holds the thinking and its tag."""
    tokenizer, _, prompt, end_ids = qwen3_thinking_setup()
    no_reasoning = detect_format(tokenizer, "none")
    generations = generation_variants(prompt, tokenizer, 4)
    report = gate_report(tmp_path, generations, prompt, no_reasoning, tokenizer, end_ids)
    assert report["per_source"]["chat"]["thinking_in_answer"] == 4
    error = _gate_error(report, no_reasoning.reasons)
    assert error and "reasoning.max_thinking_in_answer_rate=5%" in error
    assert "think tags in the answer" in error


def test_quality_gate_fails_on_prompts_the_template_does_not_render(tmp_path):
    """The server rendered another prompt than the configured template (SpecForge #296)."""
    tokenizer, reasoning_format, prompt, end_ids = qwen3_thinking_setup()
    other = prompt.prompt_ids[:-2] + tokenizer.encode("\n\n", add_special_tokens=False)
    generations = generation_variants(prompt, tokenizer, 4, prompt_ids=other)
    report = gate_report(tmp_path, generations, prompt, reasoning_format, tokenizer, end_ids)
    assert report["per_source"]["chat"]["prompt_template_mismatches"] == 4
    error = _gate_error(report, True)
    assert error and "reasoning.max_prompt_mismatch_rate=5%" in error
    assert _gate_error(report, True, max_prompt_mismatch_rate=1.0) is None


def test_capture_rate_never_exceeds_one_when_a_truncated_answer_closed_its_reasoning(tmp_path):
    """Truncated records leave the rate's denominator; one whose reasoning closed before the
    cut must leave its numerator too (it read 133% here before)."""
    tokenizer, reasoning_format, prompt, end_ids = qwen3_thinking_setup()
    generations = generation_variants(prompt, tokenizer, 3) + generation_variants(
        prompt, tokenizer, 1, finish_reason="length", sample_id="cut"
    )
    report = gate_report(tmp_path, generations, prompt, reasoning_format, tokenizer, end_ids)
    assert report["reasoning_capture_rate"] == 1.0
    assert all(f["reasoning_capture_rate"] <= 1.0 for f in report["per_source"].values())


def test_the_per_source_quality_table_has_a_column_per_source_not_per_figure():
    """Issue 47: the `data-quality-per-source` table (a column per figure, some twenty) was
    wider than its pane; a row per figure and a column per source fits it."""
    from eaglet.stage_bodies.extract import per_source_rows

    rows = per_source_rows({
        "arith": {"records": 16, "reasoning_capture_rate": 0.93751, "sequence_tokens": [3, 4]},
        "tools": {"records": 8, "reasoning_capture_rate": 1.0, "sequence_tokens": [5]},
    })  # fmt: skip
    assert rows == [
        {"figure": "records", "arith": 16, "tools": 8},
        {"figure": "reasoning_capture_rate", "arith": 0.938, "tools": 1.0},
    ]
