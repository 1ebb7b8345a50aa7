"""Acceptance under sampling: the rule by which a sampling server verifies a greedy draft.

A reasoning model is served sampled (Qwen3 recommends temperature 0.6 with thinking); greedy τ
overstates what such a server accepts. vLLM 0.32 by default drafts greedily
(`speculative_config.draft_sample_method: greedy`: the draft's argmax, its probabilities taken
as one-hot) and verifies each drafted token d by rejection sampling against the target's
distribution p at that position, after temperature and top-p (`apply_sampling_constraints`):
d is accepted when a uniform u < p(d); at the first rejection the target's token is drawn from
the residual max(p - q, 0), which for a one-hot q is p without d, renormalised; when every
draft is accepted the bonus token is drawn from p at the position after them. The emitted
tokens are then distributed exactly as plain sampling from p (tested).

`expected_accepted` is the round's accepted count in expectation over the target's draws
(sum over j of p_1(d_1)...p_j(d_j)): the same mean as the realised count, with less noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """The target's sampling settings: temperature > 0 and top_p in (0, 1]."""

    temperature: float
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"sampling needs a temperature above 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], not {self.top_p}")


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution the target samples from: softmax(logits / T) [n, V] (float32) over the
    smallest set of tokens whose probability reaches top_p (ties at the edge kept, as vLLM's
    sort-based mask keeps them), renormalised."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)  # [n, V]
    if sampling.top_p >= 1:
        return probs
    ordered, order = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(dim=-1) - ordered  # mass of the tokens ranked above each
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before < sampling.top_p)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from `probs` [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


def verify(
    probs: torch.Tensor,  # [k + 1, V]: the target's distribution at each drafted position and after
    drafts: list[int],  # d_1..d_k
    generator: torch.Generator,
) -> tuple[int, int, float]:
    """(accepted n, the target's token after them, the expected accepted count) of one round."""
    expected, reach = 0.0, 1.0
    for p in range(len(drafts)):
        reach *= float(probs[p, drafts[p]])
        expected += reach
    for n, draft in enumerate(drafts):
        u = float(torch.rand((), generator=generator, device=generator.device))
        if u < float(probs[n, draft]):
            continue
        residual = probs[n].clone()
        residual[draft] = 0.0
        return n, sample(residual / residual.sum(), generator), expected
    return len(drafts), sample(probs[len(drafts)], generator), expected
