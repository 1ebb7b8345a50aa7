"""One export per serving engine: vLLM (`draft/`), SGLang (`draft-sglang/`, ids - 1) and
speculators (`draft-speculators-eagle3/`, `layers.0.*`), each loading back to the same draft and
naming the layer ids that engine needs. Real vLLM loading is in tests/test_serving_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from eaglet.config import TargetConfig
from eaglet.draft.evaluate import resolve_aux_ids
from eaglet.draft.methods.eagle3_checkpoint import (
    SGLANG_AUX_LAYER_CONVENTION,
    aux_layer_ids,
    load_draft,
    save_draft,
)
from eaglet.draft.methods.eagle3_exports import (
    SGLANG_FOLDER,
    SPECULATORS_FOLDER,
    vllm_to_sglang_ids,
    write_exports,
)
from eaglet.draft.methods.eagle3_model import Eagle3Config, Eagle3Draft
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION

IDS = [2, 5, 9]


def export_draft(tmp_path: Path, ids: list[int], **variants):
    """A small random draft saved with `ids` and every export written beside it."""
    torch.manual_seed(0)
    config = Eagle3Config(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=50, draft_vocab_size=20, target_hidden_size=32, **variants,
    )  # fmt: skip
    draft = Eagle3Draft(config)
    draft.set_vocab(torch.arange(20) * 2, torch.arange(50) % 5 == 0)
    save_draft(draft, tmp_path / "train" / "draft", ids, AUX_LAYER_CONVENTION)
    Qwen3Config(
        hidden_size=32, num_hidden_layers=10, vocab_size=50, architectures=["Qwen3ForCausalLM"]
    ).save_pretrained(
        tmp_path / "target"
    )  # the verifier named in the speculators config: its config.json is enough
    target = TargetConfig(model=str(tmp_path / "target"))
    folders = write_exports(tmp_path / "train" / "draft", target, num_speculative_tokens=3)
    return draft, tmp_path / "train", folders


@pytest.fixture
def exported(tmp_path):
    return export_draft(tmp_path, IDS)


def test_a_draft_fed_the_embeddings_gets_no_sglang_export(tmp_path):
    """Id 0 (the embeddings) has no name in SGLang's convention: the vLLM and speculators
    exports are written, the SGLang one is left out rather than written wrong."""
    _, root, folders = export_draft(tmp_path, [0, 4, 5])
    assert folders == {"vllm": "draft", "speculators": SPECULATORS_FOLDER}
    assert not (root / SGLANG_FOLDER).exists()
    speculators = json.loads((root / SPECULATORS_FOLDER / "config.json").read_text())
    assert speculators["eagle_aux_hidden_state_layer_ids"] == [0, 4, 5]


def test_a_draft_with_speculators_norms_keeps_them_in_every_export_it_gets(tmp_path):
    """The variants reach the vLLM and speculators configs (vLLM reads them there) and load
    back; SGLang, not known to serve them, gets no export rather than a wrong one."""
    variants = dict(norm_before_fc=True, norm_before_residual=True, norm_output=True)
    draft, root, folders = export_draft(tmp_path, IDS, **variants)
    assert folders == {"vllm": "draft", "speculators": SPECULATORS_FOLDER}
    assert not (root / SGLANG_FOLDER).exists()
    for name in ("draft", SPECULATORS_FOLDER):
        config = json.loads((root / name / "config.json").read_text())
        assert all(config[key] is True for key in variants), name
        loaded, _ = load_draft(root / name)
        assert loaded.config.norm_before_fc and loaded.config.norm_output, name
        assert torch.equal(loaded.input_norm.weight, draft.input_norm.weight), name


def test_each_export_names_the_ids_its_engine_reads(exported):
    _, root, folders = exported
    assert folders == {"vllm": "draft", "sglang": SGLANG_FOLDER, "speculators": SPECULATORS_FOLDER}
    vllm = json.loads((root / "draft" / "config.json").read_text())
    sglang = json.loads((root / SGLANG_FOLDER / "config.json").read_text())
    spec = json.loads((root / SPECULATORS_FOLDER / "config.json").read_text())

    assert vllm["eagle_aux_hidden_state_layer_ids"] == IDS
    assert vllm["eaglet"]["aux_layer_convention"] == AUX_LAYER_CONVENTION
    # SGLang adds 1 to what it reads: configure one less to capture the same residual stream
    assert sglang["eagle_aux_hidden_state_layer_ids"] == [1, 4, 8]
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 8]
    assert sglang["eaglet"]["aux_layer_convention"] == SGLANG_AUX_LAYER_CONVENTION
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"]
    assert spec["eagle_aux_hidden_state_layer_ids"] == IDS

    # read back, every export means the same HF hidden_states indices
    for name in ("draft", SGLANG_FOLDER, SPECULATORS_FOLDER):
        config = json.loads((root / name / "config.json").read_text())
        assert aux_layer_ids(config) == IDS, name
        assert resolve_aux_ids(config, None) == IDS, name


def test_speculators_export_follows_speculators_schema(exported):
    _, root, _ = exported
    target = "../../target"  # relative to the export folder: no absolute path in an export
    spec = json.loads((root / SPECULATORS_FOLDER / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3"
    assert spec["architectures"] == ["Eagle3Speculator"]
    assert spec["norm_before_residual"] is False  # vLLM assumes True when absent
    assert spec["draft_vocab_size"] == 20 and spec["target_hidden_size"] == 32
    layer = spec["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["vocab_size"] == 50 and layer["hidden_size"] == 32 and layer["head_dim"] == 8
    methods = spec["speculators_config"]["proposal_methods"]
    assert spec["speculators_config"]["algorithm"] == "eagle3"
    assert methods[0]["speculative_tokens"] == 3 and methods[0]["proposal_type"] == "greedy"
    assert spec["speculators_config"]["verifier"] == {
        "name_or_path": target,
        "architectures": ["Qwen3ForCausalLM"],
    }
    names = set(load_file(str(root / SPECULATORS_FOLDER / "model.safetensors")))
    assert not any(n.startswith("midlayer.") for n in names)
    assert {"layers.0.self_attn.q_proj.weight", "layers.0.hidden_norm.weight"} <= names
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names


def test_every_export_loads_back_to_the_same_draft(exported):
    draft, root, _ = exported
    for name in ("draft", SGLANG_FOLDER, SPECULATORS_FOLDER):
        loaded, _ = load_draft(root / name)
        for (key, a), (key_b, b) in zip(
            draft.state_dict().items(), loaded.state_dict().items(), strict=True
        ):
            assert key == key_b and torch.equal(a, b), (name, key)


def test_ids_sglang_cannot_name_and_foreign_conventions_are_refused(tmp_path):
    with pytest.raises(ValueError, match="embeddings"):
        vllm_to_sglang_ids([0, 2, 3])
    foreign = {"eagle_aux_hidden_state_layer_ids": IDS, "eaglet": {"aux_layer_convention": "?"}}
    with pytest.raises(ValueError, match="aux_layer_convention"):
        aux_layer_ids(foreign)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        aux_layer_ids({})
