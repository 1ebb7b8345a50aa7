"""DFlash (`train.method: dflash`): a block drafter. Each round it drafts K tokens in one forward
pass, the bonus token and K mask tokens attending to each other and to the target's states of
every accepted position (`eaglet.draft.methods.dflash_model`), as vLLM 0.32 serves
`method: dflash`; training, rounds and the files' common part are every block drafter's
(`eaglet.draft.methods.block`).

Its files: vLLM's `qwen3_dflash` layout (`DFlashDraftModel`, `dflash_config` with z-lab's layer
ids, the mask token and the block size), and speculators' (`speculators_model_type: dflash`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from eaglet.draft.methods.base import ConfigJson, DraftMethod
from eaglet.draft.methods.block import BlockMethod, layer_numbers
from eaglet.draft.methods.dflash_model import DFlashConfig, DFlashDraft

if TYPE_CHECKING:
    from eaglet.config.train import TrainConfig
    from eaglet.draft.methods.settings import BlockSettings, DFlashSettings

ARCHITECTURE = "DFlashDraftModel"  # vLLM maps it to qwen3_dflash.DFlashQwen3ForCausalLM


class DFlashMethod(BlockMethod):
    name = "dflash"
    label = "DFlash"
    speculators_folder = "draft-speculators-dflash"  # "dflash" in the path: vLLM's method
    architecture = ARCHITECTURE
    speculators_architecture = "DFlashSpeculator"
    vllm_class = "vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM"
    layer_ids_key = "dflash_config.target_layer_ids"

    def settings(self, train: TrainConfig) -> DFlashSettings:
        return train.dflash

    def new_draft(self, fields: dict[str, Any], settings: BlockSettings) -> DFlashDraft:
        return DFlashDraft(DFlashConfig(**fields))

    def reads(self, config: ConfigJson) -> bool:
        return "dflash_config" in config or config.get("speculators_model_type") == "dflash"

    def layout(self, config: DFlashConfig) -> dict[str, object]:
        return {
            "architectures": [ARCHITECTURE],
            # z-lab's convention: the output of layer k, eaglet's id k + 1
            "dflash_config": {
                "target_layer_ids": [int(i) - 1 for i in config.target_layer_ids],
                "mask_token_id": config.mask_token_id,
                "block_size": config.block_size,
            },
        }

    def speculators_layout(self, config: DFlashConfig) -> dict[str, object]:
        return {"architectures": ["DFlashSpeculator"], "sample_from_anchor": False}

    def load(
        self, folder: Path, device: str | torch.device = "cpu"
    ) -> tuple[DFlashDraft, dict[str, Any]]:
        """eaglet's export, a peer's `qwen3_dflash` checkpoint or speculators' layout."""
        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text())
        dflash = raw.get("dflash_config") or {}
        block = dflash.get("block_size") or raw.get("block_size") or 16
        mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
        config = DFlashConfig(
            **layer_numbers(raw),
            target_layer_ids=self.draft_layer_ids(raw, folder / "config.json"),
            block_size=int(block),
            mask_token_id=int(mask),
        )
        draft = DFlashDraft(config)
        draft.load_checkpoint_tensors(load_file(str(folder / "model.safetensors")))
        return draft.to(device), raw

    def evaluation_k(self, config: ConfigJson, requested: int) -> int:
        raw: dict[str, Any] = dict(config)
        block = (raw.get("dflash_config") or {}).get("block_size") or raw.get("block_size")
        return int(block or requested + 1) - 1


METHOD: DraftMethod = DFlashMethod()  # checked against the seam by the type checker
