"""Per-sample reuse of hidden states (`eaglet.reuse` says when a folder qualifies): the stored
features of earlier `hidden_states` folders alike, read bit for bit from their shards."""

from __future__ import annotations

import json
from pathlib import Path

from eaglet.hidden_states.shards import INDEX


class FeatureReuse:
    """The stored features of earlier `hidden_states` folders alike (`earlier_runs_alike`), by
    sample id: `take(example)` gives a sample's tensors in their storage form, read bit for
    bit from the old shard (never decoded and encoded again), when its token ids are equal;
    its loss mask is the example's own (extract may have changed it)."""

    def __init__(self, folders: list[Path]):
        self.where: dict[str, tuple[Path, int, int]] = {}  # id -> (shard, offset, length)
        for folder in reversed(folders):  # the newest folder's entry wins
            with open(folder / INDEX, encoding="utf-8") as index:
                for line in index:
                    row = json.loads(line)
                    self.where[row["sample_id"]] = (
                        folder / row["shard"],
                        row["offset"],
                        row["length"],
                    )
        self.sources = [f.name for f in folders]
        self._handles: dict[Path, object] = {}

    def _open(self, shard: Path):
        from safetensors import safe_open

        if shard not in self._handles:
            self._handles[shard] = safe_open(str(shard), framework="pt")
        return self._handles[shard]

    def _stored_ids(self, sample_id: str, input_ids: list[int]):
        """The stored token ids of `sample_id` when they equal `input_ids`, else None."""
        found = self.where.get(sample_id)
        if found is None or found[2] != len(input_ids):
            return None
        shard, offset, length = found
        stored_ids = self._open(shard).get_slice("input_ids")[offset : offset + length]
        return stored_ids if stored_ids.tolist() == list(input_ids) else None

    def has(self, sample_id: str, input_ids: list[int]) -> bool:
        return self._stored_ids(sample_id, input_ids) is not None

    def take(self, sample_id: str, input_ids: list[int], loss_mask: list[int]) -> dict | None:
        import torch

        stored_ids = self._stored_ids(sample_id, input_ids)
        if stored_ids is None:
            return None
        shard, offset, length = self.where[sample_id]
        handle = self._open(shard)
        tensors = {
            key: handle.get_slice(key)[offset : offset + length].contiguous()
            for key in handle.keys()
            if key not in ("input_ids", "loss_mask")
        }
        return {
            "input_ids": stored_ids.to(torch.int64),  # [n]
            "loss_mask": torch.tensor(loss_mask, dtype=torch.uint8),  # [n]
            **tensors,
        }

    def close(self) -> None:
        self._handles.clear()
