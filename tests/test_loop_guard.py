"""The loop guard (eaglet/loop_guard.py): the detector, the HTTP engines' streamed
requests against the stand-in server (tests/fake_servers.py) with looping prompts, and extract's
`reasoning.looped_rows`. Against real vLLM: tests/test_engines_vllm.py."""

from __future__ import annotations

import json
import random

import pytest

from eaglet.loop_guard import LoopDetector, first_loop
from eaglet.records.generations import Generation
from eaglet.records.io import read_jsonl
from tests.engine_helpers import TOKENIZER, collect, engine_for, make_config, make_prompt
from tests.extract_helpers import gate_report, generation_variants, qwen3_thinking_setup
from tests.fake_servers import FakeServer, serve


def test_a_repeated_paragraph_is_caught_after_the_set_number_of_rounds():
    paragraph = list(range(100, 150))  # 50 tokens
    answer = list(range(10)) + paragraph * 20
    # each 8-gram inside the paragraph is seen once per round: the 3rd round completes the
    # first 8-gram's third occurrence
    stop = first_loop(answer, ngram=8, repeats=3)
    assert stop == 10 + 2 * 50 + 8
    assert first_loop(answer, ngram=8, repeats=21) is None  # never 21 times
    detector = LoopDetector(8, 3)
    assert not detector.feed(answer[: stop - 1]) and detector.feed(answer[stop - 1 : stop])
    assert detector.evidence()["repeated_ids"] == paragraph[:8]
    assert detector.feed([1, 2, 3])  # stays looping


def test_ordinary_answers_are_not_stopped():
    rng = random.Random(0)
    assert first_loop([rng.randrange(50_000) for _ in range(20_000)], 32, 8) is None
    # a short refrain (a list's bullet, a table's separator) repeated is not a loop of 32
    refrain = [7, 8, 9]
    text = [t for i in range(500) for t in (refrain + [1000 + i] * 2)]
    assert first_loop(text, 32, 8) is None


@pytest.mark.parametrize(
    "engine, server_options",
    [
        ("vllm", {}),
        ("sglang", {}),
        ("sglang", {"sglang_incremental": True}),
        ("openai", {}),
        ("openai", {"chat_token_ids": False}),
    ],
    ids=["vllm", "sglang-cumulative", "sglang-incremental", "openai", "openai-text-only"],
)
def test_the_engine_stops_looping_answers_and_keeps_the_others_token_exact(engine, server_options):
    """Streamed as vLLM streams completions and chat completions (with token ids, or text
    only: the guard reads the text's tokens), and as SGLang streams /generate (every id so far
    in each event, its default, or only the new ones with --incremental-streaming-output)."""
    server = FakeServer(TOKENIZER, loop_share=0.5, token_delay_s=0.0005, **server_options)
    prompts = [make_prompt(i) for i in range(12)]
    looping = {p.sample_id for p in prompts if server.loops(p.prompt_ids)}
    assert 0 < len(looping) < 12
    with serve(server) as url:
        guarded = collect(engine_for(make_config([url], engine, max_tokens=600)), prompts)
        spent_guarded = server.generated_tokens
        server.generated_tokens = 0
        unguarded = make_config([url], engine, max_tokens=600, loop_guard=False)
        plain = collect(engine_for(unguarded), prompts)
        spent_plain = server.generated_tokens
    by_id = {g.sample_id: g for g in plain}
    assert all(isinstance(g, Generation) for g in guarded + plain)
    assert all(server.log[i]["body"].get("stream") for i in range(12))
    assert all(not server.log[i]["body"].get("stream") for i in range(12, 24))
    for record in guarded:
        full = by_id[record.sample_id]
        if record.sample_id in looping:
            assert record.finish_reason == "loop" and full.finish_reason == "length"
            assert full.output_ids[: len(record.output_ids)] == record.output_ids  # a prefix
            assert len(record.output_ids) < 600 // 2
            assert record.raw["loop"]["ngram"] == 32 and record.raw["streamed"] is True
        else:
            assert (record.output_ids, record.finish_reason) == (full.output_ids, "stop")
            assert record.token_exact == full.token_exact == server.chat_token_ids
            texts = ("text", "content", "reasoning")
            assert [record.raw.get(k) for k in texts] == [full.raw.get(k) for k in texts]
    # the server stopped generating each looping answer once its request ended
    assert spent_guarded < 0.6 * spent_plain, (spent_guarded, spent_plain)


