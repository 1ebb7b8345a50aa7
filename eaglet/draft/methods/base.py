"""What a draft method provides (`DraftMethod`): everything the trainer, the evaluator, the
exports and the served check ask of a method, and nothing about data or files of the pipeline.

The trainer (`eaglet.draft.train`) owns the loop: data, optimizer, schedule, checkpoints,
distributed sums. Per micro-batch it asks the method for its loss over `positions` predicted
positions (EAGLE-3: the TTT steps; DFlash: the block's masks), with the same statistics per
position (loss sums, hits, counted positions) so logs, plots and meters are the method's own
without another loop. The evaluator (`eaglet.draft.evaluate`) runs vLLM's rounds with any
method's `drafter`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch


class Drafter(Protocol):
    def propose(self, ids: list[int], aux: torch.Tensor, next_token: int, k: int) -> list[int]:
        """k drafted target token ids following `next_token` (the target's token at position
        len(ids)); `ids` x_0..x_{L-1}, `aux` [L, n * H] their target states."""


class DraftMethod(Protocol):
    name: str
    full_vocab: bool  # drafts over the target's whole vocabulary (no draft vocab to pick)

    def layer_ids(self, requested: list[int] | None, num_layers: int, train: Any) -> list[int]:
        """The target layers it reads (eaglet's convention), `requested` or its default."""

    def problems(self, config: Any, target: dict[str, Any]) -> list[str]:
        """Why this run cannot train this method on this target (the preflight's lines)."""

    def build(self, head: Any, train: Any, vocab: Any, layer_ids: list[int]) -> torch.nn.Module:
        """A fresh draft for the target `head` (eaglet.draft.target_head.TargetHead)."""

    def positions(self, train: Any) -> int:
        """Positions each training anchor predicts (the per-position statistics' length)."""

    def prepare(self, run: Any, batch: dict[str, torch.Tensor]) -> None:
        """Add what the loss and the counts need to a micro-batch (once per batch)."""

    def counted(self, i: int, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """bool [B, T]: where position i's loss counts (its denominator across pieces)."""

    def piece_loss(self, run: Any, batch: dict, denominators: list[int] | None):
        """(loss, stats) of one micro-batch; stats per position: loss, acc, count, loss_sum,
        hits (`eaglet.draft.ttt_loss.ttt_loss`'s)."""

    def save(self, draft: torch.nn.Module, folder: Path, layer_ids: list[int], convention: str):
        """Write the draft as vLLM loads it: config.json and model.safetensors."""

    def load(self, folder: Path, device: str | torch.device = "cpu") -> tuple[Any, dict]:
        """(draft, config.json) of a folder `save` (or an export it reads) wrote."""

    def fresh_like(self, draft: torch.nn.Module, seed: int) -> torch.nn.Module:
        """An untrained draft of the same shape (the evaluation's baseline)."""

    def drafter(self, draft: torch.nn.Module, target: Any, use_cache: bool) -> Drafter:
        """The draft's proposals along one sequence, as vLLM makes them."""

    def evaluation_k(self, config_json: dict, requested: int) -> int:
        """The drafts per round the evaluation and the served check use."""

    def speculative_config(self, draft_dir: Path, k: int) -> dict[str, Any]:
        """vLLM's `--speculative-config` for the draft in `draft_dir`."""

    def exports(self, draft_dir: Path, target: Any, num_speculative_tokens: int) -> dict[str, str]:
        """Engine -> folder of every export written beside `draft_dir` (vllm: the draft itself)."""
