"""DSpark (`train.method: dspark`): its network, its files and its rounds, on CPU.

- Training reads each draft's logits where vLLM's round reads them (`sample_from_anchor`: slot
  i predicts the token after it) and adds the Markov bias of the token before it: on a
  sequence that continues with the drafter's own drafts, training's argmaxes are the round's.
- The checkpoint is vLLM's `qwen3_dspark` layout (`Qwen3DSparkModel`, zero-based ascending
  layer ids, the anchor convention and the noise token said outright, `markov_head.*`), and
  speculators' layout beside it; both load back, without eaglet's label, to the same drafts.
- Training on the hidden-states shards lowers the loss and drafts the target's tokens better
  than an untrained draft; the method's settings are checked.
vLLM's own reading of the export is `tests/test_serving_methods.py` (its CPU build cannot run
DSpark's rounds: `test_vllm_reads_the_dspark_export`).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from eaglet.config import load_config
from eaglet.draft.methods import draft_method, method_of_draft
from eaglet.draft.methods.base import TrainingView
from eaglet.draft.methods.block import BlockDrafter, block_logits
from eaglet.draft.methods.dspark import DSparkConfig, DSparkDraft

H, V, K = 64, 50, 4


def small_draft(layers: int = 2, seed: int = 0) -> DSparkDraft:
    torch.manual_seed(seed)
    config = DSparkConfig(
        hidden_size=H, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=V, target_hidden_size=H,
        target_layer_ids=[1, 3], block_size=K, mask_token_id=V - 1, markov_rank=8,
    )  # fmt: skip
    draft = DSparkDraft(config)
    with torch.no_grad():  # random norms and a Markov head that matters
        for p in draft.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        draft.markov_head.markov_w1.weight.normal_(0, 1.0)
        draft.markov_head.markov_w2.weight.normal_(0, 3.0)
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


def test_training_reads_each_draft_where_a_served_round_does():
    """Anchor P, a context of P + 1 states: the round drafts d_1..d_K after x_{P+1}; a training
    row whose tokens after x_{P+1} are those drafts gives, at the same anchor, block logits
    whose argmaxes are d_1..d_K (teacher forcing on the round's own tokens)."""
    draft, target = small_draft(), Target()
    n, P = 16, 7
    aux = torch.randn(1, n, 2 * H)
    ids = torch.randint(0, V - 1, (n,))
    drafts = BlockDrafter(draft, target.embed, target.head).propose(
        ids[: P + 1].tolist(), aux[0, : P + 1], int(ids[P + 1]), K
    )
    assert len(drafts) == K and len(set(drafts)) > 1
    ids[P + 2 : P + 2 + K] = torch.tensor(drafts)
    view = TrainingView(
        settings=load_config(None, ["train.method=dspark"]).train, draft=draft,
        embed=target.embed, draft_lm_head=target.head, device=torch.device("cpu"), autocast=None,
    )  # fmt: skip
    batch = {"aux_hidden_states": aux, "input_ids": ids[None], "lengths": torch.tensor([n])}
    logits = block_logits(view, draft, batch, 0, torch.tensor([P]))  # [1, K, V]
    assert logits.argmax(-1)[0].tolist() == drafts
    # without the Markov bias the drafts would differ: the head decides
    without = BlockDrafter(draft, target.embed, target.head)
    draft.markov_head.markov_w2.weight.data.zero_()
    assert without.propose(ids[: P + 1].tolist(), aux[0, : P + 1], int(ids[P + 1]), K) != drafts


def test_the_checkpoint_is_vllms_qwen3_dspark_layout_and_loads_back(tmp_path):
    method, draft, target = draft_method("dspark"), small_draft(layers=3), Target()
    method.save(draft, tmp_path / "draft", [1, 3], "hf_hidden_states_index")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["dspark_target_layer_ids"] == [0, 2]  # zero-based, strictly increasing
    assert config["block_size"] == K and config["use_aux_hidden_state"] is True
    assert config["sample_from_anchor"] is True and config["dspark_bonus_anchor"] is False
    assert config["dspark_noise_token_id"] == config["mask_token_id"] == V - 1
    assert config["markov_rank"] == 8 and config["markov_head_type"] == "vanilla"
    assert "dflash_config" not in config and "eagle_aux_hidden_state_layer_ids" not in config
    tensors = load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert tensors["markov_head.markov_w1.weight"].shape == (V, 8)
    assert tensors["markov_head.markov_w2.weight"].shape == (V, 8)  # vLLM's [Vd, r]
    assert "embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors
    assert method_of_draft(config).name == "dspark"
    peer = {k: v for k, v in config.items() if k != "eaglet"}
    assert method_of_draft(peer).name == "dspark"
    assert method.draft_layer_ids(peer, "config.json") == [1, 3]
    assert method.evaluation_k(config, 99) == K
    loaded, _ = method.load(tmp_path / "draft")
    ids, aux = list(range(5, 14)), torch.randn(9, 2 * H)
    before = BlockDrafter(draft, target.embed, target.head).propose(ids, aux, 7, K)
    after = BlockDrafter(loaded.eval(), target.embed, target.head).propose(ids, aux, 7, K)
    assert before == after and len(after) == K


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_the_speculators_layout_loads_back_to_the_same_drafts(name, tmp_path, fixture_model_dir):
    """speculators' layout (no eaglet label: read as a peer's file) beside the vLLM export."""
    from eaglet.config import TargetConfig
    from eaglet.draft.methods.dflash_model import DFlashConfig, DFlashDraft

    method, target = draft_method(name), Target()
    if name == "dspark":
        draft = small_draft()
    else:
        torch.manual_seed(0)
        block = {**small_draft().config.to_dict(), "block_size": K + 1}  # the bonus and K masks
        del block["markov_rank"], block["sample_from_anchor"]
        draft = DFlashDraft(DFlashConfig(**block)).eval()
    method.save(draft, tmp_path / "draft", [1, 3], "hf_hidden_states_index")
    exports = method.exports(tmp_path / "draft", TargetConfig(model=str(fixture_model_dir)), K)
    folder = tmp_path / exports["speculators"]
    assert exports["vllm"] == "draft" and name in folder.name
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == name and "eaglet" not in config
    assert config["aux_hidden_state_layer_ids"] == [1, 3]  # speculators' ids: eaglet's
    section = config["speculators_config"]
    assert section["algorithm"] == name
    assert section["proposal_methods"][0]["speculative_tokens"] == K
    assert config["sample_from_anchor"] is (name == "dspark")
    assert method_of_draft(config).name == name
    assert method.evaluation_k(config, 99) == K
    loaded, _ = method_of_draft(config).load(folder)
    ids, aux = list(range(5, 14)), torch.randn(9, 2 * H)
    before = BlockDrafter(draft, target.embed, target.head).propose(ids, aux, 7, K)
    after = BlockDrafter(loaded.eval(), target.embed, target.head).propose(ids, aux, 7, K)
    assert before == after


def test_the_settings_are_checked():
    method = draft_method("dspark")
    config = load_config(None, ["train.method=dspark", "evaluate.num_speculative_tokens=7"])
    [problem] = method.problems(config, {"vocab_size": V})
    assert "block_size=4" in problem and "evaluate.num_speculative_tokens=7" in problem
    assert method.problems(load_config(None, ["train.method=dspark"]), {"vocab_size": V}) == []
    served = load_config(
        None, ["train.method=dspark", "evaluate.serving=vllm", "evaluate.vllm_python=/x/python"]
    )
    if not torch.cuda.is_available():  # vLLM's CPU build cannot serve DSpark: said before a run
        [problem] = method.problems(served, {"vocab_size": V})
        assert "V2 model runner" in problem and "evaluate.serving_endpoint" in problem


def test_training_on_shards_lowers_the_loss_and_drafts_the_targets_tokens(tmp_path):
    """DSpark on the greedy answers of the small target whose next token is a fixed
    permutation of the last one (tests/train_helpers.py's world): the loss falls, and the
    trained draft's rounds follow the target better than an untrained one's."""
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
        ["train.method=dspark", "train.epochs=6", "train.batch_size=8", "train.log_every=1",
         "train.lr=0.01", "train.intermediate_size=128", "train.dspark.markov_rank=32"],
    ).train  # fmt: skip
    target = TargetConfig(model=str(tmp_path / "target"), device="cpu")
    summary = train_draft(
        tmp_path / "hs", target, tmp_path / "out", config, AUX_IDS, AUX_LAYER_CONVENTION
    )
    assert summary["final_loss"] < summary["initial_loss"] * 0.7, summary
    method = draft_method("dspark")
    trained, saved = method.load(tmp_path / "out" / "draft")
    assert saved["eaglet"]["method"] == "dspark" and len(summary["final_acc"]) == 4
    loaded = load_target(target)
    common = dict(
        target=loaded, prompts=random_prompts(6, seed=7), references=None, k=4,
        max_new_tokens=24, eos=set(), aux_layer_ids=AUX_IDS, progress=None,
    )  # fmt: skip
    tau = evaluate_loaded(trained, **common)["tau"]
    untrained = evaluate_loaded(method.fresh_like(trained, 0), **common)["tau"]
    assert tau > untrained and tau > 2.0, (tau, untrained)
