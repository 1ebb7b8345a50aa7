"""DFlash (`train.method: dflash`): its network, its files and its rounds, on CPU.

- One forward gives the same drafts as vLLM's round: the masks' drafts of a round equal a
  forward over [context; block] with every key visible (`BlockDrafter`), and training's
  block-diagonal mask gives each anchor's block exactly what that round sees.
- The checkpoint is vLLM's `qwen3_dflash` layout (architectures, z-lab layer ids, mask id, the
  per-layer k_norm) and loads back to the same drafts.
- Training on the hidden-states shards lowers the loss; the method's settings are checked.
The served check (vLLM serving the export, served τ equal to offline) is
`tests/test_serving_methods.py`.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from eaglet.config import load_config
from eaglet.draft.methods import draft_method, method_of_draft
from eaglet.draft.methods.block import BlockDrafter
from eaglet.draft.methods.dflash_model import DFlashConfig, DFlashDraft, block_mask

H, V = 64, 50


def small_draft(layers: int = 2, seed: int = 0) -> DFlashDraft:
    torch.manual_seed(seed)
    config = DFlashConfig(
        hidden_size=H, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=V, target_hidden_size=H,
        target_layer_ids=[1, 3], block_size=4, mask_token_id=V - 1,
    )  # fmt: skip
    draft = DFlashDraft(config)
    with torch.no_grad():  # random norms: a k_norm bug would show
        for p in draft.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return draft.eval()


class Target:
    """The two matrices a drafter borrows from the target."""

    def __init__(self):
        torch.manual_seed(1)
        self.embed, self.head = torch.randn(V, H), torch.randn(V, H)

    def get_input_embeddings(self):
        return SimpleNamespace(weight=self.embed)

    def get_output_embeddings(self):
        return SimpleNamespace(weight=self.head)


def test_training_blocks_see_exactly_what_a_served_round_sees():
    """A training row with anchors P_a: each block's hidden states equal the round's forward
    over the context up to P_a and that block alone."""
    draft, target = small_draft(), Target()
    n = 12
    aux = torch.randn(1, n, 2 * H)
    ids = torch.randint(0, V - 1, (n,))
    anchors = torch.tensor([3, 7, 9])
    context = draft.context(aux)
    K = draft.config.block_size - 1
    block = torch.full((len(anchors), K + 1), V - 1)
    block[:, 0] = ids[anchors + 1]
    positions = (anchors[:, None] + torch.arange(1, K + 2)).reshape(1, -1)
    mask = block_mask(anchors, n, K + 1)[None, None]
    together = draft(
        torch.nn.functional.embedding(block.reshape(1, -1), target.embed),
        positions, context, torch.arange(n)[None], mask,
    ).view(len(anchors), K + 1, H)  # fmt: skip
    for a, P in enumerate(anchors.tolist()):
        alone = draft(
            torch.nn.functional.embedding(block[a][None], target.embed),
            positions.view(len(anchors), -1)[a][None],
            draft.context(aux[:, : P + 1]), torch.arange(P + 1)[None],
        )  # fmt: skip
        torch.testing.assert_close(together[a], alone[0], atol=1e-5, rtol=1e-5)


def test_block_mask_is_context_up_to_the_anchor_and_the_own_block():
    mask = block_mask(torch.tensor([1, 3]), context_len=5, block=2)
    assert mask.tolist() == [
        [True, True, False, False, False, True, True, False, False],
        [True, True, False, False, False, True, True, False, False],
        [True, True, True, True, False, False, False, True, True],
        [True, True, True, True, False, False, False, True, True],
    ]


def test_the_checkpoint_is_vllms_dflash_layout_and_loads_back(tmp_path):
    method, draft, target = draft_method("dflash"), small_draft(layers=3), Target()
    method.save(draft, tmp_path / "draft", [1, 3], "hf_hidden_states_index")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "target_layer_ids": [0, 2], "mask_token_id": V - 1, "block_size": 4
    }  # fmt: skip
    assert "eagle_config" not in config and "eagle_aux_hidden_state_layer_ids" not in config
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert "k_norm.weight" not in tensors and "embed_tokens.weight" not in tensors
    norms = [tensors[f"layers.{i}.self_attn.k_norm.weight"] for i in range(3)]
    assert all(torch.equal(n, norms[0]) for n in norms)  # one k_norm: vLLM's CPU kernel's
    assert method_of_draft(config).name == "dflash"
    loaded, _ = method.load(tmp_path / "draft")
    ids, aux = list(range(5, 14)), torch.randn(9, 2 * H)
    before = BlockDrafter(draft, target.embed, target.head).propose(ids, aux, 7, 3)
    after = BlockDrafter(loaded.eval(), target.embed, target.head).propose(ids, aux, 7, 3)
    assert before == after and len(after) == 3


def test_layer_ids_and_settings_are_checked():
    method = draft_method("dflash")
    assert method.layer_ids(None, 8) == [2, 4, 5]  # EAGLE-3's default: shared shards
    assert method.layer_ids([1, 3, 5, 7], 8) == [1, 3, 5, 7]
    for bad in ([3, 1], [0, 4], [2, 8], [2, 2]):
        with pytest.raises(ValueError):
            method.layer_ids(bad, 8)
    config = load_config(None, ["train.method=dflash", "evaluate.num_speculative_tokens=7"])
    [problem] = method.problems(config, {"vocab_size": V})
    assert "block_size=5" in problem and "evaluate.num_speculative_tokens=7" in problem


def test_training_on_shards_lowers_the_loss_and_drafts_the_targets_tokens(tmp_path):
    """DFlash on the greedy answers of a small target whose next token is a fixed permutation of
    the last one (tests/train_helpers.py's world): the loss falls, and the trained draft's
    block proposals follow the target better than an untrained one's."""
    from eaglet.config import TargetConfig
    from eaglet.draft.evaluate import evaluate_loaded, load_target
    from eaglet.draft.train import train_draft
    from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION
    from tests.train_helpers import (
        ANSWER_LEN,
        AUX_IDS,
        greedy_examples,
        make_target,
        random_prompts,
        write_hidden_state_shards,
    )  # fmt: skip

    model = make_target(tmp_path / "target")
    examples = greedy_examples(model, random_prompts(48, seed=1), ANSWER_LEN)
    write_hidden_state_shards(tmp_path / "target", tmp_path / "hs", examples, AUX_IDS)
    config = load_config(
        None,
        ["train.method=dflash", "train.epochs=6", "train.batch_size=8", "train.log_every=1",
         "train.lr=0.01", "train.intermediate_size=128", "train.dflash.num_layers=2"],
    ).train  # fmt: skip
    target = TargetConfig(model=str(tmp_path / "target"), device="cpu")
    summary = train_draft(
        tmp_path / "hs", target, tmp_path / "out", config, AUX_IDS, AUX_LAYER_CONVENTION
    )
    assert summary["final_loss"] < summary["initial_loss"] * 0.7, summary
    method = draft_method("dflash")
    trained, saved = method.load(tmp_path / "out" / "draft")
    assert saved["eaglet"]["method"] == "dflash"
    prompts = random_prompts(6, seed=7)
    loaded = load_target(target)
    common = dict(
        target=loaded, prompts=prompts, references=None, k=4, max_new_tokens=24, eos=set(),
        aux_layer_ids=AUX_IDS, progress=None,
    )  # fmt: skip
    tau = evaluate_loaded(trained, **common)["tau"]
    untrained = evaluate_loaded(method.fresh_like(trained, 0), **common)["tau"]
    assert tau > untrained, (tau, untrained)


def test_a_mask_token_an_answer_holds_is_refused_before_any_stage(fixture_model_dir):
    """Issue 46: train.dflash.mask_token_id equal to the target's end-of-answer token was taken
    without a word; the preflight names the token and why (an unused id passes)."""
    from eaglet.config import load_config
    from eaglet.preflight import preflight

    base = [f"target.model={fixture_model_dir}", "train.method=dflash",
            "evaluate.num_speculative_tokens=4", "evaluate.sets=[]"]  # fmt: skip
    refused = preflight(load_config(None, [*base, "train.dflash.mask_token_id=2"]))
    [problem] = [p for p in refused.problems if "mask_token_id" in p]
    assert "'<|im_end|>', an end token of the target's answers" in problem
    passed = preflight(load_config(None, [*base, "train.dflash.mask_token_id=1500"]))
    assert not [p for p in passed.problems if "mask_token_id" in p]
