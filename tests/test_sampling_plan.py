"""generation.sampling_plan: each row is generated with one plan entry, chosen at tokenize time
(cycled in sample order, or drawn per sample id by weight), rendered into the prompt (reasoning
effort), sent by every engine, recorded in the generation record and counted in the quality
report; a resume sends what the first run sent."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import pytest

from eaglet.config import GenerationConfig, TokenizeConfig
from eaglet.engines.base import SamplingParams
from eaglet.extract import QualityTally
from eaglet.prompt_rendering import write_prompts
from eaglet.records.generations import Generation
from eaglet.records.io import read_jsonl, write_jsonl
from eaglet.records.prompts import Prompt
from eaglet.records.samples import Sample
from eaglet.sampling_plan import choose, sampling_label, template_kwargs
from tests.conftest import run_cli, small_run_overrides
from tests.engine_helpers import engine_for, make_config, make_prompt
from tests.real_tokenizers import qwen3_tokenizer

PLAN = [
    {"temperature": 0.0},
    {"temperature": 0.6, "top_p": 0.95, "reasoning_effort": "high"},
    {"temperature": 1.0, "weight": 2.0},
]


def generation(**settings) -> GenerationConfig:
    return GenerationConfig.model_validate({"sampling_plan": PLAN, **settings})


def test_cycle_takes_the_entries_in_turn_in_sample_order():
    chosen = [choose(generation(), f"s{i}", i)["plan_entry"] for i in range(7)]
    assert chosen == [0, 1, 2, 0, 1, 2, 0]
    assert choose(generation(), "s1", 1) == {
        "plan_entry": 1, "temperature": 0.6, "top_p": 0.95, "reasoning_effort": "high"
    }  # fmt: skip
    assert choose(GenerationConfig(), "s1", 1) is None  # no plan: the generation settings


def test_weighted_draws_per_sample_id_in_proportion_to_the_weights():
    config = generation(sampling_plan_mode="weighted")
    draws = {f"sample-{i}": choose(config, f"sample-{i}", i)["plan_entry"] for i in range(4000)}
    shares = Counter(draws.values())
    assert [shares[i] / 4000 for i in range(3)] == pytest.approx([0.25, 0.25, 0.5], abs=0.03)
    # the same id draws the same entry wherever it sits; another seed draws anew
    assert all(choose(config, sid, 0)["plan_entry"] == e for sid, e in list(draws.items())[:50])
    reseeded = generation(sampling_plan_mode="weighted", seed=7)
    assert any(choose(reseeded, sid, 0)["plan_entry"] != e for sid, e in draws.items())


def test_tokenize_writes_each_rows_entry_and_renders_its_reasoning_effort(tmp_path):
    tokenizer = copy.deepcopy(qwen3_tokenizer())
    tokenizer.chat_template = (
        "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    samples = tmp_path / "samples.jsonl"
    write_jsonl(
        samples,
        [
            Sample(sample_id=f"s{i}", source="toy", messages=[{"role": "user", "content": f"{i}?"}])
            for i in range(4)
        ],
    )
    counts, _ = write_prompts(samples, tmp_path, tokenizer, TokenizeConfig(), None, generation())
    prompts = list(read_jsonl(tmp_path / "prompts.jsonl", Prompt))
    assert counts["records"] == 4
    assert [p.sampling["plan_entry"] for p in prompts] == [0, 1, 2, 0]
    assert [p.prompt_text.startswith("Reasoning: high\n") for p in prompts] == [0, 1, 0, 0]
    assert template_kwargs({"enable_thinking": True}, prompts[1].sampling) == {
        "enable_thinking": True, "reasoning_effort": "high"
    }  # fmt: skip
    assert template_kwargs({"x": 1}, prompts[0].sampling) == {"x": 1}


def planned(prompt: Prompt, entry: int) -> Prompt:
    return prompt.model_copy(update={"sampling": choose(generation(), prompt.sample_id, entry)})


@pytest.mark.parametrize("engine", ["vllm", "sglang", "openai"])
def test_every_engine_sends_the_rows_entry(engine):
    config = make_config(["http://127.0.0.1:9"], engine, temperature=0.3, top_p=0.5)
    engine_ = engine_for(config)
    plain, effort = make_prompt(1), planned(make_prompt(2), 1)
    bodies = [engine_.request_for(p)[1] for p in (plain, effort)]
    sampling = [b.get("sampling_params", b) for b in bodies]
    assert [(s["temperature"], s["top_p"]) for s in sampling] == [(0.3, 0.5), (0.6, 0.95)]
    if engine == "openai":  # the server renders the template: the effort goes along
        assert bodies[1]["chat_template_kwargs"] == {"reasoning_effort": "high"}
        assert "chat_template_kwargs" not in bodies[0]


def test_the_record_repeats_the_entry_and_the_quality_report_counts_each():
    prompts = [planned(make_prompt(i), i) for i in range(5)]
    records = [
        Generation.answering(p, [1, 2], "length" if i == 4 else "stop", "vllm")
        for i, p in enumerate(prompts)
    ]
    assert records[1].sampling == prompts[1].sampling
    tally = QualityTally()
    for record in records:
        tally.add_setting(record)
    assert dict(tally.settings) == {
        "T=0 top_p=1": {"records": 2, "truncated": 0, "looped": 0},
        "T=0.6 top_p=0.95 effort=high": {"records": 2, "truncated": 1, "looped": 0},
        "T=1 top_p=1": {"records": 1, "truncated": 0, "looped": 0},
    }
    assert sampling_label(None) == "generation settings"
    assert SamplingParams(temperature=0.2).for_prompt(make_prompt(0)).temperature == 0.2


def test_the_local_engine_batches_rows_of_one_entry_with_its_settings():
    from eaglet.engines.local import LocalEngine

    engine = LocalEngine.__new__(LocalEngine)  # no model: the batches are recorded
    engine.batch_size, engine.params = 2, SamplingParams(temperature=0.3)
    batches = []

    def record(batch, params):
        batches.append(([p.sample_id for p in batch], params.temperature, params.top_p))
        return []

    engine._generate_batch = record
    list(engine.generate([planned(make_prompt(i), i) for i in range(5)] + [make_prompt(9)]))
    assert sorted(batches) == [
        (["s000", "s003"], 0.0, 1.0), (["s001", "s004"], 0.6, 0.95), (["s002"], 1.0, 1.0),
        (["s009"], 0.3, 1.0),
    ]  # fmt: skip


@pytest.mark.slow
def test_a_run_generates_each_row_with_its_entry_and_reports_the_counts(
    tmp_path, fixture_model_dir, sample_data_dir
):
    """The pipeline through extract on the local engine with a two-entry plan: every
    generation record carries its prompt's entry, sampled rows differ from greedy ones, and
    quality.json counts the rows per entry."""
    work_dir = tmp_path / "work"
    plan = "[{temperature: 0.0}, {temperature: 1.5, top_p: 0.9}]"
    overrides = small_run_overrides(work_dir, fixture_model_dir, sample_data_dir) + [
        f"generation.sampling_plan={plan}",
        "reasoning.max_truncation_rate=1.0",  # hot sampling may ramble to max_tokens
        "reasoning.min_capture_rate=0.0",
    ]
    args = ["run", "/dev/null", "--until", "extract", *[x for o in overrides for x in ("--set", o)]]
    result = run_cli(args, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (prompts_path,) = (work_dir / "tokenize").glob("*/prompts.jsonl")
    (generations_path,) = (work_dir / "generate").glob("*/generations.jsonl")
    (quality_path,) = (work_dir / "extract").glob("*/quality.json")
    prompts = {p.sample_id: p for p in read_jsonl(prompts_path, Prompt)}
    records = list(read_jsonl(generations_path, Generation))
    assert records and all(r.sampling == prompts[r.sample_id].sampling for r in records)
    entries = Counter(r.sampling["plan_entry"] for r in records)
    assert set(entries) == {0, 1} and abs(entries[0] - entries[1]) <= 1
    per_sampling = json.loads(Path(quality_path).read_text())["per_sampling"]
    assert set(per_sampling) == {"T=0 top_p=1", "T=1.5 top_p=0.9"}
    assert sum(c["records"] for c in per_sampling.values()) == len(records)
