"""train.optimizer: Muon for the draft's matrices and AdamW for the rest, as one optimizer that
the schedule drives and the training state saves and restores."""

import pytest
import torch

from eaglet.draft.checkpoint import load_training_state, save_training_state
from eaglet.draft.methods.eagle3_model import Eagle3Config, Eagle3Draft
from eaglet.draft.optimizer import make_optimizer, muon_groups, orthogonalize
from eaglet.draft.vocab import build_draft_vocab


def tiny_draft() -> Eagle3Draft:
    torch.manual_seed(0)
    config = Eagle3Config(
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=30,
        draft_vocab_size=10,
        target_hidden_size=16,
    )
    return Eagle3Draft(config)


@pytest.mark.parametrize("shape", [(8, 32), (32, 8)])
def test_orthogonalize_brings_every_singular_value_near_one(shape):
    torch.manual_seed(1)
    update = torch.randn(shape) * torch.logspace(-1, 1, shape[1])  # columns 0.1x to 10x
    singular = torch.linalg.svdvals(orthogonalize(update))
    assert orthogonalize(update).shape == shape
    assert singular.min() > 0.5 and singular.max() < 1.5, singular


def test_muon_takes_the_matrices_and_leaves_norms_and_lm_head_to_adamw():
    draft = tiny_draft()
    names = {id(p): n for n, p in draft.named_parameters()}
    matrices, rest = muon_groups(draft.named_parameters())
    muon_names = {names[id(p)] for p in matrices}
    adamw_names = {names[id(p)] for p in rest}
    assert "fc.weight" in muon_names and "lm_head.weight" in adamw_names
    assert all(n.endswith("proj.weight") or n == "fc.weight" for n in muon_names)
    assert all("norm" in n or n == "lm_head.weight" for n in adamw_names)
    assert len(muon_names) + len(adamw_names) == len(names)


def test_the_adamw_group_steps_exactly_as_torch_adamw():
    torch.manual_seed(2)
    ours_param, torch_param = (torch.nn.Parameter(torch.randn(5)) for _ in range(2))
    with torch.no_grad():
        torch_param.copy_(ours_param)
    model = torch.nn.Module()
    model.norm = torch.nn.Module()
    model.norm.weight = ours_param
    ours = make_optimizer(model, "muon", lr=0.01)
    reference = torch.optim.AdamW([torch_param], lr=0.01, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(5):
        grad = torch.randn(5) * (step + 1)
        ours_param.grad, torch_param.grad = grad.clone(), grad.clone()
        ours.step()
        reference.step()
    torch.testing.assert_close(ours_param, torch_param)


def loss_of(draft: Eagle3Draft, inputs: torch.Tensor) -> torch.Tensor:
    hidden = draft.fuse(inputs)  # [1, T, H]
    return draft.compute_logits(hidden).logsumexp(-1).mean()


def test_muon_lowers_the_loss_and_a_restored_state_continues_exactly(tmp_path):
    inputs = torch.randn(1, 6, 48)  # [B, T, 3H]
    draft = tiny_draft()
    optimizer = make_optimizer(draft, "muon", lr=0.01)
    vocab = build_draft_vocab(torch.arange(30, 0, -1), 10)
    before = loss_of(draft, inputs).item()
    for step in range(6):
        if step == 3:
            save_training_state(tmp_path / "state", draft, optimizer, vocab, {"step": 3})
            resumed = tiny_draft()
            resumed_optimizer = make_optimizer(resumed, "muon", lr=0.01)
            load_training_state(tmp_path / "state", resumed, resumed_optimizer)
        for model, opt in [(draft, optimizer)] + (
            [(resumed, resumed_optimizer)] if step >= 3 else []
        ):
            opt.zero_grad()
            loss_of(model, inputs).backward()
            opt.step()
    assert loss_of(draft, inputs).item() < before - 0.1
    for a, b in zip(draft.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)


def test_an_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        make_optimizer(tiny_draft(), "sgd", lr=0.01)
