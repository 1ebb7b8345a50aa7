"""P-EAGLE (`train.method: peagle`): an EAGLE-3 draft trained for vLLM's `parallel_drafting`, so
a round drafts its k tokens in one forward pass instead of k.

The network is EAGLE-3's plus one learned vector, `mask_hidden` [3 * H_target]: the stand-in
for the fused target states of the positions not known yet. A round (vLLM 0.32,
`llm_base_proposer` with `parallel_drafting: true`) runs the usual first step at every new
position (the token after it and its target states; the last one drafts token 1), then k - 1
mask slots at the next positions, each reading the target's embedding of the mask token and
`fc(mask_hidden)`, attending causally to the real positions and the masks before it; mask j
drafts token j + 1. Training is EAGLE-3's training-time test with those fixed inputs in every
step after the first (`ttt_unroll(mask_inputs=...)`): the attention pattern is the same.

The export is EAGLE-3's vLLM checkpoint with `mask_hidden` among its tensors and the mask token
in `pard_token` (vLLM's name; a server without parallel drafting ignores both).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from torch import nn

from eaglet.draft.methods.base import (
    ConfigJson,
    DraftMethod,
    TargetModel,
    TrainingView,
    mask_token,
    own,
)
from eaglet.draft.methods.eagle3 import ChainDrafter, Eagle3Method
from eaglet.draft.methods.eagle3_checkpoint import config_from_json, save_draft
from eaglet.draft.methods.eagle3_model import Eagle3Config, Eagle3Draft

if TYPE_CHECKING:
    from eaglet.config.pipeline import PipelineConfig
    from eaglet.config.target import TargetConfig
    from eaglet.draft.target_head import TargetNumbers


class ParallelEagle3Draft(Eagle3Draft):
    method_name = "peagle"  # eaglet.draft.methods

    def __init__(self, config: Eagle3Config, mask_token_id: int):
        super().__init__(config)
        self.mask_token_id = mask_token_id
        width = config.num_aux_layers * config.target_hidden_size
        self.mask_hidden = nn.Parameter(torch.zeros(width))  # [3H_t], learned

    def mask_inputs(self, embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What every mask slot reads: (the target's embedding of the mask token [H],
        fuse(mask_hidden) [H], as vLLM computes it when it loads the draft)."""
        return embed[self.mask_token_id], self.fuse(self.mask_hidden[None])[0]


class ParallelDrafter(ChainDrafter):
    """One round of parallel drafting: the first step as EAGLE-3's (its cache kept across
    rounds), then k - 1 mask slots in one forward, causal among themselves."""

    draft: ParallelEagle3Draft

    @torch.no_grad()
    def propose(self, ids: list[int], aux: torch.Tensor, next_token: int, k: int) -> list[int]:
        draft, device, L = self.draft, aux.device, len(ids)
        hidden, step0 = self.first_step(ids, aux, next_token)  # [1, 1, H]
        logits = [draft.compute_logits(hidden)[0, -1]]
        if k > 1:
            token, mask_hidden = draft.mask_inputs(self.embed)
            n = k - 1
            embeds = token.expand(1, n, -1)
            positions = torch.arange(L, L + n, device=device)[None]  # P + 1 .. P + k - 1
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            mask = torch.cat([torch.ones(n, L, dtype=torch.bool, device=device), causal], -1)
            out, _ = draft(embeds, mask_hidden.expand(1, n, -1), positions, [step0], mask)
            logits += list(draft.compute_logits(out)[0])
        return [int(draft.to_target_ids(row.argmax())) for row in logits]


class ParallelEagle3Method(Eagle3Method):
    name = "peagle"
    foreign_settings: tuple[str, ...] = (
        "init_from",
    )  # training starts from scratch: mask_hidden is new

    def problems(self, config: PipelineConfig, target: TargetNumbers) -> list[str]:
        k, steps = config.evaluate.num_speculative_tokens, config.train.ttt_length
        if k > steps:
            return [
                f"evaluate.num_speculative_tokens={k}: a P-EAGLE draft trained with "
                f"train.ttt_length={steps} has {steps - 1} trained mask slots; set "
                f"train.ttt_length to at least {k}"
            ]
        return []

    def new_draft(self, head: TargetNumbers, config: Eagle3Config) -> ParallelEagle3Draft:
        return ParallelEagle3Draft(config, mask_token(head))

    def mask_inputs(self, view: TrainingView) -> tuple[torch.Tensor, torch.Tensor]:
        return own(view.draft, ParallelEagle3Draft).mask_inputs(view.embed)

    def reads(self, config: ConfigJson) -> bool:
        return "pard_token" in config  # vLLM's parallel-drafting mask token

    def save(self, draft: nn.Module, folder: Path, layer_ids: list[int], convention: str) -> Path:
        draft = own(draft, ParallelEagle3Draft)
        folder = save_draft(draft, folder, layer_ids, convention)  # mask_hidden among tensors
        config = json.loads((folder / "config.json").read_text())
        config["pard_token"] = draft.mask_token_id  # vLLM's parallel-drafting mask token
        config["eaglet"]["method"] = self.name
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return folder

    def load(
        self, folder: Path, device: str | torch.device = "cpu"
    ) -> tuple[ParallelEagle3Draft, dict[str, Any]]:
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        draft = ParallelEagle3Draft(config_from_json(config), int(config["pard_token"]))
        draft.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
        return draft.to(device), config

    def fresh_like(self, draft: nn.Module, seed: int) -> ParallelEagle3Draft:
        draft = own(draft, ParallelEagle3Draft)
        torch.manual_seed(seed)
        fresh = ParallelEagle3Draft(Eagle3Config(**draft.config.to_dict()), draft.mask_token_id)
        fresh.set_vocab(draft.d2t, draft.t2d)
        return fresh

    def drafter(self, draft: nn.Module, target: TargetModel, use_cache: bool) -> ParallelDrafter:
        embed = target.get_input_embeddings().weight
        return ParallelDrafter(own(draft, ParallelEagle3Draft), embed, use_cache)

    def speculative_config(self, draft_dir: Path, k: int) -> dict[str, object]:
        return {**super().speculative_config(draft_dir, k), "parallel_drafting": True}

    def exports(self, draft_dir: Path, target: TargetConfig, k: int) -> dict[str, str]:
        return {"vllm": Path(draft_dir).name}  # SGLang and speculators: no parallel drafting


METHOD: DraftMethod = ParallelEagle3Method()  # checked against the seam by the type checker
