"""What the draft borrows from the target: its frozen `embed_tokens` and `lm_head` (or the one
tied matrix) and a few config numbers.

The two matrices are read straight from the target's safetensors files by tensor name
(`model.safetensors`, or the shards `model.safetensors.index.json` lists), so training needs
memory for two [V, H] matrices, not for the whole target. Only those files (and config.json)
are fetched for a hub id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import torch
from safetensors import safe_open

from eaglet.config.target import TargetConfig
from eaglet.target import load_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class TargetNumbers(TypedDict):
    """The numbers of the target's config a draft is built from and checked against."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    pad_token_id: int | None
    num_hidden_layers: int
    tie_word_embeddings: bool


@dataclass
class TargetHead:
    """Frozen embeddings, lm_head and the config numbers the draft copies."""

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    config: TargetNumbers


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    params = params.get("full_attention", params)  # per-layer-type dicts (transformers 5)
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


def head_config(cfg) -> TargetNumbers:
    """The numbers of a transformers (text) config the draft is built from."""
    heads = cfg.num_attention_heads
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(cfg),
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", 32768),
        "vocab_size": cfg.vocab_size,
        "pad_token_id": getattr(cfg, "pad_token_id", None),
        "num_hidden_layers": cfg.num_hidden_layers,
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
    }


def _fetch(target: TargetConfig, filename: str) -> Path | None:
    """A file of the target: from its folder, or downloaded alone from the hub; None if absent."""
    folder = Path(target.model)
    if folder.is_dir():
        path = folder / filename
        return path if path.exists() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(target.model, filename, revision=target.revision))
    except EntryNotFoundError:
        return None


def tensor_files(target: TargetConfig) -> dict[str, str]:
    """Tensor name -> the safetensors file (name relative to the model) that holds it."""
    index = _fetch(target, INDEX_FILE)
    if index is not None:
        return dict(json.loads(index.read_text())["weight_map"])
    single = _fetch(target, SINGLE_FILE)
    if single is None:
        raise FileNotFoundError(
            f"target {target.model} has neither {SINGLE_FILE} nor {INDEX_FILE}; the trainer "
            "reads embed_tokens and lm_head from safetensors (convert the checkpoint first)"
        )
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), SINGLE_FILE)


def _find(names: dict[str, str], suffix: str) -> str | None:
    """The tensor name ending in `suffix` with the shortest prefix (model.X before mtp.X)."""
    found = sorted((n for n in names if n == suffix or n.endswith("." + suffix)), key=len)
    return found[0] if found else None


def _read(target: TargetConfig, names: dict[str, str], name: str) -> torch.Tensor:
    path = _fetch(target, names[name])
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name).float()


def load_target_head(target: TargetConfig) -> TargetHead:
    """embed_tokens and lm_head (fp32) by tensor name, and the config numbers; a tied model (or
    one whose files hold no lm_head) uses the embedding matrix for both."""
    names = tensor_files(target)
    config = head_config(load_config(target))
    embed_name = _find(names, "embed_tokens.weight")
    if embed_name is None:
        raise KeyError(f"no '*embed_tokens.weight' tensor in the safetensors of {target.model}")
    embed = _read(target, names, embed_name)
    head_name = None if config["tie_word_embeddings"] else _find(names, "lm_head.weight")
    lm_head = embed if head_name is None else _read(target, names, head_name)
    V, H = config["vocab_size"], config["hidden_size"]
    for name, matrix in (("embed_tokens", embed), ("lm_head", lm_head)):
        if matrix.shape[1] != H or matrix.shape[0] < V:
            raise ValueError(
                f"{target.model}: {name} is {tuple(matrix.shape)}, config.json says "
                f"vocab_size {V} x hidden_size {H}"
            )
    return TargetHead(embed=embed[:V], lm_head=lm_head[:V], config=config)
