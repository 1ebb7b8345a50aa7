"""The loop guard: stop an answer that repeats itself instead of paying for it to `max_tokens`.

Reasoning models loop: the same sentence or paragraph again and again until the token budget
ends (speculators' users found 35% of regenerated rows truncated). `LoopDetector` is fed an
answer's token ids as they stream in and says when one n-gram (`ngram` consecutive tokens) has
occurred `repeats` times: a paragraph of P tokens repeated R times holds each of its n-grams R
times, so a loop is caught after about `repeats` rounds of it, whatever its period. Ordinary
text rarely repeats a long n-gram many times; the defaults (32 tokens, 8 times) were measured
to stop none of the demo's answers (benchmarks/loop_guard.py).

O(ngram) per token (a tuple key), O(distinct n-grams) memory per answer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class LoopDetector:
    """Feed it an answer's ids in order; `looping` turns True once an n-gram hits `repeats`."""

    ngram: int
    repeats: int
    ids: list[int] = field(default_factory=list)
    counts: dict[tuple[int, ...], int] = field(default_factory=lambda: defaultdict(int))
    looping: bool = False
    repeated: tuple[int, ...] = ()  # the n-gram that hit `repeats`

    def feed(self, new_ids: list[int]) -> bool:
        """Add `new_ids`; True once the answer is looping (and from then on)."""
        for token in new_ids:
            self.ids.append(token)
            if self.looping or len(self.ids) < self.ngram:
                continue
            key = tuple(self.ids[-self.ngram :])
            self.counts[key] += 1
            if self.counts[key] >= self.repeats:
                self.looping, self.repeated = True, key
        return self.looping

    def evidence(self) -> dict[str, object]:
        """What `raw["loop"]` of a stopped record says: the n-gram, its count, where it stopped."""
        return {
            "ngram": self.ngram,
            "repeats": self.repeats,
            "stopped_at_token": len(self.ids),
            "repeated_ids": list(self.repeated),
        }


def first_loop(ids: list[int], ngram: int, repeats: int) -> int | None:
    """Where the detector would stop `ids` (the number of tokens it had read), or None."""
    detector = LoopDetector(ngram, repeats)
    for position, token in enumerate(ids, start=1):
        if detector.feed([token]):
            return position
    return None
