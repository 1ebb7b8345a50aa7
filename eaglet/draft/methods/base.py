"""What a draft method provides (`DraftMethod`) and what it is handed: everything the trainer,
the evaluator, the exports and the served check ask of a method, typed, and nothing about data
or files of the pipeline.

The trainer (`eaglet.draft.train`) owns the loop: data, optimizer, schedule, checkpoints,
distributed sums. Per micro-batch it asks the method for its loss over `positions` predicted
positions (EAGLE-3: the TTT steps; a block drafter: its drafts), with the same statistics per
position (`eaglet.draft.methods.loss.PositionStats`), handing it a `TrainingView`: what a
method may read of the run. The evaluator (`eaglet.draft.evaluate`) runs vLLM's rounds with any
method's `Drafter`. A draft is an `nn.Module` at this seam; each method narrows it to its own
class (`own`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from eaglet.config.pipeline import PipelineConfig
    from eaglet.config.target import TargetConfig
    from eaglet.config.train import TrainConfig
    from eaglet.draft.methods.loss import PositionStats
    from eaglet.draft.target_head import TargetHead, TargetNumbers
    from eaglet.draft.vocab import DraftVocab

Batch = dict[str, torch.Tensor]  # one micro-batch: input_ids [B, T], loss_mask, aux, final, ...
ConfigJson = Mapping[str, object]  # a draft's config.json


@dataclass(frozen=True)
class TrainingView:
    """What a method's loss may read of the training run: the settings, the draft being
    trained, the target's borrowed matrices and how to autocast."""

    settings: TrainConfig
    draft: nn.Module
    embed: torch.Tensor  # [V, H], the target's token embeddings (frozen)
    draft_lm_head: torch.Tensor  # [Vd, H], the target's lm_head rows of the draft vocabulary
    device: torch.device
    autocast: torch.dtype | None  # None: float32

    def autocasting(self) -> torch.autocast:
        return torch.autocast(
            self.device.type,
            dtype=self.autocast or torch.bfloat16,
            enabled=self.autocast is not None,
        )


@dataclass(frozen=True)
class ExportConvention:
    """What an engine reads of one export's config.json that fails silently when wrong: the
    architecture string it routes to a model class, and the key and convention of the layer
    ids (the engine check, `eaglet.draft.engine_check`, holds every export to it)."""

    engine: str  # the engine that loads the export: vllm | sglang
    architecture: str  # config.json's architectures[0]
    engine_class: str  # the class the method means (vLLM: the registry's module.Class)
    layer_ids_key: str  # where config.json holds the layer ids (dotted: "a.b")
    layer_id_offset: int  # the file's id = eaglet's id + this: the engine's convention
    convention: str  # how the engine reads an id, for messages


class WeightHolder(Protocol):
    weight: torch.Tensor


class TargetModel(Protocol):
    """What a drafter borrows of the loaded target: its embedding and lm_head."""

    def get_input_embeddings(self) -> WeightHolder: ...

    def get_output_embeddings(self) -> WeightHolder: ...


class Drafter(Protocol):
    def propose(self, ids: list[int], aux: torch.Tensor, next_token: int, k: int) -> list[int]:
        """k drafted target token ids following `next_token` (the target's token at position
        len(ids)); `ids` x_0..x_{L-1}, `aux` [L, n * H] their target states."""
        ...


