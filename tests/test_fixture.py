"""Tests of the fixture target model, its tokenizer and chat template, and the demo data."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest

from eaglet.fingerprints import model_fingerprint
from eaglet.fixture.corpus import generate_conversations, prompt_and_target
from eaglet.fixture.sample_data import write_sample_data
from eaglet.fixture.tokenizer import (
    ALL_ADDED_TOKENS,
    GENERATION_PROMPT,
    IM_END,
    PAD_TOKEN,
    THINK_CLOSE,
    build_tokenizer,
    save_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(build_tokenizer(seed=0), out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- corpus ----------------------------------------------------------------------------


def test_corpus_is_deterministic_and_has_every_shape() -> None:
    first = generate_conversations(200, seed=3)
    assert first == generate_conversations(200, seed=3)
    assert first != generate_conversations(200, seed=4)
    assert any(c["tools"] and any("tool_calls" in m for m in c["messages"]) for c in first)
    assert any(sum(m["role"] == "user" for m in c["messages"]) >= 2 for c in first)
    assert any(c["messages"][0]["role"] == "system" for c in first)
    for conversation in first:
        assert conversation["messages"][-1]["role"] == "assistant"
        assert conversation["messages"][-1]["reasoning_content"]


# --- tokenizer and chat template -------------------------------------------------------


def test_added_tokens_are_single_ids(tokenizer) -> None:
    ids = [tokenizer.encode(token, add_special_tokens=False) for token in ALL_ADDED_TOKENS]
    assert all(len(one) == 1 for one in ids)
    assert len({one[0] for one in ids}) == len(ALL_ADDED_TOKENS)
    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token == PAD_TOKEN
    # Tags survive skip_special_tokens (reasoning parsers need them), control tokens do not.
    text = f"a\n{THINK_CLOSE}\n\nb{IM_END}"
    decoded = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), True)
    assert decoded == f"a\n{THINK_CLOSE}\n\nb"


def test_saved_tokenizer_files(tokenizer_dir: Path) -> None:
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert "<think>" in config["chat_template"]
    assert config["eos_token"] == IM_END
    assert config["pad_token"] == PAD_TOKEN
    assert (tokenizer_dir / "chat_template.jinja").exists()


def test_generation_prompt_opens_think(tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 plus 2?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.endswith(GENERATION_PROMPT)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")


def test_prompt_is_prefix_of_full_conversation(tokenizer) -> None:
    for conversation in generate_conversations(300, seed=1, stream="test-template"):
        prompt_conv, target = prompt_and_target(conversation)
        tools = conversation["tools"]
        prompt = tokenizer.apply_chat_template(
            prompt_conv["messages"], tools=tools, add_generation_prompt=True, tokenize=False
        )
        full = tokenizer.apply_chat_template(conversation["messages"], tools=tools, tokenize=False)
        assert full.startswith(prompt)
        completion = full[len(prompt) :]
        assert completion == (
            f"{target['reasoning_content']}\n</think>\n\n{target['content']}<|im_end|>\n"
        )
        # Tokenizing the prompt and the completion separately gives the same ids.
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        completion_ids = tokenizer.encode(completion, add_special_tokens=False)
        assert prompt_ids + completion_ids == tokenizer.encode(full, add_special_tokens=False)


def test_earlier_assistant_turns_drop_reasoning(tokenizer) -> None:
    conversation = generate_conversations(1, seed=0, kind="multi_turn")[0]
    messages = conversation["messages"]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.count("<think>") == 1
    assert messages[1]["reasoning_content"] not in text


def test_tool_call_rendering(tokenizer) -> None:
    conversation = generate_conversations(1, seed=0, kind="tool_call")[0]
    text = tokenizer.apply_chat_template(
        conversation["messages"], tools=conversation["tools"], tokenize=False
    )
    call = conversation["messages"][-3]["tool_calls"][0]["function"]
    rendered_call = json.dumps({"name": call["name"], "arguments": call["arguments"]})
    assert f"</think>\n\n<tool_call>\n{rendered_call}\n</tool_call><|im_end|>" in text
    assert "<tool_response>\n" in text
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # tools in the system block


def test_tokenizer_is_deterministic(tokenizer_dir: Path, tmp_path: Path) -> None:
    save_tokenizer(build_tokenizer(seed=0), tmp_path)
    assert sha256(tmp_path / "tokenizer.json") == sha256(tokenizer_dir / "tokenizer.json")


# --- sample data -----------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sample_data(tmp_path: Path) -> None:
    paths = write_sample_data(tmp_path / "a", seed=0)
    assert set(paths) == {"arith", "tools", "mixed", "mt-bench", "gsm8k"}
    mt_bench = read_jsonl(paths["mt-bench"])
    assert len(mt_bench) == 12 and all(len(row["turns"]) == 2 for row in mt_bench)
    assert all(row["answer"].split("#### ")[1].isdigit() for row in read_jsonl(paths["gsm8k"]))

    arith = read_jsonl(paths["arith"])
    assert len(arith) == 150
    assert all(row["conversations"][-1]["from"] == "gpt" for row in arith)
    assert any(sum(t["from"] == "human" for t in row["conversations"]) >= 2 for row in arith)
    assert any(row["conversations"][0]["from"] == "system" for row in arith)

    tools = read_jsonl(paths["tools"])
    assert len(tools) == 100
    assert all(row["tools"] for row in tools)
    calls = [row for row in tools if any("tool_calls" in m for m in row["messages"])]
    assert 0 < len(calls) < len(tools)
    for row in calls:
        roles = [m["role"] for m in row["messages"]]
        assert roles[-3:] == ["assistant", "tool", "assistant"]
        call = row["messages"][-3]["tool_calls"][0]
        assert call["type"] == "function"
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert not any("reasoning_content" in m for row in tools for m in row["messages"])

    mixed = pd.read_parquet(paths["mixed"])
    assert len(mixed) == 50
    assert list(mixed.columns) == ["id", "messages_json", "tools_json"]
    messages = [json.loads(text) for text in mixed["messages_json"]]
    assert all(m[-1]["role"] == "assistant" for m in messages)
    assert mixed["tools_json"].isna().any() and mixed["tools_json"].notna().any()

    again = write_sample_data(tmp_path / "b", seed=0)
    assert all(sha256(paths[name]) == sha256(again[name]) for name in paths)


# --- model -----------------------------------------------------------------------------


def has_reasoning_format(tokens: list[int], think_close_id: int, eos_id: int) -> bool:
    """`</think>` is emitted, and `<|im_end|>` comes after it."""
    if think_close_id not in tokens:
        return False
    return eos_id in tokens[tokens.index(think_close_id) + 1 :]


@pytest.mark.slow
def test_fixture_model_builds_loads_and_reasons(fixture_model_dir: Path) -> None:
    """The session's fixture model (tests/conftest.py builds it with the defaults)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglet.fixture.model import eval_prompts, greedy_generate

    out = fixture_model_dir
    for name in ("config.json", "generation_config.json", "model.safetensors", "fixture.json"):
        assert (out / name).exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.model_type == "qwen3"
    assert model.config.num_hidden_layers == 8
    assert model.config.head_dim >= 32
    assert model.dtype == torch.float32
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos

    completions = greedy_generate(model, tokenizer, eval_prompts(20, seed=5))
    think_close = tokenizer.convert_tokens_to_ids(THINK_CLOSE)
    good = sum(has_reasoning_format(tokens, think_close, eos) for tokens in completions)
    # Measured with the default 250 steps: 20/20 here, 99/100 on the seed-0 eval prompts.
    # A 2M-parameter model still sometimes never closes its reasoning, hence the margin.
    assert good >= 18, f"only {good}/20 completions have the reasoning format"


