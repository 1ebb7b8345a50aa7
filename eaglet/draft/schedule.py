"""The learning-rate schedule, one home for the draft trainer and the fixture target's training:
linear warmup, then cosine decay to a floor (a fraction of the peak), as a torch `LambdaLR`."""

from __future__ import annotations

import math

import torch

FLOOR = 0.1  # the fixture target's schedule ends at 10% of the peak learning rate


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, floor: float = FLOOR) -> float:
    """Factor on the peak learning rate for optimizer step `step` (0-based): 1 after warmup,
    `floor` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    start_step: int = 0,
    floor: float = FLOOR,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule over `optimizer`'s peak learning rate, starting at `start_step` (a resume);
    call `.step()` after each optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: lr_multiplier(i + start_step, warmup_steps, total_steps, floor)
    )
