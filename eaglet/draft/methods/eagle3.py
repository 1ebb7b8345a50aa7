"""EAGLE-3 (`train.method: eagle3`, the default): one decoder layer over (token embedding, three
target layers fused), trained with training-time test (TTT), drafting a chain of k tokens one
step at a time.

Its pieces, each a module of this package read like a modeling file and a loss: the network
(`eagle3_model`), the TTT unroll and loss (`eagle3_ttt`), its checkpoint (`eagle3_checkpoint`)
and the exports for SGLang and speculators (`eagle3_exports`); this module is the method the
registry names, and its chain drafter: the rounds vLLM runs for `method: eagle3`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.draft.methods.base import (
    Batch,
    ConfigJson,
    DraftMethod,
    ExportConvention,
    TargetModel,
    TrainingView,
    own,
)
from eaglet.draft.methods.eagle3_checkpoint import aux_layer_ids, load_draft, save_draft
from eaglet.draft.methods.eagle3_model import Eagle3Config, Eagle3Draft, KVCache, ttt_attention_mask
from eaglet.draft.methods.eagle3_ttt import ttt_loss, ttt_start, ttt_unroll
from eaglet.draft.methods.loss import PositionStats, counted_positions, target_probs
from eaglet.hidden_states.layers import resolve_aux_layer_ids

if TYPE_CHECKING:
    from eaglet.config.pipeline import PipelineConfig
    from eaglet.config.target import TargetConfig
    from eaglet.config.train import TrainConfig
    from eaglet.draft.target_head import TargetHead, TargetNumbers
    from eaglet.draft.vocab import DraftVocab


def draft_config(head: TargetNumbers, train: TrainConfig, draft_vocab_size: int) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=head["hidden_size"],
        intermediate_size=train.intermediate_size or head["intermediate_size"],
        num_attention_heads=head["num_attention_heads"],
        num_key_value_heads=head["num_key_value_heads"],
        head_dim=head["head_dim"],
        vocab_size=head["vocab_size"],
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=head["hidden_size"],
        rms_norm_eps=head["rms_norm_eps"],
        rope_theta=head["rope_theta"],
        max_position_embeddings=head["max_position_embeddings"],
        norm_before_fc=train.norm_before_fc,
        norm_before_residual=train.norm_before_residual,
        norm_output=train.norm_output,
    )


class ChainDrafter:
    """Chain proposals of one draft along one sequence, as vLLM runs `method: eagle3`. With
    `use_cache` the step-0 keys and values of positions already seen are kept, so a round
    computes step 0 only for the new positions (their input tokens and aux features are final
    once the target accepted them)."""

    def __init__(self, draft: Eagle3Draft, embed: torch.Tensor, use_cache: bool):
        self.draft, self.embed, self.use_cache = draft, embed, use_cache
        self.step0: tuple[torch.Tensor, torch.Tensor] | None = None  # [1, kv, done, D] each
        self.done = 0  # positions whose step-0 keys are in self.step0

    @torch.no_grad()
    def first_step(
        self, ids: list[int], aux: torch.Tensor, next_token: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Step 0 over the positions not seen yet: the last index's output [1, 1, H] (it drafts
        the first token) and every step-0 key and value so far ([1, kv, L, D] each)."""
        draft, device, L = self.draft, aux.device, len(ids)
        start = self.done if self.use_cache else 0
        past: KVCache = [self.step0] if start and self.step0 is not None else []
        inputs = torch.tensor([ids[start + 1 :] + [next_token]], device=device)  # x_{t+1}
        positions = torch.arange(start, L, device=device)[None]  # [1, L - start]
        new = L - start
        seen = torch.ones(new, start, dtype=torch.bool, device=device)
        # new queries see every earlier step-0 key and, causally, each other
        mask = torch.cat([seen, ttt_attention_mask(new, 0, device)], dim=-1)
        fused = draft.fuse(aux[None, start:L])
        hidden, cache = draft(F.embedding(inputs, self.embed), fused, positions, past, mask)
        step0 = (torch.cat([kv[0] for kv in cache], 2), torch.cat([kv[1] for kv in cache], 2))
        if self.use_cache:
            self.step0, self.done = step0, L
        return hidden[:, -1:], step0

    @torch.no_grad()
    def propose(self, ids: list[int], aux: torch.Tensor, next_token: int, k: int) -> list[int]:
        """k drafted target token ids following x_L; `ids` = x_0..x_{L-1}, `aux` [L, 3H]."""
        draft, device, L = self.draft, aux.device, len(ids)
        hidden, step0 = self.first_step(ids, aux, next_token)  # only the last index drafts
        cache = [step0]
        tokens: list[int] = []
        for i in range(1, k + 1):
            draft_id = draft.compute_logits(hidden)[0, -1].argmax()
            tokens.append(int(draft.to_target_ids(draft_id)))
            if i == k:
                break
            token = torch.tensor([[tokens[-1]]], device=device)  # [1, 1]
            position = torch.tensor([[L - 1 + i]], device=device)  # step i sits at t + i
            # the last index sees every step-0 key and its own keys of steps 1..i: nothing masked
            hidden, cache = draft(F.embedding(token, self.embed), hidden, position, cache, None)
        return tokens


def propose(
    draft: Eagle3Draft,
    embed: torch.Tensor,  # [V, H]
    ids: list[int],  # x_0..x_{L-1}
    aux: torch.Tensor,  # [L, 3H]
    next_token: int,  # x_L, the target's greedy token
    k: int,
) -> list[int]:
    """k drafted target token ids following x_L (no cache: step 0 over the whole sequence)."""
    return ChainDrafter(draft, embed, use_cache=False).propose(ids, aux, next_token, k)


