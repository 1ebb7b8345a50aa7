"""`tokenize.regenerate="all"`: every assistant turn regenerated in order, the target fed its
own earlier answers, resumable mid-conversation."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from eaglet.config import PipelineConfig, TargetConfig
from eaglet.engines.base import SamplingParams
from eaglet.engines.local import LocalEngine
from eaglet.extract import write_examples
from eaglet.prompt_rendering import PromptError, render_prompt
from eaglet.reasoning import detect_format
from eaglet.records.examples import Example
from eaglet.records.generations import Generation
from eaglet.records.io import read_jsonl, write_jsonl
from eaglet.records.prompts import Prompt
from eaglet.records.samples import Sample
from eaglet.split import is_heldout
from eaglet.target import end_token_ids, load_tokenizer
from eaglet.turns import assistant_message, generate_every_turn

QUESTIONS = [
    "How many n's are in millennium?",
    "How many b's are in banana?",
    "How many a's are in mountain?",
]


def three_turn_sample(sample_id: str) -> Sample:
    messages = []
    for question in QUESTIONS:
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "an answer from the dataset"},
        ]
    return Sample(sample_id=sample_id, source="arith", messages=messages)


def test_a_conversation_splits_into_the_first_prompt_and_the_followups(fixture_model_dir):
    tokenizer = load_tokenizer(TargetConfig(model=str(fixture_model_dir)))
    prompt = render_prompt(three_turn_sample("s1"), tokenizer, {}, regenerate="all")
    assert prompt.messages == [{"role": "user", "content": QUESTIONS[0]}]
    assert prompt.followups == [
        [{"role": "user", "content": QUESTIONS[1]}],
        [{"role": "user", "content": QUESTIONS[2]}],
    ]
    last = render_prompt(three_turn_sample("s1"), tokenizer, {}, regenerate="last")
    assert len(last.messages) == 5 and last.followups == []


def test_two_assistant_turns_in_a_row_are_refused_with_the_sample_id(fixture_model_dir):
    tokenizer = load_tokenizer(TargetConfig(model=str(fixture_model_dir)))
    sample = three_turn_sample("broken-7")
    sample.messages.insert(2, {"role": "assistant", "content": "a second answer"})
    with pytest.raises(PromptError, match=r"broken-7 \(arith\): assistant turn 2"):
        render_prompt(sample, tokenizer, {}, regenerate="all")


def test_turns_of_one_conversation_are_held_out_together():
    ids = [f"c{i}" for i in range(200)]
    for sample_id in ids:
        held = is_heldout(sample_id, 0.3)
        assert is_heldout(f"{sample_id}#turn2", 0.3) == held
        assert is_heldout(f"{sample_id}#turn3", 0.3) == held


class CountingEngine:
    """The local engine, recording which prompts it was asked for; it can die after `limit`
    records, like a killed process."""

    def __init__(self, inner: LocalEngine, limit: int | None = None) -> None:
        self.inner, self.limit, self.sent = inner, limit, []

    def generate(self, prompts: list[Prompt]):
        for prompt in prompts:
            if self.limit is not None and len(self.sent) >= self.limit:
                raise RuntimeError("killed")
            self.sent.append(prompt.sample_id)
            yield from self.inner.generate([prompt])


def three_conversations(model_dir) -> tuple[PipelineConfig, object, list[Prompt]]:
    """A regenerate="all" config, the target's tokenizer and three first-turn prompts."""
    tokenizer = load_tokenizer(TargetConfig(model=str(model_dir)))
    config = PipelineConfig.model_validate(
        {"target": {"model": str(model_dir)}, "tokenize": {"regenerate": "all"}}
    )
    first = [render_prompt(three_turn_sample(f"s{i}"), tokenizer, {}, "all") for i in range(3)]
    return config, tokenizer, first


@pytest.fixture(scope="module")
def local_engine(fixture_model_dir) -> LocalEngine:
    return LocalEngine(
        TargetConfig(model=str(fixture_model_dir)), SamplingParams(max_tokens=160), batch_size=4
    )


