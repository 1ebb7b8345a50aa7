"""Online training data: the examples themselves, with each batch's features computed by the
target as training goes (train.hidden_states: online), so no feature shard is ever stored.

Two sources of features, chosen by hidden_states.backend:

- co-located (`hf`): the target runs in the training process through the hf hidden-states
  backend (`HFBackend.forward`, the very function the offline stage stores features with),
  frozen and without grad, on `target.device`, micro-batch by micro-batch;
- served (`vllm`): vLLM servers with the hidden-states connector compute them
  (`eaglet.hidden_states.vllm_backend.VllmBackend.stream`, concurrent requests), and a thread
  fetches the micro-batches the trainer will read next (`train.plan`) into a bounded queue of
  `train.online_prefetch` micro-batches: ahead of the trainer, blocked when the trainer is
  slower (back-pressure), nothing on disk.

A training window that starts inside a long sample gets the states of its full prefix, as the
offline windows cut from whole-sample states do. `OnlineData` has `HiddenStatesData`'s
interface plus `batch_items` (and `start_prefetch` / `stop_prefetch`), which the trainer calls.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from eaglet.config import HiddenStatesConfig, TargetConfig
from eaglet.draft.train_data import data_fingerprint, window_starts
from eaglet.draft.vocab import count_tokens
from eaglet.hidden_states.hf import HFBackend
from eaglet.records.examples import Example
from eaglet.records.io import read_jsonl
from eaglet.target import load_config


class FeatureSource(Protocol):
    def forward(self, batch: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        """Per token-id list: aux_hidden_states [n, 3H], final_hidden_states [n, H] (float)."""
        ...


class CoLocated:
    """The target in this process (hf backend), frozen, loaded on first use."""

    def __init__(self, target: TargetConfig, aux_layer_ids: list[int]):
        self.target, self.aux_layer_ids = target, aux_layer_ids
        self._backend: HFBackend | None = None

    def forward(self, batch: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        if self._backend is None:  # a resume that is already done loads nothing
            self._backend = HFBackend(self.target, self.aux_layer_ids)
            for p in self._backend.model.parameters():
                p.requires_grad_(False)
        return self._backend.forward(batch)


class Served:
    """vLLM servers with the hidden-states connector (hidden_states.backend: vllm)."""

    def __init__(self, target: TargetConfig, settings: HiddenStatesConfig):
        from eaglet.hidden_states.vllm_backend import VllmBackend  # httpx client, only when served

        self.backend = VllmBackend(target, settings)

    def forward(self, batch: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        examples = [
            Example(
                sample_id=f"window-{i}",
                source="online",
                reasoning="",
                content="",
                input_ids=ids,
                loss_mask=[0] * len(ids),
                finish_reason="stop",
            )
            for i, ids in enumerate(batch)
        ]
        return [features for _, features in self.backend.stream(examples)]


class OnlineData:
    """The examples of `examples.jsonl` (minus `exclude_sample_ids`), one item per training
    window; `batch_items` adds the target's features."""

    mode = "online"

    def __init__(
        self,
        examples_path: Path,
        target: TargetConfig,
        aux_layer_ids: list[int],
        exclude_sample_ids=frozenset(),
        max_seq_len: int = 1024,
        source: FeatureSource | None = None,
        prefetch: int = 0,
    ):
        """`source` defaults to the co-located target; `prefetch` > 0 micro-batches are
        computed ahead in a thread once `start_prefetch` is given the trainer's plan."""
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
        self.source = source or CoLocated(target, self.aux_layer_ids)
        self.prefetch = prefetch
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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

    def features(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """The windows `indices` with the target's aux [n, 3H] and final [n, H] states, from
        one forward of the target over the windows' prefixes."""
        items = [self[i] for i in indices]
        computed = self.source.forward([item.pop("prefix_ids").tolist() for item in items])
        for item, f in zip(items, computed, strict=True):
            n = len(item["input_ids"])
            item["aux_hidden_states"] = f["aux_hidden_states"][-n:]
            item["final_hidden_states"] = f["final_hidden_states"][-n:]
        return items

    def batch_items(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """What the trainer reads for one micro-batch: from the prefetch queue when it runs
        (which must hold exactly this micro-batch next), else computed now."""
        if self._queue is None:
            return self.features(indices)
        got, items = self._queue.get()
        if isinstance(items, BaseException):  # the source's own error, not a wrapper's
            items.add_note("(raised while the online features were prefetched)")
            raise items
        if got != indices:
            raise RuntimeError(f"online prefetch out of step: expected {indices}, got {got}")
        return items

    def start_prefetch(self, plan: Iterator[list[int]]) -> None:
        """Compute the micro-batches of `plan` ahead, at most `prefetch` waiting."""
        if self.prefetch <= 0:
            return
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._stop.clear()

        def work() -> None:
            try:
                for indices in plan:
                    if self._stop.is_set():
                        return
                    items = self.features(indices)
                    while not self._stop.is_set():  # blocks while the queue is full
                        try:
                            self._queue.put((indices, items), timeout=0.5)
                            break
                        except queue.Full:
                            continue
            except BaseException as error:  # handed to the trainer, raised there
                self._queue.put((None, error))

        self._thread = threading.Thread(target=work, name="online-prefetch", daemon=True)
        self._thread.start()

    def stop_prefetch(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread, self._queue = None, None

    def aux_width(self) -> int:
        return len(self.aux_layer_ids) * self.hidden_size

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for e in self.examples:
            counts += count_tokens(torch.tensor(e.input_ids), torch.tensor(e.loss_mask), vocab_size)
        return counts

    def fingerprint(self, batch_size: int, max_seq_len: int) -> str:
        return data_fingerprint([e.sample_id for e in self.examples], batch_size, max_seq_len)
