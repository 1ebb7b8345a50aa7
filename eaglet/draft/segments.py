"""Acceptance per segment of the answer: thinking, answer and tool-call tokens.

A reasoning model spends most of its output thinking; one τ over whole answers cannot tell
whether a draft helps there or only in the answer. The evaluator's output ids are split as the
extract stage splits them (`eaglet.reasoning`, from token ids); each verification round counts
for the segment of the first position it verifies (the first drafted token). The rounds of all
segments are the whole evaluation's, so the whole τ is the segments' τ weighted by their rounds.
"""

from __future__ import annotations

from eaglet.reasoning import ReasoningFormat

SEGMENTS = ("thinking", "answer", "tool")
# A part kind's segment; the markers around a part (think_close, message_end, end) take the
# segment before them, a harmony header (`<|channel|>analysis<|message|>`) the one after it.
_SEGMENT_OF_KIND = {
    "think_open": "thinking",
    "reasoning": "thinking",
    "content": "answer",
    "tool_section": "tool",
    "tool_call": "tool",
}
_LEADING_MARKERS = {"header"}


def token_segments(
    output_ids: list[int], reasoning_format: ReasoningFormat, end_ids: set[int]
) -> list[str]:
    """The segment of every output position (len(output_ids) labels)."""
    labels: list[str] = []
    waiting = 0  # header tokens that take the next part's segment
    for part in reasoning_format.split(output_ids, end_ids).parts:
        if part.kind in _LEADING_MARKERS:
            waiting += len(part.ids)
            continue
        segment = _SEGMENT_OF_KIND.get(part.kind) or (labels[-1] if labels else "answer")
        labels += [segment] * (waiting + len(part.ids))
        waiting = 0
    labels += [labels[-1] if labels else "answer"] * waiting
    if len(labels) != len(output_ids):
        raise ValueError(
            f"the {reasoning_format.name} split covers {len(labels)} of {len(output_ids)} "
            "output tokens; segments need every token"
        )
    return labels


def segment_rounds(
    output_ids: list[int], accepted: list[int], labels: list[str]
) -> list[tuple[str, int, int]]:
    """(segment, accepted, emitted) for each round of one prompt: `accepted` holds its rounds'
    accepted counts (as `speculative_generate` returns them), `labels` each output token's
    segment.

    Round r's pending token (the target's choice before it) sits at output index i_r, with
    i_0 = 0 (the prefill's token) and i_{r+1} = i_r + n_r + 1; it verifies positions i_r + 1 on,
    and its segment is that of the first. A round past the output's last token (a stop inside
    the last round's drafts) counts for the last token's segment. The tokens a round emitted
    (its accepted drafts and its bonus token) are cut at the output's end, so they sum to every
    output token but the prefill's."""
    rounds, position = [], 0
    last = len(output_ids) - 1
    for n in accepted:
        emitted = max(min(position + n + 1, last) - position, 0)
        rounds.append((labels[min(position + 1, last)], n, emitted))
        position += n + 1
    return rounds


def segment_stats(rounds: list[tuple[str, int, int]], k: int) -> dict[str, dict]:
    """Per segment with rounds, from (segment, accepted, emitted) of every round: its rounds,
    τ (1 + accepted / rounds, vLLM's count), emitted τ (output tokens per round), the
    acceptance rate and the acceptance per draft position."""
    stats = {}
    for segment in SEGMENTS:
        mine = [(n, e) for s, n, e in rounds if s == segment]
        if not mine:
            continue
        accepted = [n for n, _ in mine]
        count = len(mine)
        stats[segment] = {
            "rounds": count,
            "tau": 1 + sum(accepted) / count,
            "emitted_tau": sum(e for _, e in mine) / count,
            "acceptance_rate": sum(accepted) / (k * count),
            "per_position_acceptance": [
                sum(n >= j for n in accepted) / count for j in range(1, k + 1)
            ],
        }
    return stats


def segments_text(stats: dict[str, dict], symbol: str = "tau") -> str:
    """`thinking tau 2.100 (30 rounds), answer tau 1.800 (12 rounds)`, in SEGMENTS order, from
    per-segment figures holding at least `tau` and `rounds`."""
    return ", ".join(
        f"{name} {symbol} {stats[name]['tau']:.3f} ({stats[name]['rounds']} rounds)"
        for name in SEGMENTS
        if name in stats
    )