class DraftMethod(Protocol):
    name: str
    full_vocab: bool  # drafts over the target's whole vocabulary (no draft vocab to pick)
    # TrainConfig fields the method does not read: set away from their defaults, the preflight
    # says they would do nothing
    foreign_settings: tuple[str, ...]

    # ------------------------------------------------------------------ layers and checks
    def layer_ids(self, requested: list[int] | None, num_layers: int) -> list[int]:
        """The target layers it reads (eaglet's convention), `requested` or its default."""
        ...

    def problems(self, config: PipelineConfig, target: TargetNumbers) -> list[str]:
        """Why this run cannot train this method on this target (the preflight's lines)."""
        ...

    # -------------------------------------------------------------------------- training
    def build(
        self, head: TargetHead, train: TrainConfig, vocab: DraftVocab, layer_ids: list[int]
    ) -> nn.Module:
        """A fresh draft for the target `head`."""
        ...

    def positions(self, train: TrainConfig) -> int:
        """Positions each training anchor predicts (the per-position statistics' length)."""
        ...

    def prepare(self, view: TrainingView, step: int, batch: Batch) -> None:
        """Add what the loss and the counts need to a micro-batch (once per batch)."""
        ...

    def counted(self, i: int, batch: Batch) -> torch.Tensor:
        """bool [B, T]: where position i's loss counts (its denominator across pieces)."""
        ...

    def piece_loss(
        self, view: TrainingView, batch: Batch, denominators: list[int] | None
    ) -> tuple[torch.Tensor, PositionStats]:
        """(loss, statistics per position) of one micro-batch."""
        ...

    # ----------------------------------------------------------------------------- files
    def reads(self, config: ConfigJson) -> bool:
        """Whether a draft's config.json without eaglet's label is this method's format."""
        ...

    def save(self, draft: nn.Module, folder: Path, layer_ids: list[int], convention: str) -> Path:
        """Write the draft as vLLM loads it: config.json and model.safetensors."""
        ...

    def load(
        self, folder: Path, device: str | torch.device = "cpu"
    ) -> tuple[nn.Module, ConfigJson]:
        """(draft, config.json) of a folder `save` (or an export it reads) wrote."""
        ...

    def draft_layer_ids(self, config: ConfigJson, where: Path | str) -> list[int]:
        """The target layers a saved draft reads, in eaglet's convention."""
        ...

    def fresh_like(self, draft: nn.Module, seed: int) -> nn.Module:
        """An untrained draft of the same shape (the evaluation's baseline)."""
        ...

    def exports(self, draft_dir: Path, target: TargetConfig, k: int) -> dict[str, str]:
        """Engine -> folder of every export written beside `draft_dir` (vllm: the draft itself)."""
        ...

    def export_convention(self, export: str) -> ExportConvention:
        """What the engine of the export named `export` (an `exports` key) reads of it."""
        ...

    def export_problems(
        self, folder: Path, config: ConfigJson, target_vocab: int, k: int
    ) -> list[tuple[str, str]]:
        """(convention, what is wrong) of the method's own contracts in one export: its block
        against `k`, its vocabulary maps against the target's `target_vocab`."""
        ...

    # ---------------------------------------------------------------------------- rounds
    def drafter(self, draft: nn.Module, target: TargetModel, use_cache: bool) -> Drafter:
        """The draft's proposals along one sequence, as vLLM makes them."""
        ...

    def evaluation_k(self, config: ConfigJson, requested: int) -> int:
        """The drafts per round the evaluation and the served check use."""
        ...

    def speculative_config(self, draft_dir: Path, k: int) -> dict[str, object]:
        """vLLM's `--speculative-config` for the draft in `draft_dir`."""
        ...


D = TypeVar("D", bound=nn.Module)


def own(draft: nn.Module, cls: type[D]) -> D:
    """`draft` as the method's own class (a draft of another method is a caller's bug)."""
    if not isinstance(draft, cls):
        raise TypeError(f"a {type(draft).__name__} handed to the method of {cls.__name__}")
    return draft


def mask_token(target: TargetNumbers, chosen: int | None = None) -> int:
    """The token id of a parallel drafter's mask slots: `chosen`, else the target's pad token
    (never in a training sequence), else its last id. Its embedding is the target's."""
    if chosen is not None:
        return chosen
    pad, vocab_size = target.get("pad_token_id"), target["vocab_size"]
    return pad if isinstance(pad, int) and 0 <= pad < vocab_size else vocab_size - 1
