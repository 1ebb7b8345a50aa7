"""P-EAGLE (`train.method: peagle`): what training computes is what a served round computes.
The parallel drafter's k drafts at a sequence's end equal the argmax of the training unroll's
k steps at that index (mask slots fed the mask token and `fc(mask_hidden)`), and the export
is EAGLE-3's checkpoint with `mask_hidden` and `pard_token`, loading back to the same drafts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from eaglet.draft.methods import draft_method, method_of_draft
from eaglet.draft.methods.eagle3_model import Eagle3Config
from eaglet.draft.methods.eagle3_ttt import ttt_unroll
from eaglet.draft.methods.peagle import ParallelDrafter, ParallelEagle3Draft

H, V = 64, 40


def small_draft(seed: int = 0) -> ParallelEagle3Draft:
    torch.manual_seed(seed)
    config = Eagle3Config(
        hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=V, draft_vocab_size=V, target_hidden_size=H,
    )  # fmt: skip
    draft = ParallelEagle3Draft(config, mask_token_id=V - 1)
    draft.set_vocab(torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool))
    with torch.no_grad():
        draft.mask_hidden.normal_()
        for p in draft.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return draft.eval()


def test_a_served_round_drafts_what_the_training_unroll_predicts():
    draft = small_draft()
    embed = torch.randn(V, H)
    L, k = 11, 4
    ids = torch.randint(0, V - 1, (L + 1,))  # x_0..x_L; x_L is the round's pending token
    aux = torch.randn(L, 3 * H)
    with torch.no_grad():
        steps = ttt_unroll(
            draft, embed, ids[None], draft.fuse(aux[None]), k,
            mask_inputs=draft.mask_inputs(embed),
        )  # fmt: skip
    trained = [int(step[0, L - 1].argmax()) for step in steps]  # index P = L - 1
    drafter = ParallelDrafter(draft, embed, use_cache=True)
    served = drafter.propose(ids[:L].tolist(), aux, int(ids[L]), k)
    assert served == trained


def test_the_export_is_eagle3s_with_the_mask_and_loads_back(tmp_path):
    method, draft = draft_method("peagle"), small_draft()
    method.save(draft, tmp_path / "draft", [1, 2, 3], "hf_hidden_states_index")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["pard_token"] == V - 1 and config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert method_of_draft(config).name == "peagle"
    assert method_of_draft({k: v for k, v in config.items() if k != "eaglet"}).name == "peagle"
    assert method.speculative_config(tmp_path / "draft", 3)["parallel_drafting"] is True
    loaded, _ = method.load(tmp_path / "draft")
    embed = SimpleNamespace(weight=torch.randn(V, H))
    target = SimpleNamespace(get_input_embeddings=lambda: embed)
    ids, aux = list(range(9)), torch.randn(9, 3 * H)
    before = method.drafter(draft, target, False).propose(ids, aux, 5, 3)
    after = method.drafter(loaded.eval(), target, False).propose(ids, aux, 5, 3)
    assert before == after
