"""The sampled evaluation's figures as the manifest, `eaglet inspect` and the run report say
them (kept free of torch, as those readers are); the rule itself is `eaglet.draft.rejection`."""

from __future__ import annotations

DRAFT_SAMPLING = (
    "greedy draft (vLLM's default draft_sample_method), verified by rejection sampling: "
    "a draft d is accepted when u < p(d), else the token is drawn from p without d"
)


def sampled_summary(sampled: dict) -> dict:
    """The sampled evaluation's headline figures (for the manifest and `eaglet inspect`)."""
    keys = ("temperature", "top_p", "tau", "expected_tau", "emitted_tau", "num_rounds")
    return {key: sampled[key] for key in keys} | {"draft_sampling": DRAFT_SAMPLING}


def sampled_text(summary: dict, symbol: str = "tau") -> str:
    """One line: 'sampled at T=0.6, top_p 0.95: tau 2.910 (expected 2.934, 412 rounds)'."""
    top_p = f", top_p {summary['top_p']:g}" if summary["top_p"] < 1 else ""
    return (
        f"sampled at T={summary['temperature']:g}{top_p}: {symbol} {summary['tau']:.3f} "
        f"(expected {summary['expected_tau']:.3f}, {summary['num_rounds']} rounds)"
    )
