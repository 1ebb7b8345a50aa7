"""EAGLE-3's checkpoint: the draft as vLLM and SGLang load it, and every EAGLE-3 format read back.

`save_draft` / `load_draft`: `config.json` + `model.safetensors` (no pickle) in the EAGLE-3
layout that vLLM (`LlamaForCausalLMEagle3` -> `Eagle3LlamaForCausalLM`) and SGLang load:
  `midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t` (int64 [Vd]), `t2d` (bool [V]).
  The aux layer ids are written as given, top level and under `eagle_config`, with the convention
  they are in under `eaglet.aux_layer_convention`. `load_draft` also reads the other exports
  (`eaglet.draft.methods.eagle3_exports`: SGLang ids, speculators format) and `aux_layer_ids`
  gives any of them back in the convention eaglet trains and evaluates in (vLLM's).
Folders are written next to their final place and renamed in (`atomic_folder`), so a crash never
leaves a half-written checkpoint where a reader would look.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eaglet.draft.checkpoint import module_tensors, save_tensors
from eaglet.draft.methods.eagle3_model import ARCHITECTURE_VARIANTS, Eagle3Config, Eagle3Draft
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION
from eaglet.storage import atomic_folder

ARCHITECTURE = "LlamaForCausalLMEagle3"
# SGLang's configured id i is the output of decoder layer i (it adds 1; see eagle3_exports.py)
SGLANG_AUX_LAYER_CONVENTION = "sglang: id i = output of decoder layer i = HF hidden_states[i+1]"
MIDLAYER_PREFIX = "midlayer."  # EAGLE/SGLang/vLLM weight names of the decoder layer
SPECULATORS_LAYER_PREFIX = "layers.0."  # speculators' names of the same layer
# frozen copies of target weights that speculators' checkpoints carry; eaglet's draft is handed
# the target's own (config_from_json refuses a draft that trained its embeddings)
TARGET_COPIES = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def draft_config_json(
    config: Eagle3Config, aux_layer_ids: list[int], aux_layer_convention: str
) -> dict:
    ids = [int(i) for i in aux_layer_ids]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        # the architecture variants, said outright (vLLM reads each)
        **{key: getattr(config, key) for key in ARCHITECTURE_VARIANTS},
        "eaglet": {"aux_layer_convention": aux_layer_convention},
    }


def config_from_json(d: Mapping[str, Any]) -> Eagle3Config:
    """The draft's shape and architecture variants from its config.json, in any export or as
    speculators' trainer writes it. An absent variant key means what vLLM takes it to mean:
    `norm_before_residual` is True in speculators' format and False elsewhere."""
    speculators = d.get("speculators_model_type") == "eagle3"
    if speculators:  # speculators format: the layer is nested
        d = {**d, **d["transformer_layer_config"], "draft_vocab_size": d["draft_vocab_size"]}
    if d.get("embed_requires_grad"):
        raise ValueError(
            "the draft trained its own token embeddings (embed_requires_grad); eaglet's draft "
            "reads the target's"
        )
    windowed = "sliding_attention" in (d.get("layer_types") or []) or d.get("use_sliding_window")
    rope_theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta")
    return Eagle3Config(
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"],
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        vocab_size=d["vocab_size"],
        draft_vocab_size=d["draft_vocab_size"],
        target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
        rms_norm_eps=d["rms_norm_eps"],
        rope_theta=rope_theta or 10000.0,
        max_position_embeddings=d["max_position_embeddings"],
        num_aux_layers=len(d.get("eagle_aux_hidden_state_layer_ids", [0, 0, 0])),
        norm_before_fc=bool(
            d.get("eagle_config", {}).get("norm_before_fc", d.get("norm_before_fc", False))
        ),
        norm_before_residual=bool(d.get("norm_before_residual", speculators)),
        norm_output=bool(d.get("norm_output", False)),
        sliding_window=d.get("sliding_window") if windowed else None,
    )


def aux_layer_ids(config: Mapping[str, Any], where: Path | str = "config.json") -> list[int]:
    """The draft's aux layer ids in the vLLM convention (HF `hidden_states[i]`), whichever
    EAGLE-3 export `config` (a draft's config.json) comes from: eaglet's label says which
    convention its ids are in; a config without one (speculators format, a peer's vLLM
    checkpoint) is read as vLLM reads it."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_config", {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if not ids:
        raise ValueError(
            f"{where}: no eagle_aux_hidden_state_layer_ids; pass the ids the draft was trained on"
        )
    convention = config.get("eaglet", {}).get("aux_layer_convention", AUX_LAYER_CONVENTION)
    if convention == AUX_LAYER_CONVENTION:
        return [int(i) for i in ids]
    if convention == SGLANG_AUX_LAYER_CONVENTION:
        return [int(i) + 1 for i in ids]
    raise ValueError(
        f"{where}: eaglet.aux_layer_convention {convention!r} is neither "
        f"{AUX_LAYER_CONVENTION!r} nor {SGLANG_AUX_LAYER_CONVENTION!r}; pass the ids in the "
        "first (HF hidden_states indices) explicitly"
    )


def save_draft(
    model: Eagle3Draft, out_dir: Path, aux_layer_ids: list[int], aux_layer_convention: str
) -> Path:
    """Write `config.json` + `model.safetensors` (float32) into `out_dir`."""
    out_dir = Path(out_dir)
    config = draft_config_json(model.config, aux_layer_ids, aux_layer_convention)
    with atomic_folder(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_tensors(module_tensors(model), tmp / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def load_draft(
    draft_dir: Path, device: str | torch.device = "cpu"
) -> tuple[Eagle3Draft, dict[str, Any]]:
    """The draft and its config.json dict, exactly as saved; any of the exports (vLLM, SGLang,
    speculators format) loads."""
    draft_dir = Path(draft_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    model = Eagle3Draft(config_from_json(config))
    tensors = {
        MIDLAYER_PREFIX + name[len(SPECULATORS_LAYER_PREFIX) :]
        if name.startswith(SPECULATORS_LAYER_PREFIX)
        else name: tensor
        for name, tensor in load_file(str(draft_dir / "model.safetensors")).items()
        if name not in TARGET_COPIES
    }
    model.load_state_dict(tensors, strict=True)
    return model.to(device), config
