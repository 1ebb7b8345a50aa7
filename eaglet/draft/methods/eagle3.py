"""EAGLE-3 (`train.method: eagle3`): one decoder layer over (token embedding, three target layers
fused), trained with training-time test (TTT), drafting a chain of k tokens one step at a time.

The pieces live where they always did, read like a modeling file and a loss: the network
(`eaglet.draft.model`), the TTT unroll and loss (`eaglet.draft.ttt_loss`), its checkpoint and
formats (`eaglet.draft.checkpoint`, `eaglet.draft.export`, `eaglet.draft.init_from`), the
chain drafter (`eaglet.draft.evaluate.Drafter`); this module is what the method registry calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eaglet.draft.checkpoint import config_from_json, load_draft, save_draft
from eaglet.draft.model import Eagle3Config, Eagle3Draft
from eaglet.draft.ttt_loss import counted_positions, target_probs, ttt_loss, ttt_start, ttt_unroll
from eaglet.hidden_states.layers import resolve_aux_layer_ids


def draft_config(head: Any, train: Any, draft_vocab_size: int) -> Eagle3Config:
    c = head.config
    return Eagle3Config(
        hidden_size=c["hidden_size"],
        intermediate_size=train.intermediate_size or c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        vocab_size=c["vocab_size"],
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=c["hidden_size"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"],
        max_position_embeddings=c["max_position_embeddings"],
        norm_before_fc=train.norm_before_fc,
        norm_before_residual=train.norm_before_residual,
        norm_output=train.norm_output,
    )


class Eagle3Method:
    name = "eagle3"
    full_vocab = False

    def layer_ids(self, requested: list[int] | None, num_layers: int, train: Any) -> list[int]:
        return resolve_aux_layer_ids(requested, num_layers)

    def problems(self, config: Any, target: dict[str, Any]) -> list[str]:
        return []  # its layers, vocabulary and init_from are the preflight's own checks

    def new_draft(self, head: Any, config: Eagle3Config) -> Eagle3Draft:
        return Eagle3Draft(config)

    def mask_inputs(self, run: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What training-time test feeds the steps after the first instead of a token and the
        previous output (P-EAGLE's mask slots); None: EAGLE-3's chain."""
        return None

    def build(self, head: Any, train: Any, vocab: Any, layer_ids: list[int]) -> Eagle3Draft:
        """With train.lm_head_init=target its lm_head starts as the target's rows of the
        draft vocab."""
        draft = self.new_draft(head, draft_config(head, train, vocab.size))
        draft.set_vocab(vocab.d2t, vocab.t2d)
        if train.lm_head_init == "target":
            with torch.no_grad():  # [Vd, H]: the target's rows of the draft vocab
                draft.lm_head.weight.copy_(head.lm_head[vocab.ids])
        return draft

    def positions(self, train: Any) -> int:
        return train.ttt_length

    def prepare(self, run: Any, batch: dict[str, torch.Tensor]) -> None:
        pass

    def counted(self, i: int, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return counted_positions(i, batch["in_vocab"], batch["loss_mask"], batch["lengths"])

    def piece_loss(self, run: Any, b: dict, denominators: list[int] | None):
        """`ttt_loss` of one micro-batch `b` (from `load_pieces`): the draft's unroll over it."""
        c = run.config
        probs = target_probs(b["final_hidden_states"], run.draft_lm_head)
        with torch.autocast(
            run.device.type, dtype=run.autocast or torch.bfloat16, enabled=run.autocast is not None
        ):
            aux = b["aux_hidden_states"]  # [B, T, 3H]
            if c.hidden_noise and run.draft.training:  # train.hidden_noise; never when measuring
                aux = aux + c.hidden_noise * torch.randn_like(aux)
            hidden = run.draft.fuse(aux)  # [B, T, H]
            start = ttt_start(b["loss_mask"], c.ttt_length)
            step_logits = ttt_unroll(
                run.draft, run.embed, b["input_ids"], hidden, c.ttt_length, start,
                self.mask_inputs(run),
            )  # fmt: skip
        return ttt_loss(
            step_logits, probs, b["in_vocab"], b["loss_mask"], b["lengths"],
            c.ttt_step_weight, denominators, c.loss, start,
        )  # fmt: skip

    def save(self, draft: Eagle3Draft, folder: Path, layer_ids: list[int], convention: str):
        return save_draft(draft, folder, layer_ids, convention)

    def load(self, folder: Path, device: str | torch.device = "cpu"):
        return load_draft(folder, device)

    def fresh_like(self, draft: Eagle3Draft, seed: int) -> Eagle3Draft:
        torch.manual_seed(seed)
        fresh = Eagle3Draft(Eagle3Config(**draft.config.to_dict()))
        fresh.set_vocab(draft.d2t, draft.t2d)
        return fresh

    def drafter(self, draft: Eagle3Draft, target: Any, use_cache: bool):
        from eaglet.draft.evaluate import Drafter

        return Drafter(draft, target.get_input_embeddings().weight, use_cache)

    def evaluation_k(self, config_json: dict, requested: int) -> int:
        return requested

    def speculative_config(self, draft_dir: Path, k: int) -> dict[str, Any]:
        return {"method": "eagle3", "model": str(Path(draft_dir).resolve()),
                "num_speculative_tokens": k}  # fmt: skip

    def exports(self, draft_dir: Path, target: Any, num_speculative_tokens: int) -> dict[str, str]:
        from eaglet.draft.export import write_exports

        return write_exports(draft_dir, target, num_speculative_tokens)


METHOD = Eagle3Method()
__all__ = ["METHOD", "config_from_json"]