def test_extract_drops_looped_rows_or_keeps_them_and_counts_them(tmp_path):
    tokenizer, reasoning_format, prompt, end_ids = qwen3_thinking_setup()
    generations = generation_variants(prompt, tokenizer, 3) + generation_variants(
        prompt, tokenizer, 1, finish_reason="loop", sample_id="looped-1"
    )
    dropped = gate_report(tmp_path, generations, prompt, reasoning_format, tokenizer, end_ids)
    examples = [json.loads(line) for line in (tmp_path / "examples.jsonl").open()]
    assert [e["sample_id"] for e in examples] == ["g0", "g1", "g2"]
    assert dropped["looped"] == 1 and dropped["records"] == 3
    assert dropped["per_source"]["chat"]["looped"] == 1
    assert dropped["example_ids_by_flag"]["looped"] == ["looped-1"]
    assert dropped["reasoning_capture_rate"] == 1.0

    from eaglet.extract import write_examples
    from eaglet.records.examples import Example

    kept = write_examples(
        tmp_path / "generations.jsonl", [tmp_path / "prompts.jsonl"], tmp_path, tokenizer,
        reasoning_format, end_ids, {}, looped_rows="keep",
    )  # fmt: skip
    examples = {e.sample_id: e for e in read_jsonl(tmp_path / "examples.jsonl", Example)}
    assert "looped" in examples["looped-1"].flags and kept["records"] == 4
    assert kept["looped"] == 1 and kept["reasoning_capture_rate"] == 1.0  # judged apart


def test_the_local_engine_ends_a_looping_row_where_the_detector_finds_the_loop(
    fixture_model_dir,
):
    """The local engine's guard, on the fixture target, greedy: with a hair-trigger guard
    (4-grams, twice) each row that loops ends where `first_loop` finds the loop in the same
    row's unguarded answer, with the unguarded ids up to there and finish_reason 'loop'; every
    other row is its unguarded record unchanged."""
    from eaglet.config import TargetConfig
    from eaglet.engines.base import SamplingParams
    from eaglet.engines.local import LocalEngine
    from eaglet.records.prompts import Prompt
    from eaglet.target import load_tokenizer

    target = TargetConfig(model=str(fixture_model_dir))
    tokenizer = load_tokenizer(target)
    prompts = []
    for i in range(8):
        messages = [{"role": "user", "content": f"What is {i} + {7 * i}?"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append(
            Prompt(
                sample_id=f"s{i}", source="toy", prompt_ids=ids, prompt_text=text,
                messages=messages,
            )
        )  # fmt: skip
    engine = LocalEngine(target, SamplingParams(max_tokens=96), batch_size=4)
    plain = {r.sample_id: r for r in engine.generate(prompts)}
    engine.loop_guard = (4, 2)
    guarded = {r.sample_id: r for r in engine.generate(prompts)}

    ends = {*engine.eos_ids, engine.pad_id}
    looped = 0
    for sample_id, record in guarded.items():
        unguarded = [t for t in plain[sample_id].output_ids if t not in ends]
        stop = first_loop(unguarded, 4, 2)
        if record.finish_reason == "loop":
            looped += 1
            assert len(record.output_ids) == stop == record.raw["loop"]["stopped_at_token"]
            assert record.output_ids == unguarded[:stop]
        else:
            assert stop is None, sample_id
            assert record == plain[sample_id]
    print(
        f"{looped} of {len(prompts)} rows looped: {[len(r.output_ids) for r in guarded.values()]}"
    )
    assert looped > 0  # the hair trigger finds some: the comparison above meant something
