"""vLLM's rejection rule for a greedy draft: what a sampling server emits is distributed as plain
sampling from the target, whatever the draft proposed; the expected accepted count is the mean
of the realised one; temperature and top-p shape the target's distribution as vLLM's do."""

from __future__ import annotations

import pytest
import torch

from eaglet.draft.rejection import Sampling, target_probs, verify
from eaglet.draft.sampled import sampled_summary, sampled_text

TRIALS = 20_000  # the standard error of a share is at most 0.0035


def emitted(probs: torch.Tensor, drafts: list[int], seed: int = 0) -> list[tuple[int, list[int]]]:
    """(accepted n, the round's emitted tokens after the pending one) of TRIALS rounds."""
    generator = torch.Generator().manual_seed(seed)
    rounds = []
    for _ in range(TRIALS):
        n, after, _ = verify(probs, drafts, generator)
        rounds.append((n, drafts[:n] + [after]))
    return rounds


def shares(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / max(len(tokens), 1)


def test_the_first_emitted_token_follows_the_target_whatever_was_drafted():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3)  # [k + 1, V]
    for draft in (0, 3, 4):  # a likely draft, an unlikely one, the least likely
        first = [tokens[0] for _, tokens in emitted(probs, [draft, 1])]
        assert torch.allclose(shares(first, 5), probs[0], atol=0.015), draft


def test_after_an_accepted_draft_the_next_token_follows_the_next_position():
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25] * 4])
    second = [tokens[1] for n, tokens in emitted(probs, [0, 2]) if n >= 1]
    assert len(second) == pytest.approx(0.7 * TRIALS, rel=0.03)
    assert torch.allclose(shares(second, 4), probs[1], atol=0.02)


def test_all_drafts_accepted_draws_the_bonus_token_from_the_position_after():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.6, 0.3, 0.1]])
    rounds = emitted(probs, [1, 2])
    assert all(n == 2 for n, _ in rounds)
    assert torch.allclose(shares([t[2] for _, t in rounds], 3), probs[2], atol=0.015)


def test_the_expected_count_is_the_mean_of_the_realised_one():
    probs = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.9, 0.1], [0.5, 0.5]])
    drafts = [0, 1, 0]
    rounds = emitted(probs, drafts, seed=3)
    _, _, expected = verify(probs, drafts, torch.Generator().manual_seed(0))
    assert expected == pytest.approx(0.6 + 0.6 * 0.7 + 0.6 * 0.7 * 0.9)
    assert sum(n for n, _ in rounds) / TRIALS == pytest.approx(expected, abs=0.02)


def test_a_draft_the_target_never_samples_is_never_accepted():
    probs = torch.tensor([[0.5, 0.5, 0.0], [1 / 3] * 3])
    assert {n for n, _ in emitted(probs, [2])} == {0}


def test_temperature_scales_the_logits_before_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for t in (0.3, 1.0, 1.7):
        expected = torch.softmax(logits / t, dim=-1)
        assert torch.allclose(target_probs(logits, Sampling(t)), expected)


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.allclose(
        target_probs(logits, Sampling(1.0, top_p=0.8)), torch.tensor([[0.625, 0.375, 0, 0]])
    )
    assert torch.allclose(
        target_probs(logits, Sampling(1.0, top_p=0.81)),
        torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95,
    )
    # below the top token's own probability, only it is left
    assert torch.equal(
        target_probs(logits, Sampling(1.0, top_p=0.2)), torch.tensor([[1.0, 0, 0, 0]])
    )


def test_sampling_settings_out_of_range_are_refused():
    with pytest.raises(ValueError, match="temperature above 0"):
        Sampling(0.0)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(0.6, top_p=0.0)


def test_the_summary_line_names_temperature_top_p_and_both_taus():
    report = {
        "temperature": 0.6, "top_p": 0.95, "tau": 2.9104, "expected_tau": 2.9341,
        "emitted_tau": 2.8, "num_rounds": 412, "segments": {},
    }  # fmt: skip
    summary = sampled_summary(report)
    assert "segments" not in summary and "rejection sampling" in summary["draft_sampling"]
    assert sampled_text(summary) == (
        "sampled at T=0.6, top_p 0.95: tau 2.910 (expected 2.934, 412 rounds)"
    )
