"""The training data side: the hidden-state shards of one folder read lazily as training
windows (`HiddenStatesData`), the order of each epoch's global batches, a global batch cut into
this process's micro-batches of about one length, and those micro-batches collated (right-padded)
onto the device with the target's in-vocab flags, ready for the method's loss.

Data parallel: every process takes rows rank, rank + world, ... of each global batch. An online
source (eaglet/draft/online.py) has `HiddenStatesData`'s interface plus `batch_items`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open

from eaglet.config.train import TrainConfig
from eaglet.draft.methods.base import DraftMethod, TrainingView
from eaglet.draft.methods.loss import target_in_vocab
from eaglet.draft.vocab import count_tokens
from eaglet.hidden_states.shards import INDEX, read_window

# ----------------------------------------------------------------------------------------- data

MIN_SAMPLE_TOKENS = 3  # t + 2 < n: shorter windows have nothing to predict


class HiddenStatesData:
    """The shards of one hidden-states folder, read lazily (safetensors mmap), one item per
    training window (a sample, or a max_seq_len piece of a longer one)."""

    def __init__(
        self,
        root: Path,
        exclude_sample_ids=frozenset(),
        max_seq_len: int = 1024,
        only_sample_ids: frozenset[str] | None = None,
    ):
        self.root = Path(root)
        lines = (self.root / INDEX).read_text().splitlines()
        entries = [json.loads(line) for line in lines if line.strip()]
        self.samples = [
            e
            for e in entries
            if e["sample_id"] not in exclude_sample_ids
            and (only_sample_ids is None or e["sample_id"] in only_sample_ids)
        ]
        self.windows: list[tuple[str, int, int]] = []  # (shard, offset, length)
        self.window_sample_ids: list[str] = []  # the sample each window is cut from
        for e in self.samples:
            for start, length in window_starts(e["length"], max_seq_len):
                self.windows.append((e["shard"], e["offset"] + start, length))
                self.window_sample_ids.append(e["sample_id"])
        self._files: dict = {}

    def _file(self, shard: str):
        if shard not in self._files:
            self._files[shard] = safe_open(str(self.root / shard), framework="pt")
        return self._files[shard]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard, offset, length = self.windows[i]
        # input_ids [n], loss_mask [n], aux_hidden_states [n, 3H], final_hidden_states [n, H]
        return read_window(self._file(shard), offset, length)  # float, whatever the storage

    def aux_width(self) -> int:
        return self._file(self.samples[0]["shard"]).get_slice("aux_hidden_states").get_shape()[1]

    def sample_tokens(self, entry: dict) -> dict[str, torch.Tensor]:
        """One whole sample's input_ids [n] and loss_mask [n] (`entry`: one of `samples`)."""
        handle, keys = self._file(entry["shard"]), ("input_ids", "loss_mask")
        return read_window(handle, entry["offset"], entry["length"], keys=keys)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Occurrences of each id among loss-masked tokens of the (non-excluded) samples: [V]."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for e in self.samples:
            window = self.sample_tokens(e)
            counts += count_tokens(window["input_ids"], window["loss_mask"], vocab_size)
        return counts

    def fingerprint(self, batch_size: int, max_seq_len: int) -> str:
        return data_fingerprint([e["sample_id"] for e in self.samples], batch_size, max_seq_len)


def window_starts(length: int, max_seq_len: int) -> list[tuple[int, int]]:
    """(start, length) of the training windows of a sample of `length` tokens."""
    spans = [(s, min(max_seq_len, length - s)) for s in range(0, length, max_seq_len)]
    return [(s, n) for s, n in spans if n >= MIN_SAMPLE_TOKENS]


def data_fingerprint(sample_ids: list[str], batch_size: int, max_seq_len: int) -> str:
    """What decides the order of batches (with the seed): a resume checks it is unchanged."""
    key = json.dumps([sorted(sample_ids), batch_size, max_seq_len])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One sample per row, right-padded with zeros; `lengths` [B] says where each row ends."""
    lengths = torch.tensor([len(it["input_ids"]) for it in items])
    T = int(lengths.max())
    batch = {
        key: torch.stack(
            [F.pad(it[key], (0, 0) * (it[key].dim() - 1) + (0, T - len(it[key]))) for it in items]
        )
        for key in items[0]
    }  # input_ids [B,T], loss_mask [B,T], aux [B,T,3H], final [B,T,H]
    batch["lengths"] = lengths
    return batch


BUCKET_BATCHES = 32  # length buckets: batches whose rows are sorted by length together


def epoch_batches(
    num_items: int, batch_size: int, seed: int, epoch: int, lengths: list[int] | None = None
) -> list[list[int]]:
    """The batches of one epoch: a permutation that depends only on (seed, epoch).

    With `lengths` (train.length_buckets), each run of BUCKET_BATCHES batches of that
    permutation is sorted by length before it is cut into batches, and the batches are then
    shuffled: the rows of a batch have about the same length, so little of a padded batch is
    padding, and every bucket still draws from the whole epoch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(num_items, generator=g).tolist()
    if lengths is None:
        return [order[i : i + batch_size] for i in range(0, num_items, batch_size)]
    bucket = batch_size * BUCKET_BATCHES
    batches = []
    for first in range(0, num_items, bucket):
        rows = sorted(order[first : first + bucket], key=lambda i: lengths[i])
        batches += [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    shuffled = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in shuffled]


