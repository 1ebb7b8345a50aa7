"""Online training data: the examples themselves, with each batch's features computed by the
target as training goes (train.hidden_states: online), so no feature shard is ever stored.

Co-located: the target runs in the training process through the hf hidden-states backend
(`eaglet.hidden_states.hf.HFBackend`, the very function the offline stage stores features
with), frozen and without grad, on `target.device`. A training window that starts inside a long
sample gets the states of its full prefix, as the offline windows cut from whole-sample states
do. `OnlineData` has `HiddenStatesData`'s interface plus `add_features`, which the trainer calls
on each micro-batch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eaglet.config import TargetConfig
from eaglet.draft.train import data_fingerprint, window_starts
from eaglet.draft.vocab import count_tokens
from eaglet.hidden_states.hf import HFBackend
from eaglet.records.examples import Example
from eaglet.records.io import read_jsonl
from eaglet.target import load_config


class OnlineData:
    """The examples of `examples.jsonl` (minus `exclude_sample_ids`), one item per training
    window; features come from `add_features`."""

    mode = "online"

    def __init__(
        self,
        examples_path: Path,
        target: TargetConfig,
        aux_layer_ids: list[int],
        exclude_sample_ids=frozenset(),
        max_seq_len: int = 1024,
    ):
        self.root = Path(examples_path)
        self.target = target
        self.aux_layer_ids = list(aux_layer_ids)
        self.examples = [
            e for e in read_jsonl(self.root, Example) if e.sample_id not in exclude_sample_ids
        ]
        self.samples = [
            {"sample_id": e.sample_id, "length": len(e.input_ids)} for e in self.examples
        ]
        self.windows = [
            (row, start, length)
            for row, e in enumerate(self.examples)
            for start, length in window_starts(len(e.input_ids), max_seq_len)
        ]
        self.hidden_size = load_config(target).hidden_size
        self._backend: HFBackend | None = None

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row, start, length = self.windows[i]
        e = self.examples[row]
        return {
            "input_ids": torch.tensor(e.input_ids[start : start + length]),  # [n]
            "loss_mask": torch.tensor(e.loss_mask[start : start + length]).bool(),  # [n]
            "prefix_ids": torch.tensor(e.input_ids[: start + length]),  # the target's input
        }

    @property
    def backend(self) -> HFBackend:
        if self._backend is None:  # loaded on first use: a resume that is done loads nothing
            self._backend = HFBackend(self.target, self.aux_layer_ids)
            for p in self._backend.model.parameters():
                p.requires_grad_(False)
        return self._backend

    def add_features(self, items: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """`items` with the target's aux [n, 3H] and final [n, H] states of their windows, from
        one forward of the target over the windows' prefixes."""
        prefixes = [item.pop("prefix_ids").tolist() for item in items]
        features = self.backend.forward(prefixes)
        for item, f in zip(items, features, strict=True):
            n = len(item["input_ids"])
            item["aux_hidden_states"] = f["aux_hidden_states"][-n:]
            item["final_hidden_states"] = f["final_hidden_states"][-n:]
        return items

    def aux_width(self) -> int:
        return 3 * self.hidden_size

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for e in self.examples:
            counts += count_tokens(torch.tensor(e.input_ids), torch.tensor(e.loss_mask), vocab_size)
        return counts

    def fingerprint(self, batch_size: int, max_seq_len: int) -> str:
        return data_fingerprint([e.sample_id for e in self.examples], batch_size, max_seq_len)
