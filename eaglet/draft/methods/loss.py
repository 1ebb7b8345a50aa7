"""What every method's loss is made of, kept once: the target's labels (its distribution over
the draft vocabulary, whether its argmax is in it), which predicted positions count, the loss
of one position against the target, and the per-position statistics a loss returns.

Indexing, shared by every method: predicted position i of index (anchor) t predicts x_{t+2+i},
whose target distribution is softmax(lm_head(final_{t+1+i})) restricted to the draft vocab
(EAGLE-3's TTT step i at index t; a block drafter's i-th draft after anchor t).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------- target labels


@torch.no_grad()
def target_in_vocab(
    final_hidden: torch.Tensor,  # [B, T, H], after the target's final norm
    lm_head: torch.Tensor,  # [V, H]
    t2d: torch.Tensor,  # bool [V]
    chunk: int = 2048,
) -> torch.Tensor:
    """Whether the target's argmax is in the draft vocab, bool [B, T]; `chunk` tokens at a time
    bound the [., V] logits."""
    B, T, H = final_hidden.shape
    parts = [
        t2d[(part @ lm_head.T).argmax(-1)] for part in final_hidden.reshape(B * T, H).split(chunk)
    ]
    return torch.cat(parts).view(B, T)


@torch.no_grad()
def target_probs(
    final_hidden: torch.Tensor,  # [B, T, H]
    draft_lm_head: torch.Tensor,  # [Vd, H], lm_head rows of the draft vocab's target ids
) -> torch.Tensor:
    """The target's distribution restricted to the draft vocab, [B, T, Vd]."""
    return (final_hidden @ draft_lm_head.T).softmax(-1)


# ------------------------------------------------------------------------- counted positions


def shift_left(x: torch.Tensor, k: int, length: int | None = None) -> torch.Tensor:
    """y[:, t] = x[:, t + k], zero past the end; `length` columns (default x's)."""
    length = x.shape[1] if length is None else length
    y = x[:, k : k + length]
    return F.pad(y, (0, 0) * (x.dim() - 2) + (0, length - y.shape[1]))


def counted_positions(
    step: int,
    target_in_vocab: torch.Tensor,  # bool [B, T]
    loss_mask: torch.Tensor,  # bool [B, T], 1 = token produced by the model
    lengths: torch.Tensor,  # [B]
) -> torch.Tensor:
    """bool [B, T]: predicted position `step` at index t predicts x_{t+2+step} (target
    distribution at t+1+step); it counts when that token is model output, exists, and the
    target's argmax there is in the draft vocab."""
    t = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    return (
        (t + 2 + step < lengths[:, None].to(t.device))
        & shift_left(loss_mask, 2 + step)
        & shift_left(target_in_vocab, 1 + step)
    )


# ------------------------------------------------------------------------------------- loss

LOSSES = ("kl", "tv", "kl_tv")


def position_loss(
    p: torch.Tensor,  # [N, Vd], target distribution
    log_q: torch.Tensor,  # [N, Vd], draft log-probabilities
    loss: str,
) -> torch.Tensor:
    """The summed loss of N positions: `kl`, the soft cross-entropy -sum p log q (forward KL up
    to the target's entropy); `tv`, the total variation 1/2 sum |p - q| (1 - the chance a
    sampled draft token is accepted); `kl_tv`, their sum."""
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; one of {LOSSES}")
    total = log_q.new_zeros(())
    if loss in ("kl", "kl_tv"):
        total = total - (p * log_q).sum()
    if loss in ("tv", "kl_tv"):
        total = total + 0.5 * (p - log_q.exp()).abs().sum()
    return total


@dataclass
class PositionStats:
    """Per predicted position of one piece (a micro-batch): the summed loss, the positions
    where the draft's argmax is the target's (`hits`) and the counted positions. The sums add
    up across pieces and processes."""

    loss_sum: list[float] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    count: list[int] = field(default_factory=list)

    def add(self, loss_sum: torch.Tensor, hits: int, count: int) -> None:
        """The next position's figures (in order)."""
        self.loss_sum.append(float(loss_sum.detach()))
        self.hits.append(int(hits))
        self.count.append(int(count))
