"""The draft's optimizer (`train.optimizer`), one torch `Optimizer` whatever the choice, so one
learning-rate schedule drives it and one training state saves it:

* `adamw`: AdamW over every trainable weight.
* `muon`: Muon (momentum, then the update orthogonalized by a Newton-Schulz iteration) for the
  draft's weight matrices, AdamW for the rest (norms and the vocabulary-facing lm_head), as
  speculators trains its drafts by default. Muon's step is scaled to AdamW's update RMS
  (0.2 * sqrt(max(rows, cols))), so both groups share the configured learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

ADAMW_BETAS = (0.9, 0.95)
MUON_MOMENTUM = 0.95
MUON_WEIGHT_DECAY = 0.1
NEWTON_SCHULZ_STEPS = 5
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic, steepest slope at zero
ADAMW_ONLY = ("lm_head", "embed")  # vocabulary-facing matrices stay with AdamW


def orthogonalize(update: torch.Tensor, steps: int = NEWTON_SCHULZ_STEPS) -> torch.Tensor:
    """About U V^T of `update` = U S V^T ([rows, cols]): the Newton-Schulz iteration Muon uses;
    its singular values come out near 1 (roughly 0.5 to 1.5), not exactly 1."""
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    x = update.float()
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T  # iterate on the [small, large] side
    x = x / x.norm().clamp(min=1e-7)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.T).to(update.dtype)


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups marked `muon`, AdamW for the others."""

    def __init__(self, groups: list[dict], lr: float):
        super().__init__(groups, {"lr": lr, "weight_decay": 0.0, "muon": False})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["muon"]:
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(p.grad, 1 - MUON_MOMENTUM)
                    update = orthogonalize(p.grad.lerp(buf, MUON_MOMENTUM))  # Nesterov
                    p.mul_(1 - lr * decay)
                    p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))
                    continue
                if not state:
                    state["step"] = torch.zeros(())
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"].item()
                beta1, beta2 = ADAMW_BETAS
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denominator = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(1e-8)
                p.mul_(1 - lr * decay)
                p.addcdiv_(state["exp_avg"], denominator, value=-lr / (1 - beta1**t))


def muon_groups(named: Iterable[tuple[str, nn.Parameter]]) -> tuple[list, list]:
    """(matrices for Muon, the rest for AdamW), trainable parameters only."""
    matrices, rest = [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        is_matrix = p.ndim == 2 and min(p.shape) > 1
        (matrices if is_matrix and not any(n in name for n in ADAMW_ONLY) else rest).append(p)
    return matrices, rest


def make_optimizer(model: nn.Module, kind: str, lr: float) -> torch.optim.Optimizer:
    """The optimizer `train.optimizer` names over `model`'s trainable parameters."""
    if kind == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=lr, betas=ADAMW_BETAS, weight_decay=0.0)
    if kind == "muon":
        matrices, rest = muon_groups(model.named_parameters())
        groups = [{"params": matrices, "muon": True, "weight_decay": MUON_WEIGHT_DECAY}]
        if rest:
            groups.append({"params": rest, "muon": False, "weight_decay": 0.0})
        return MuonAdamW(groups, lr)
    raise ValueError(f"unknown optimizer {kind!r}; one of adamw, muon")
