"""Drafts another trainer made: speculators' eagle3 architecture variants (norm_before_fc,
norm_before_residual, norm_output) read from its config.json and computed as vLLM computes them,
and its checkpoint (with frozen copies of target weights) loaded for eaglet's evaluator."""

import json

import pytest
import torch
from safetensors.torch import save_file

from eaglet.draft.methods.eagle3_checkpoint import config_from_json, load_draft
from eaglet.draft.methods.eagle3_model import Eagle3Config, Eagle3Draft, ttt_attention_mask
from eaglet.draft.methods.eagle3_ttt import ttt_unroll

H, V, VD = 32, 50, 20

# config.json as speculators 0.9.0's trainer wrote it for the fixture target (its defaults)
SPECULATORS_TRAINED_CONFIG = {
    "architectures": ["Eagle3DraftModel"],
    "draft_vocab_size": VD,
    "dtype": "bfloat16",
    "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
    "embed_requires_grad": False,
    "fc_norm": False,
    "norm_before_fc": True,
    "norm_before_residual": True,
    "norm_output": True,
    "speculators_model_type": "eagle3",
    "speculators_version": "0.9.0",
    "target_hidden_size": None,
    "tie_word_embeddings": False,
    "transformer_layer_config": {
        "head_dim": 8,
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": 48,
        "layer_types": ["sliding_attention"],
        "max_position_embeddings": 1024,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": 2048,
        "use_sliding_window": True,
        "vocab_size": V,
    },
}


def variant_config(**variants) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, **variants,
    )  # fmt: skip


def random_draft(config: Eagle3Config, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(config)
    with torch.no_grad():  # norms away from 1, so that skipping or doubling one shows
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return draft.eval()


def test_speculators_trainer_config_reads_its_architecture_variants():
    config = config_from_json(SPECULATORS_TRAINED_CONFIG)
    assert (config.norm_before_fc, config.norm_before_residual, config.norm_output) == (
        True,
        True,
        True,
    )
    assert config.sliding_window == 2048
    assert config.target_hidden_size == H  # null in its file: the draft's own width
    assert config.rope_theta == 10000.0 and config.head_dim == 8
    # speculators' format without the key means True (vLLM's reading); eaglet's format False
    no_key = {k: v for k, v in SPECULATORS_TRAINED_CONFIG.items() if k != "norm_before_residual"}
    assert config_from_json(no_key).norm_before_residual is True
    trained_embeddings = dict(SPECULATORS_TRAINED_CONFIG, embed_requires_grad=True)
    with pytest.raises(ValueError, match="embed_requires_grad"):
        config_from_json(trained_embeddings)


@pytest.mark.parametrize(
    "variants",
    [
        {},
        {"norm_before_fc": True},
        {"norm_before_residual": True},
        {"norm_output": True},
        {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
    ],
    ids=lambda v: "+".join(v) or "eaglet",
)
def test_a_draft_step_computes_each_variant_as_vllm_does(variants):
    """One step against a transcription of vLLM's llama_eagle3 (input_norm before fc; the
    residual taken after hidden_norm with norm_before_residual; the fed-back state post-norm
    with norm_output; logits from lm_head(norm(h)) either way)."""
    draft = random_draft(variant_config(**variants))
    layer = draft.midlayer
    B, T = 2, 5
    aux, embeds = torch.randn(B, T, 3 * H), torch.randn(B, T, H)
    positions = torch.arange(T).expand(B, T)
    with torch.no_grad():
        fused = draft.fuse(aux)
        out, _ = draft(embeds, fused, positions, None, ttt_attention_mask(T, 0))
        logits = draft.compute_logits(out)

        ref_fused = draft.fc(draft.input_norm(aux) if variants.get("norm_before_fc") else aux)
        normed = layer.hidden_norm(ref_fused)
        residual = normed if variants.get("norm_before_residual") else ref_fused
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        attn, _ = layer.self_attn(x, draft.rotary(positions), [], ttt_attention_mask(T, 0))
        h = residual + attn
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        ref_out = draft.norm(h) if variants.get("norm_output") else h
        ref_logits = draft.lm_head(draft.norm(h))

    torch.testing.assert_close(fused, ref_fused)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(logits, ref_logits)


def test_every_variant_changes_what_the_draft_proposes():
    """None of the three is a no-op: the same weights give other logits with each one on."""
    base = random_draft(variant_config(norm_before_fc=True))
    ids, aux = torch.randint(0, V, (1, 9)), torch.randn(1, 6, 3 * H)
    embed = torch.randn(V, H)

    def logits(draft):
        with torch.no_grad():
            return torch.cat(ttt_unroll(draft, embed, ids, draft.fuse(aux), ttt_length=3))

    reference = logits(base)
    for variant in ("norm_before_residual", "norm_output"):
        other = Eagle3Draft(variant_config(norm_before_fc=True, **{variant: True})).eval()
        other.load_state_dict(base.state_dict())
        assert not torch.allclose(logits(other), reference, atol=1e-3), variant
    plain = Eagle3Draft(variant_config()).eval()
    plain.load_state_dict({k: v for k, v in base.state_dict().items() if k != "input_norm.weight"})
    assert not torch.allclose(logits(plain), reference, atol=1e-3), "norm_before_fc"


def test_a_speculators_trained_checkpoint_loads_for_eaglets_evaluator(tmp_path):
    """Its weights under `layers.0.*`, `input_norm.weight`, and a frozen copy of the target's
    embeddings (which eaglet's draft takes from the target itself)."""
    source = random_draft(config_from_json(SPECULATORS_TRAINED_CONFIG))
    tensors = {
        (k.replace("midlayer.", "layers.0.")): v.to(torch.bfloat16) if v.is_floating_point() else v
        for k, v in source.state_dict().items()
    }
    tensors["embed_tokens.weight"] = torch.randn(V, H).to(torch.bfloat16)
    folder = tmp_path / "speculators-ckpt"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(SPECULATORS_TRAINED_CONFIG))

    loaded, config = load_draft(folder)
    assert config["speculators_model_type"] == "eagle3"
    assert loaded.config.norm_before_fc and loaded.config.norm_output
    for name, value in source.state_dict().items():
        expected = value.to(torch.bfloat16).float() if value.is_floating_point() else value
        torch.testing.assert_close(loaded.state_dict()[name].to(expected.dtype), expected)