class Eagle3Method:
    name = "eagle3"
    full_vocab = False
    foreign_settings: tuple[str, ...] = ()

    def layer_ids(self, requested: list[int] | None, num_layers: int) -> list[int]:
        return resolve_aux_layer_ids(requested, num_layers)

    def problems(self, config: PipelineConfig, target: TargetNumbers) -> list[str]:
        return []  # its layers, vocabulary and init_from are the preflight's own checks

    def new_draft(self, head: TargetNumbers, config: Eagle3Config) -> Eagle3Draft:
        return Eagle3Draft(config)

    def mask_inputs(self, view: TrainingView) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What training-time test feeds the steps after the first instead of a token and the
        previous output (P-EAGLE's mask slots); None: EAGLE-3's chain."""
        return None

    def build(
        self, head: TargetHead, train: TrainConfig, vocab: DraftVocab, layer_ids: list[int]
    ) -> Eagle3Draft:
        """With train.lm_head_init=target its lm_head starts as the target's rows of the
        draft vocab."""
        draft = self.new_draft(head.config, draft_config(head.config, train, vocab.size))
        draft.set_vocab(vocab.d2t, vocab.t2d)
        if train.lm_head_init == "target":
            with torch.no_grad():  # [Vd, H]: the target's rows of the draft vocab
                draft.lm_head.weight.copy_(head.lm_head[vocab.ids])
        return draft

    def positions(self, train: TrainConfig) -> int:
        return train.ttt_length

    def prepare(self, view: TrainingView, step: int, batch: Batch) -> None:
        pass

    def counted(self, i: int, batch: Batch) -> torch.Tensor:
        return counted_positions(i, batch["in_vocab"], batch["loss_mask"], batch["lengths"])

    def piece_loss(
        self, view: TrainingView, b: Batch, denominators: list[int] | None
    ) -> tuple[torch.Tensor, PositionStats]:
        """`ttt_loss` of one micro-batch `b` (from `load_pieces`): the draft's unroll over it."""
        c, draft = view.settings, own(view.draft, Eagle3Draft)
        probs = target_probs(b["final_hidden_states"], view.draft_lm_head)
        with view.autocasting():
            aux = b["aux_hidden_states"]  # [B, T, 3H]
            if c.hidden_noise and draft.training:  # train.hidden_noise; never when measuring
                aux = aux + c.hidden_noise * torch.randn_like(aux)
            hidden = draft.fuse(aux)  # [B, T, H]
            start = ttt_start(b["loss_mask"], c.ttt_length)
            step_logits = ttt_unroll(
                draft, view.embed, b["input_ids"], hidden, c.ttt_length, start,
                self.mask_inputs(view),
            )  # fmt: skip
        return ttt_loss(
            step_logits, probs, b["in_vocab"], b["loss_mask"], b["lengths"],
            c.ttt_step_weight, denominators, c.loss, start,
        )  # fmt: skip

    def reads(self, config: ConfigJson) -> bool:
        return False  # the default: every draft no other method reads is an EAGLE-3 format

    def save(self, draft: nn.Module, folder: Path, layer_ids: list[int], convention: str) -> Path:
        return save_draft(own(draft, Eagle3Draft), folder, layer_ids, convention)

    def load(
        self, folder: Path, device: str | torch.device = "cpu"
    ) -> tuple[Eagle3Draft, dict[str, Any]]:
        return load_draft(folder, device)

    def draft_layer_ids(self, config: ConfigJson, where: Path | str) -> list[int]:
        return aux_layer_ids(config, where)

    def fresh_like(self, draft: nn.Module, seed: int) -> Eagle3Draft:
        draft = own(draft, Eagle3Draft)
        torch.manual_seed(seed)
        fresh = Eagle3Draft(Eagle3Config(**draft.config.to_dict()))
        fresh.set_vocab(draft.d2t, draft.t2d)
        return fresh

    def drafter(self, draft: nn.Module, target: TargetModel, use_cache: bool) -> ChainDrafter:
        embed = target.get_input_embeddings().weight
        return ChainDrafter(own(draft, Eagle3Draft), embed, use_cache)

    def evaluation_k(self, config: ConfigJson, requested: int) -> int:
        return requested

    def speculative_config(self, draft_dir: Path, k: int) -> dict[str, object]:
        return {"method": "eagle3", "model": str(Path(draft_dir).resolve()),
                "num_speculative_tokens": k}  # fmt: skip

    def exports(self, draft_dir: Path, target: TargetConfig, k: int) -> dict[str, str]:
        from eaglet.draft.methods.eagle3_exports import write_exports

        return write_exports(draft_dir, target, k)

    def export_convention(self, export: str) -> ExportConvention:
        from eaglet.draft.methods.eagle3_exports import export_convention

        return export_convention(export)

    def export_problems(
        self, folder: Path, config: ConfigJson, target_vocab: int, k: int
    ) -> list[tuple[str, str]]:
        """The vocabulary maps; a chain drafts any k (no block to hold it)."""
        from eaglet.draft.methods.eagle3_exports import vocab_problems

        return vocab_problems(folder, config, target_vocab)


METHOD: DraftMethod = Eagle3Method()  # checked against the seam by the type checker
__all__ = ["METHOD", "ChainDrafter", "propose"]