# -------------------------------------------------------------------------------- micro-batches


class TrainingRun(Protocol):
    """What the batching below reads of a run (`eaglet.draft.train.Run`)."""

    config: TrainConfig
    data: Any  # HiddenStatesData, or OnlineData (eaglet/draft/online.py) with batch_items
    rank: int
    world: int
    step: int
    stop_at: int
    steps_per_epoch: int
    device: torch.device
    lm_head: torch.Tensor  # [V, H], the target's
    t2d: torch.Tensor  # bool [V]
    method: DraftMethod  # `prepare`s each micro-batch
    view: TrainingView  # what the method reads of the run


MAX_PADDING = 0.5  # a micro-batch's padded size is at most 1.5x its rows' tokens


def length_groups(rows: list[int], lengths: list[int], max_padding: float) -> list[list[int]]:
    """`rows` sorted by length and cut into runs whose padded size (rows x the longest) is at
    most (1 + max_padding) x their tokens: a batch of mixed lengths becomes a few micro-batches
    of about one length each, with almost no padding."""
    groups: list[list[int]] = []
    tokens = 0
    for row in sorted(rows, key=lambda r: lengths[r]):
        if groups and (len(groups[-1]) + 1) * lengths[row] <= (1 + max_padding) * (
            tokens + lengths[row]
        ):
            groups[-1].append(row)
            tokens += lengths[row]
        else:
            groups.append([row])
            tokens = lengths[row]
    return groups


def micro_batches(run: TrainingRun, indices: list[int], data: Any = None) -> list[list[int]]:
    """This process's share of a global batch (rows rank, rank + world, ...), sorted by length,
    split into `grad_accumulation` pieces and each piece into runs of about one length
    (`length_groups`). The loss of every piece is divided by the whole batch's counts, so the
    step is the same however the rows are split; only the padding computed shrinks."""
    windows = (run.data if data is None else data).windows
    share = sorted(indices[run.rank :: run.world], key=lambda j: windows[j][-1])
    size = max(1, math.ceil(len(share) / run.config.grad_accumulation))
    lengths = {j: windows[j][-1] for j in share}
    return [
        group
        for first in range(0, len(share), size)
        for group in length_groups(share[first : first + size], lengths, MAX_PADDING)
    ]


def epoch_order(run: TrainingRun, epoch: int) -> list[list[int]]:
    """The global batches of `epoch` for this run's data and settings."""
    c = run.config
    lengths = [window[-1] for window in run.data.windows] if c.length_buckets else None
    return epoch_batches(len(run.data), c.batch_size, c.seed, epoch, lengths)


def plan(run: TrainingRun) -> Iterator[list[int]]:
    """Every micro-batch this process will read, in order, from `run.step` to the end: what an
    online data source prefetches features for."""
    order, order_epoch = [], -1
    for step in range(run.step, run.stop_at):
        epoch, index = divmod(step, run.steps_per_epoch)
        if epoch != order_epoch:
            order, order_epoch = epoch_order(run, epoch), epoch
        yield from micro_batches(run, order[index])


def load_pieces(
    run: TrainingRun, indices: list[int], data: Any = None
) -> list[dict[str, torch.Tensor]]:
    """This process's micro-batches of a global batch of `data` (the training data unless
    given), on the device, with the target's in-vocab flags; an online source computes (or
    hands over prefetched) features here."""
    data = run.data if data is None else data  # not `or`: an empty dataset is falsy
    pieces = []
    for chunk in micro_batches(run, indices, data):
        if hasattr(data, "batch_items"):  # online: features from the target, now
            items = data.batch_items(chunk)
        else:
            items = [data[j] for j in chunk]
        batch = {k: v.to(run.device) for k, v in collate(items).items()}
        batch["in_vocab"] = target_in_vocab(batch["final_hidden_states"], run.lm_head, run.t2d)
        batch["windows"] = torch.tensor(chunk)  # which windows of `data`: named on a NaN loss
        run.method.prepare(run.view, run.step, batch)  # what its loss and counts need (anchors)
        pieces.append(batch)
    return pieces


def first_sample(data: Any, windows: torch.Tensor) -> str:
    """The sample id of the first of `windows` (indices into `data`), or the window index."""
    index = int(windows[0])
    ids = getattr(data, "window_sample_ids", None)
    return ids[index] if ids is not None else f"window {index}"
