"""Small targets and example files for the hidden-states tests (no trained model needed)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from eaglet.config import PipelineConfig
from eaglet.records.examples import Example
from eaglet.records.io import write_jsonl


def tiny_target(folder: Path, seed: int = 0) -> Path:
    """A random 6-layer Llama (H=64, head_dim 32) saved with transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def write_examples(
    path: Path, count: int, seed: int = 0, min_len: int = 5, max_len: int = 60, vocab: int = 300
):
    """`count` examples of random lengths and ids; returns them."""
    rng = random.Random(seed)
    examples = []
    for i in range(count):
        n = rng.randint(min_len, max_len)
        examples.append(
            Example(
                sample_id=f"s{i:04d}",
                source="test",
                reasoning="",
                content="",
                input_ids=[rng.randrange(1, vocab) for _ in range(n)],
                loss_mask=[0] * (n // 3) + [1] * (n - n // 3),
                finish_reason="stop",
            )
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, examples)
    return examples


def config_for(work_dir: Path, model: Path, **hidden_states) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "work_dir": str(work_dir),
            "target": {"model": str(model), "device": "cpu"},
            "hidden_states": {"aux_layer_ids": [1, 3, 5], **hidden_states},
        }
    )