@pytest.mark.slow
def test_fixture_model_build_is_deterministic(tmp_path: Path) -> None:
    from eaglet.fixture.model import build_fixture_model

    lines: list[str] = []
    done: list[tuple[int, int]] = []
    first = build_fixture_model(
        tmp_path / "a", seed=0, train_steps=3, log=lines.append, progress=lambda *d: done.append(d)
    )
    # issue 38: the build a UI run of the demo waits for says its rate and ETA, and its progress
    assert any("tok/s, ETA" in line for line in lines), lines
    assert done[0] == (1, 3) and done[-1] == (3, 3), done
    second = build_fixture_model(tmp_path / "b", seed=0, train_steps=3, log=lambda _: None)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert sha256(first / name) == sha256(second / name), name
    # Every file is the same (fixture.json once held the build time): two fresh clones' demos
    # key tokenize and every later stage alike, as the target's fingerprint hashes them all.
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    for path in first.iterdir():
        assert sha256(path) == sha256(second / path.name), path.name
    assert model_fingerprint(str(first)) == model_fingerprint(str(second))
    info = json.loads((first / "fixture.json").read_text())
    assert info["seed"] == 0 and info["train_steps"] == 3
    # Rebuilding over an existing directory replaces it.
    again = build_fixture_model(tmp_path / "a", seed=1, train_steps=1, log=lambda _: None)
    assert json.loads((again / "fixture.json").read_text())["seed"] == 1


def test_a_fixture_trained_further_on_the_restyled_corpus_is_deterministic(
    tmp_path, fixture_model_dir
):
    """Issue 51's drifted target: the fixture's tokenizer kept, its weights trained further on
    reasoning worded another way; two builds are byte-identical, its record names where it
    came from, and its weights differ from the first's."""
    from eaglet.fixture.corpus import RESTYLE, generate_conversations
    from eaglet.fixture.model import build_fixture_model

    plain = generate_conversations(20, 0)
    restyled = generate_conversations(20, 0, corpus="restyled")
    reasoning = [m["reasoning_content"] for c in restyled for m in c["messages"]
                 if m.get("reasoning_content")]  # fmt: skip
    assert not any(old in text for text in reasoning for old, _ in RESTYLE)
    assert [c["messages"][-1]["content"] for c in plain] == [
        c["messages"][-1]["content"] for c in restyled
    ]  # the same tasks and answers

    builds = [
        build_fixture_model(tmp_path / name, train_steps=2, log=lambda _: None,
                            continue_from=fixture_model_dir, corpus="restyled")
        for name in ("a", "b")
    ]  # fmt: skip
    for path in builds[0].iterdir():
        assert sha256(path) == sha256(builds[1] / path.name), path.name
    assert sha256(builds[0] / "tokenizer.json") == sha256(fixture_model_dir / "tokenizer.json")
    assert sha256(builds[0] / "model.safetensors") != sha256(
        fixture_model_dir / "model.safetensors"
    )
    info = json.loads((builds[0] / "fixture.json").read_text())
    assert info["corpus"] == "restyled" and info["continued_from"]["train_steps"] == 250
