"""τ per segment (eaglet/draft/segments.py): every output token gets the segment the extract
split gives it, with real tokenizers' formats; each round counts once, for the segment of its
first verified position; the segments' rounds and emitted tokens add up to the whole
evaluation's, so the whole τ is their rounds-weighted mean. The evaluator's runs use the tiny
trained draft of tests/train_helpers.py's world."""

from __future__ import annotations

import pytest

from eaglet.draft.evaluate import evaluate_draft, greedy_generate, load_target
from eaglet.draft.segments import segment_rounds, token_segments
from eaglet.reasoning import ThinkOpenInPrompt, detect_format
from tests.real_tokenizers import o200k_harmony_tokenizer, qwen3_tokenizer
from tests.train_helpers import random_prompts

# `world` and `trained`: tests/conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_token_of_a_qwen3_answer_has_its_segment():
    tokenizer = qwen3_tokenizer()
    fmt = detect_format(tokenizer, "think_in_output")
    text = (
        "<think>\nadd them</think>\n\nIt is 4.<tool_call>\n"
        '{"name": "calc", "arguments": {"x": 1}}\n</tool_call><|im_end|>'
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    end = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    labels = token_segments(ids, fmt, end)
    assert len(labels) == len(ids)
    in_order = [s for i, s in enumerate(labels) if i == 0 or labels[i - 1] != s]
    assert in_order == ["thinking", "answer", "tool"]
    think_close = ids.index(tokenizer.convert_tokens_to_ids("</think>"))
    assert labels[think_close] == "thinking" and labels[think_close + 1] == "answer"
    assert labels[-1] == "tool"  # the end token takes the segment before it


def test_a_harmony_header_takes_the_segment_of_the_message_after_it(tmp_path):
    tokenizer = o200k_harmony_tokenizer(tmp_path)
    fmt = detect_format(tokenizer, "harmony")
    text = (
        "<|channel|>analysis<|message|>add them<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    labels = token_segments(ids, fmt, {tokenizer.convert_tokens_to_ids("<|return|>")})
    final_header = ids.index(tokenizer.convert_tokens_to_ids("<|start|>"))
    assert set(labels[:final_header]) == {"thinking"}  # analysis header, message, its <|end|>
    assert set(labels[final_header:]) == {"answer"}  # final header, message, <|return|>


def test_rounds_take_the_segment_of_their_first_verified_position():
    out = list(range(12))  # output index i has the label below
    labels = ["thinking"] * 5 + ["answer"] * 7
    # rounds accept 2, 0, 3, 4: pending tokens at 0, 3, 4, 8; the last round's drafts run
    # past the end (a stop inside them), the output ends at index 11
    accepted = [2, 0, 3, 4]
    rounds = segment_rounds(out, accepted, labels)
    assert rounds == [("thinking", 2, 3), ("thinking", 0, 1), ("answer", 3, 4), ("answer", 4, 3)]
    assert sum(emitted for _, _, emitted in rounds) == len(out) - 1


def test_segment_taus_weigh_into_the_whole_tau(trained, world):
    """A format whose closing tag is a token of the greedy answers splits them into thinking
    and answer; both segments' rounds and emitted tokens add up to the whole evaluation's."""
    prompts = random_prompts(6, seed=7)
    target = load_target(world / "target", "cpu")
    answers = [greedy_generate(target, p, 24, set()) for p in prompts]
    close_id = answers[0][8]  # the first answer's thinking ends at its ninth token
    fmt = ThinkOpenInPrompt(open_id=-1, close_id=close_id)
    report = evaluate_draft(
        world / "run" / "draft", world / "target", prompts, num_speculative_tokens=3,
        max_new_tokens=24, eos_token_ids=[], untrained_seed=None, device="cpu",
        reasoning_format=fmt,
    )  # fmt: skip
    segments = report["segments"]
    assert set(segments) == {"thinking", "answer"}
    rounds = sum(s["rounds"] for s in segments.values())
    assert rounds == report["num_rounds"]
    weighted = sum(s["rounds"] * s["tau"] for s in segments.values()) / rounds
    assert weighted == pytest.approx(report["tau"])
    emitted = sum(s["rounds"] * s["emitted_tau"] for s in segments.values())
    assert emitted == pytest.approx(report["new_tokens"] - len(prompts))
    for stats in segments.values():
        assert len(stats["per_position_acceptance"]) == 3
        assert stats["acceptance_rate"] == pytest.approx((stats["tau"] - 1) / 3)
    without = evaluate_draft(
        world / "run" / "draft", world / "target", prompts, num_speculative_tokens=3,
        max_new_tokens=24, eos_token_ids=[], untrained_seed=None, device="cpu",
    )  # fmt: skip
    assert "segments" not in without and without["tau"] == report["tau"]
