"""EAGLE-3's exports, one per serving engine, each with the layer ids that engine needs.

The train stage writes three folders side by side, each `config.json` + `model.safetensors`:

| folder | for | layer ids | weights |
|---|---|---|---|
| `draft/` | vLLM (`--speculative-config` method eagle3) | as trained | `midlayer.*` |
| `draft-sglang/` | SGLang (`--speculative-algorithm EAGLE3`) | trained ids - 1 | `midlayer.*` |
| `draft-speculators-eagle3/` | speculators; vLLM reads it too | as trained | `layers.0.*` |

Why SGLang gets other ids. vLLM's id i is the residual stream entering decoder layer i (HF
`hidden_states[i]`), which is how eaglet trains. SGLang adds 1 to every configured id before it
captures: `self.model.layers_to_capture = [val + 1 for val in layer_ids]` in
`python/sglang/srt/models/qwen3.py` line 791 and `python/sglang/srt/models/llama.py` line 941
(sglang 0.5.23 from PyPI, `set_eagle3_layers_to_capture`), and layer i captures its own input
(`capture_output=... if i in self.layers_to_capture`, `llama.py` line 492, handed to the layer's
`attn_boundary.prepare`). So SGLang's configured id c reads HF `hidden_states[c + 1]`, the
output of layer c: the draft trained on vLLM ids (a, b, c) must be configured as (a-1, b-1, c-1)
for SGLang. Each export's `config.json` names the convention its ids are in under
`eaglet.aux_layer_convention` (the speculators export in the speculators convention, which is
vLLM's). Folders are written whole through `atomic_folder`, so a crash never leaves a half export.

Why "eagle3" is in the speculators folder's name. vLLM 0.32 serves a speculators draft without
`"method"` two ways, as speculators' published drafts (`…-speculator.eagle3`) are served: as the
main model (`vllm serve FOLDER`: the `speculators_config` names the verifier), or in
`--speculative-config '{"model": FOLDER, ...}'`, where `SpeculativeConfig` picks the method from
the path alone (`"eagle3" in model.lower()`, `vllm/config/speculative.py`) and otherwise runs the
folder as a plain draft model, which kills the engine at the first request
(`Eagle3LlamaForCausalLM.forward() missing ... 'hidden_states'`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eaglet.config.target import TargetConfig
from eaglet.draft.checkpoint import save_tensors
from eaglet.draft.methods.base import ConfigJson, ExportConvention
from eaglet.draft.methods.eagle3_checkpoint import (
    ARCHITECTURE,
    AUX_LAYER_CONVENTION,
    MIDLAYER_PREFIX,
    SGLANG_AUX_LAYER_CONVENTION,
    SPECULATORS_LAYER_PREFIX,
    aux_layer_ids,
)
from eaglet.draft.methods.eagle3_model import ARCHITECTURE_VARIANTS
from eaglet.draft.methods.speculators import speculators_section, verifier_name, write_same_weights
from eaglet.storage import atomic_folder
from eaglet.target import load_config

VLLM_FOLDER = "draft"  # written by save_draft; checks outside the repository read this name
SGLANG_FOLDER = "draft-sglang"
SPECULATORS_FOLDER = "draft-speculators-eagle3"  # "eagle3": see the docstring
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# vLLM 0.32's registry (`_SPECULATIVE_DECODING_MODELS`): LlamaForCausalLMEagle3 and the class
# the speculators config converts to both mean this one
VLLM_CLASS = "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM"
LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


def export_convention(export: str) -> ExportConvention:
    """What the engine of each EAGLE-3 export reads of it (the table of the docstring)."""
    if export == "sglang":
        return ExportConvention(
            "sglang", ARCHITECTURE, "sglang LlamaForCausalLMEagle3", LAYER_IDS_KEY, -1,
            SGLANG_AUX_LAYER_CONVENTION,
        )  # fmt: skip
    architecture = SPECULATORS_ARCHITECTURE if export == "speculators" else ARCHITECTURE
    return ExportConvention(
        "vllm", architecture, VLLM_CLASS, LAYER_IDS_KEY, 0, AUX_LAYER_CONVENTION
    )


def vocab_problems(folder: Path, config: ConfigJson, target_vocab: int) -> list[tuple[str, str]]:
    """The draft vocabulary's maps against the target's: `vocab_size` is the target's, `d2t`
    [Vd] maps each draft id into it, `t2d` [V] marks the target ids drafted."""
    where = Path(folder) / "config.json"
    raw: dict = dict(config)
    layer = {**raw, **(raw.get("transformer_layer_config") or {})}
    vocab, draft_vocab = int(layer["vocab_size"]), int(raw["draft_vocab_size"])
    problems = []
    if vocab != target_vocab:
        problems.append(
            ("vocabulary", f"{where}: vocab_size {vocab}, the target's vocabulary {target_vocab}")
        )
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None or t2d is None:
        return problems + [("vocabulary", f"{folder / 'model.safetensors'}: no d2t/t2d maps")]
    if d2t.numel() != draft_vocab or t2d.numel() != target_vocab:
        problems.append((
            "vocabulary",
            f"{folder / 'model.safetensors'}: d2t has {d2t.numel()} entries, t2d {t2d.numel()}; "
            f"draft_vocab_size {draft_vocab} and the target's vocabulary {target_vocab} expected",
        ))  # fmt: skip
    target_ids = d2t + torch.arange(d2t.numel())
    if d2t.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= target_vocab):
        problems.append((
            "vocabulary",
            f"{folder / 'model.safetensors'}: d2t maps draft ids to target ids "
            f"{int(target_ids.min())}..{int(target_ids.max())}, outside 0..{target_vocab - 1}",
        ))  # fmt: skip
    return problems


def sglang_can_name(ids: list[int]) -> bool:
    """Whether SGLang's convention (output of layer i) can name every vLLM id: not id 0."""
    return min(ids) >= 1