def test_every_turn_is_generated_from_the_targets_own_earlier_answers(
    fixture_model_dir, local_engine, tmp_path
):
    config, tokenizer, first = three_conversations(fixture_model_dir)
    engine = CountingEngine(local_engine)
    summary = generate_every_turn(config, engine, tokenizer, first, tmp_path)

    records = {g.sample_id: g for g in read_jsonl(tmp_path / "generations.jsonl", Generation)}
    later = {p.sample_id: p for p in read_jsonl(tmp_path / "turn_prompts.jsonl", Prompt)}
    assert sorted(engine.sent) == sorted(records) and len(engine.sent) == len(set(engine.sent))
    assert summary.written == len(records) and summary.total == len(first) + len(later)
    assert any(sample_id.endswith("#turn3") for sample_id in records), "no conversation got far"
    reasoning_format = detect_format(tokenizer)
    end_ids = set(end_token_ids(TargetConfig(model=str(fixture_model_dir)), tokenizer))
    for sample_id, prompt in later.items():
        conversation, turn = sample_id.split("#turn")
        previous = conversation if turn == "2" else f"{conversation}#turn{int(turn) - 1}"
        own_answer = assistant_message(records[previous], tokenizer, reasoning_format, end_ids)
        # The target's own answer (not the dataset's) sits before the next user question.
        assert prompt.messages[-2] == own_answer
        assert prompt.messages[-1] == {"role": "user", "content": QUESTIONS[int(turn) - 1]}
        assert own_answer["content"] in prompt.prompt_text
        assert "an answer from the dataset" not in prompt.prompt_text
        assert prompt.prompt_text.rstrip().endswith("<think>")
        assert records[sample_id].prompt_ids == prompt.prompt_ids

    # Extract finds every turn's prompt, and re-rendering each turn agrees with its tokens.
    write_jsonl(tmp_path / "prompts.jsonl", first)
    report = write_examples(
        tmp_path / "generations.jsonl",
        [tmp_path / "prompts.jsonl", tmp_path / "turn_prompts.jsonl"],
        tmp_path,
        tokenizer,
        reasoning_format,
        end_ids,
        {},
    )
    examples = {e.sample_id: e for e in read_jsonl(tmp_path / "examples.jsonl", Example)}
    assert examples.keys() == records.keys() and report["records"] == len(records)
    # Every turn's prompt re-renders to its own tokens. An answer may still differ where the
    # template normalises what the model wrote (a reasoning that starts with a space is
    # stripped): that is counted as the model's, in the output, never in a prompt.
    lines = (tmp_path / "template_mismatches.jsonl").read_text().splitlines()
    mismatches = [json.loads(line) for line in lines]
    assert report["per_source"]["arith"]["template_mismatches"] == len(mismatches)
    assert report["per_source"]["arith"]["prompt_template_mismatches"] == 0
    assert not [m for m in mismatches if m["in_prompt"]], mismatches
    for sample_id, example in examples.items():
        assert example.input_ids == records[sample_id].prompt_ids + records[sample_id].output_ids


def test_a_run_killed_mid_conversation_resumes_without_sending_a_turn_twice(
    fixture_model_dir, local_engine, tmp_path
):
    config, tokenizer, first = three_conversations(fixture_model_dir)
    dying = CountingEngine(local_engine, limit=4)  # all first turns, one second turn
    with pytest.raises(RuntimeError, match="killed"):
        generate_every_turn(config, dying, tokenizer, first, tmp_path)
    done_before = {g.sample_id for g in read_jsonl(tmp_path / "generations.jsonl", Generation)}
    assert len(done_before) == 4

    resumed = CountingEngine(local_engine)
    summary = generate_every_turn(config, resumed, tokenizer, first, tmp_path)
    assert set(resumed.sent).isdisjoint(done_before), "a finished turn was sent again"
    counts = Counter(g.sample_id for g in read_jsonl(tmp_path / "generations.jsonl", Generation))
    assert max(counts.values()) == 1 and set(counts) == done_before | set(resumed.sent)
    assert summary.already_done == 4 and summary.written == len(resumed.sent)
