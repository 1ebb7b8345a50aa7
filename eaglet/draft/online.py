"""Online training data: the examples themselves, with each batch's features computed by the
target as training goes (train.hidden_states: online), so no feature shard is ever stored.

The features come from the hidden-state backend `hidden_states.backend` names, opened from
the registry (`eaglet.hidden_states.backends`) as the offline stage opens it, and computed by
the very function the offline stage stores features with (`FeatureSource.features`): the hf
backend runs the target in the training process, frozen and without grad, micro-batch by
micro-batch; a served backend (`served`, the vllm backend's servers) is fetched ahead by a
thread: the micro-batches the trainer will read next (`train.plan`) go into a bounded queue of
`train.online_prefetch` micro-batches, ahead of the trainer, blocked when the trainer is slower
(back-pressure), nothing on disk.

A training window that starts inside a long sample gets the states of its full prefix, as the
offline windows cut from whole-sample states do. `OnlineData` has `HiddenStatesData`'s
interface plus `batch_items` (and `start_prefetch` / `stop_prefetch`), which the trainer calls.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from eaglet.config.hidden_states import HiddenStatesConfig
from eaglet.config.target import TargetConfig
from eaglet.draft.train_data import data_fingerprint, window_starts
from eaglet.draft.vocab import count_tokens
from eaglet.hidden_states.backends import hidden_states_backend
from eaglet.hidden_states.backends.base import FeatureSource, Window
from eaglet.records.examples import Example
from eaglet.records.io import read_jsonl
from eaglet.target import load_config


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
        hidden_states: HiddenStatesConfig | None = None,
    ):
        """`source` defaults to the backend `hidden_states.backend` names (the defaults': hf),
        opened on first use (a resume that is already done opens nothing); `prefetch` > 0
        micro-batches are computed ahead in a thread once `start_prefetch` is given the
        trainer's plan."""
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
        self.settings = hidden_states or HiddenStatesConfig()
        self._source = source
        self.prefetch = prefetch
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.waited_s = 0.0  # the trainer's seconds waiting for prefetched features, in all
        self._fills: list[int] = []  # micro-batches waiting in the queue at each read
        self._window_wait_s = 0.0  # waited since the last `queue_stats`

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
    def source(self) -> FeatureSource:
        if self._source is None:
            backend = hidden_states_backend(self.settings.backend)
            self._source = backend.open(self.target, self.settings, self.aux_layer_ids)
        return self._source

    def close(self) -> None:
        """Close the source, if one was opened."""
        if self._source is not None:
            self._source.close()

    def features(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """The windows `indices` with the target's aux [n, 3H] and final [n, H] states, from
        the source's features of the windows' prefixes."""
        items = [self[i] for i in indices]
        prefixes = []
        for i, item in zip(indices, items, strict=True):
            row, start, length = self.windows[i]
            name = f"{self.examples[row].sample_id}[:{start + length}]"
            prefixes.append(Window(name, item.pop("prefix_ids").tolist()))
        computed = self.source.features(prefixes)
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
        self._fills.append(self._queue.qsize())
        asked = time.monotonic()
        got, items = self._queue.get()
        waited = time.monotonic() - asked
        self.waited_s += waited
        self._window_wait_s += waited
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

    def queue_stats(self) -> dict | None:
        """Since the last call: the mean micro-batches waiting when the trainer read one
        (`fill`, of `size`) and the seconds it waited (`wait_s`); None without prefetch."""
        if self.prefetch <= 0:
            return None
        fills, self._fills = self._fills, []
        waited, self._window_wait_s = self._window_wait_s, 0.0
        fill = sum(fills) / len(fills) if fills else 0.0
        return {"fill": fill, "size": self.prefetch, "wait_s": waited}

    def server_stats(self) -> dict:
        """Per capture server: samples, busy seconds, retries (served sources; else {})."""
        stats = getattr(self._source, "server_stats", None)
        return stats() if stats is not None else {}

    def aux_width(self) -> int:
        return len(self.aux_layer_ids) * self.hidden_size

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for e in self.examples:
            counts += count_tokens(torch.tensor(e.input_ids), torch.tensor(e.loss_mask), vocab_size)
        return counts

    def fingerprint(self, batch_size: int, max_seq_len: int) -> str:
        return data_fingerprint([e.sample_id for e in self.examples], batch_size, max_seq_len)