def vllm_to_sglang_ids(ids: list[int]) -> list[int]:
    """vLLM ids (input of layer i) -> SGLang's configured ids (SGLang adds 1 back)."""
    if not sglang_can_name(ids):
        raise ValueError(
            f"aux layer ids {ids} include the embeddings (id 0), which SGLang's convention "
            "cannot name; train on ids >= 1 (hidden_states.aux_layer_ids)"
        )
    return [int(i) - 1 for i in ids]


def write_sglang_export(draft_dir: Path, out_dir: Path) -> Path:
    """`out_dir`: the vLLM export's weights with its layer ids in SGLang's convention."""
    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    _require_vllm_convention(config, draft_dir)
    ids = vllm_to_sglang_ids(config["eagle_aux_hidden_state_layer_ids"])
    config["eagle_aux_hidden_state_layer_ids"] = ids
    config.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = ids
    config.setdefault("eaglet", {})["aux_layer_convention"] = SGLANG_AUX_LAYER_CONVENTION
    return write_same_weights(draft_dir, out_dir, config)


def speculators_config_json(
    config: dict, verifier: str, verifier_architectures: list[str], num_speculative_tokens: int
) -> dict:
    """speculators' `Eagle3SpeculatorConfig` as JSON, from the vLLM export's config."""
    layer_keys = (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
        "max_position_embeddings", "hidden_act", "attention_bias", "mlp_bias",
    )  # fmt: skip
    layer = {key: config[key] for key in layer_keys if key in config}
    layer.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False)
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(config["eagle_aux_hidden_state_layer_ids"]),
        # the architecture variants, said outright: vLLM defaults a speculators eagle3 config's
        # norm_before_residual to True, while eaglet's layer keeps the un-normed residual
        **{key: bool(config.get(key, False)) for key in ARCHITECTURE_VARIANTS},
        "torch_dtype": config.get("torch_dtype", "float32"),
        "speculators_config": speculators_section(
            "eagle3", num_speculative_tokens, verifier, verifier_architectures
        ),
    }


def write_speculators_export(
    draft_dir: Path,
    out_dir: Path,
    verifier: str,
    verifier_architectures: list[str],
    num_speculative_tokens: int,
) -> Path:
    """`out_dir`: the draft in speculators' format (`layers.0.*`, `speculators_config`)."""
    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    _require_vllm_convention(config, draft_dir)
    spec = speculators_config_json(config, verifier, verifier_architectures, num_speculative_tokens)
    tensors = {
        SPECULATORS_LAYER_PREFIX + name[len(MIDLAYER_PREFIX) :]
        if name.startswith(MIDLAYER_PREFIX)
        else name: tensor
        for name, tensor in load_file(str(draft_dir / "model.safetensors")).items()
    }
    with atomic_folder(out_dir) as tmp:
        save_tensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(spec, indent=2) + "\n")
    return out_dir


def write_exports(
    draft_dir: Path, target: TargetConfig, num_speculative_tokens: int
) -> dict[str, str]:
    """The SGLang and speculators exports beside the vLLM export `draft_dir` (the speculators
    config names `target` as its verifier and `num_speculative_tokens` as its default k);
    returns engine -> folder name, relative to the folder holding `draft_dir`. A draft fed
    the embeddings (layer id 0) has no SGLang export: SGLang's convention cannot name them.
    Nor has a draft with an architecture variant (speculators' norms), which SGLang is not
    known to serve."""
    draft_dir = Path(draft_dir)
    architectures = getattr(load_config(target), "architectures", None) or []
    exports = {"vllm": draft_dir.name}
    config = json.loads((draft_dir / "config.json").read_text())
    variants = any(config.get(key) for key in ARCHITECTURE_VARIANTS)
    if sglang_can_name(aux_layer_ids(config, draft_dir / "config.json")) and not variants:
        write_sglang_export(draft_dir, draft_dir.with_name(SGLANG_FOLDER))
        exports["sglang"] = SGLANG_FOLDER
    write_speculators_export(
        draft_dir,
        draft_dir.with_name(SPECULATORS_FOLDER),
        verifier_name(target, draft_dir.with_name(SPECULATORS_FOLDER)),
        architectures,
        num_speculative_tokens,
    )
    exports["speculators"] = SPECULATORS_FOLDER
    return exports


def _require_vllm_convention(config: dict, draft_dir: Path) -> None:
    convention = config.get("eaglet", {}).get("aux_layer_convention", AUX_LAYER_CONVENTION)
    if convention != AUX_LAYER_CONVENTION:
        raise ValueError(
            f"{draft_dir / 'config.json'}: eaglet.aux_layer_convention is {convention!r}; "
            f"exports start from the vLLM export (convention {AUX_LAYER_CONVENTION!r})"
        )
