"""EAGLE-3's training-time test (TTT): the draft's multi-step unroll over all positions at
once, where the later steps may start, and the summed loss with its per-step statistics. Pure
tensor functions: no run, no optimizer, no process group.

Indexing used throughout, for one sample x_0..x_{n-1} with target features g_t = fc(aux_t):
TTT step i at index t feeds embed(x_{t+1+i}) and (step 0) g_t or (step i > 0) the draft's own
step-(i-1) output at t, sits at RoPE position t + i, and predicts x_{t+2+i}, whose target
distribution is softmax(lm_head(final_{t+1+i})) restricted to the draft vocab (the positions
of `eaglet.draft.methods.loss`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaglet.draft.methods.eagle3_model import TTT, Eagle3Draft
from eaglet.draft.methods.loss import PositionStats, counted_positions, position_loss, shift_left


def ttt_unroll(
    draft: Eagle3Draft,
    embed: torch.Tensor,  # [V, H], the target's frozen embed_tokens
    input_ids: torch.Tensor,  # [B, T_ids >= T]
    hidden: torch.Tensor,  # [B, T, H], draft.fuse(aux)
    ttt_length: int,
    start: int = 0,
    mask_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Training-time test: `ttt_length` draft steps over all T positions at once.

    Step i at index t reads embed(x_{t+1+i}) and the step-(i-1) output at t (g_t at step 0), sits
    at position t + i, attends to step-0 keys <= t and steps 1..i keys at t (the `TTT` pattern,
    which skips the masked scores). Steps after the first run over indices start..T-1 only
    (`ttt_start`: below it none of them can count; step 0 runs everywhere, its keys are every
    later step's context). Returns the logits of every step: step 0 [B, T, Vd], later steps
    [B, T - start, Vd].

    With `mask_inputs` (embedding [H], hidden [H]), parallel drafting (P-EAGLE): every step
    after the first reads those instead of a token and the previous step's output, as vLLM's
    `parallel_drafting` feeds its mask slots; the attention pattern is the same."""
    B, T, _ = hidden.shape
    positions = torch.arange(T, device=hidden.device).expand(B, T)  # [B, T]
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    step_logits = []
    for i in range(ttt_length):
        if i == 1:  # the later steps' indices: start..T-1
            hidden, positions = hidden[:, start:], positions[:, start:]
        first = T - hidden.shape[1]  # 0 at step 0, start after
        ids = shift_left(input_ids, 1 + i, T)[:, first:]  # the token after the one step i predicts
        embeds = F.embedding(ids, embed)
        if mask_inputs is not None and i >= 1:  # a mask slot: its token and hidden are fixed
            embeds = mask_inputs[0].expand_as(embeds)
            hidden = mask_inputs[1].expand_as(hidden)
        hidden, cache = draft(embeds, hidden, positions + i, cache, TTT)
        step_logits.append(draft.compute_logits(hidden))  # [B, T - first, Vd]
    return step_logits


def ttt_start(loss_mask: torch.Tensor, ttt_length: int) -> int:
    """The first index where a TTT step after the first can count, over a batch (bool [B, T]
    loss_mask): step i >= 1 at index t predicts x_{t+2+i}, which counts only if it is model
    output, so t >= a - 2 - i for a row whose first model-output token is at a. Below it the
    later steps compute nothing the loss reads: on a prompt-heavy batch (the fixture's answers
    are a quarter of its tokens) that is most of their work."""
    B, T = loss_mask.shape
    if ttt_length < 2 or B == 0:
        return 0
    any_output = loss_mask.any(dim=1)  # [B]
    first_output = torch.where(any_output, loss_mask.int().argmax(dim=1), T)  # [B]
    return max(0, min(int(first_output.min()) - ttt_length - 1, T - 1))


def ttt_loss(
    step_logits: list[torch.Tensor],  # per step [B, T, Vd]
    target_probs: torch.Tensor,  # [B, T, Vd], target distribution for the token after t
    target_in_vocab: torch.Tensor,  # bool [B, T]
    loss_mask: torch.Tensor,  # bool [B, T]
    lengths: torch.Tensor,  # [B]
    step_weight: float = 0.8,
    denominators: list[int] | None = None,
    loss: str = "kl",
    start: int = 0,
) -> tuple[torch.Tensor, PositionStats]:
    """Sum over steps of step_weight**i * the per-position loss (`position_loss`), each step
    averaged over its counted positions (`counted_positions`) — or divided by
    `denominators[i]`, the count over a whole global batch of which this is one piece
    (micro-batches, data-parallel shares). The logits of steps after the first cover indices
    start..T-1 (`ttt_unroll`)."""
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    stats = PositionStats()
    for i, logits in enumerate(step_logits):
        b, tt = counted_positions(i, target_in_vocab, loss_mask, lengths).nonzero(as_tuple=True)
        offset = start if i else 0  # index of the logits' first column
        if len(tt) and int(tt.min()) < offset:
            raise ValueError(f"TTT step {i} counts index {int(tt.min())}, before start {start}")
        log_q = logits[b, tt - offset].float().log_softmax(-1)  # [N, Vd]
        p = target_probs[b, tt + 1 + i]  # [N, Vd]
        n = len(b)
        step_sum = position_loss(p, log_q, loss)
        denominator = max(n if denominators is None else denominators[i], 1)
        total = total + step_weight**i * step_sum / denominator
        stats.add(step_sum, int((log_q.argmax(-1) == p.argmax(-1)).sum().item()), n)
    return total, stats
