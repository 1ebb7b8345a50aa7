"""The draft vocabulary: which target token ids the draft's lm_head can propose.

Owns counting token frequencies over the loss-masked (model-produced) tokens of the training
data, choosing the N most frequent ids (N never exceeds the number of distinct ids seen), the two
maps vLLM/SGLang read from the checkpoint - `d2t` (int64 [Vd], d2t[i] = target_id_i - i) and `t2d`
(bool [V]) - the coverage figure, and saving/loading the choice as JSON so a resumed run reuses it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DraftVocab:
    token_ids: tuple[int, ...]  # target ids in the draft vocab, ascending; draft id i <-> [i]
    target_vocab_size: int  # V
    coverage: float  # fraction of counted tokens whose id is in the draft vocab
    counted_tokens: int  # how many loss-masked tokens were counted

    @property
    def size(self) -> int:
        return len(self.token_ids)

    @property
    def ids(self) -> torch.Tensor:
        return torch.tensor(self.token_ids, dtype=torch.int64)  # [Vd]

    @property
    def d2t(self) -> torch.Tensor:
        return self.ids - torch.arange(self.size, dtype=torch.int64)  # [Vd]

    @property
    def t2d(self) -> torch.Tensor:
        t2d = torch.zeros(self.target_vocab_size, dtype=torch.bool)  # [V]
        t2d[self.ids] = True
        return t2d

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> DraftVocab:
        d = json.loads(Path(path).read_text())
        return cls(
            token_ids=tuple(d["token_ids"]),
            target_vocab_size=d["target_vocab_size"],
            coverage=d["coverage"],
            counted_tokens=d["counted_tokens"],
        )

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, target_vocab_size: int) -> DraftVocab:
        """Rebuild from a checkpoint's d2t (coverage unknown there: NaN)."""
        ids = d2t + torch.arange(len(d2t), dtype=torch.int64)
        return cls(tuple(ids.tolist()), target_vocab_size, float("nan"), 0)


def count_tokens(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, target_vocab_size: int
) -> torch.Tensor:
    """Occurrences of each target id among loss-masked tokens: int64 [V]."""
    ids = input_ids[loss_mask.bool()].long()
    return torch.bincount(ids, minlength=target_vocab_size)[:target_vocab_size]


def build_draft_vocab(counts: torch.Tensor, size: int) -> DraftVocab:
    """The `size` most frequent ids of `counts` ([V]), capped at the number of distinct ids seen.

    Ties go to the lower id, so the choice is deterministic."""
    distinct = int((counts > 0).sum())
    if distinct == 0:
        raise ValueError("no loss-masked tokens to build a draft vocabulary from")
    n = min(size, distinct)
    order = torch.sort(-counts, stable=True).indices  # most frequent first, lower id on ties
    chosen = torch.sort(order[:n]).values  # ascending target ids
    return vocab_over(chosen, counts)


def vocab_over(token_ids: torch.Tensor, counts: torch.Tensor) -> DraftVocab:
    """The draft vocab of `token_ids` (ascending target ids), its coverage measured on
    `counts` ([V]): a chosen vocabulary, or one a starting draft brings."""
    total = int(counts.sum())
    return DraftVocab(
        token_ids=tuple(token_ids.tolist()),
        target_vocab_size=len(counts),
        coverage=float(counts[token_ids].sum()) / max(total, 1),
        counted_tokens=total,
    )
