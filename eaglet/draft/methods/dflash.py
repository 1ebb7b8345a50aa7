"""DFlash (`train.method: dflash`): a block drafter. Each round it drafts K tokens in one forward
pass, the bonus token and K mask tokens attending to each other and to the target's states of
every accepted position (`eaglet.draft.methods.dflash_model`), as vLLM 0.32 serves
`method: dflash`.

Training (the rule vLLM's rounds imply): for an anchor P of a training sequence, the context is
the target's states at positions 0..P, the block is [x_{P+1}, mask x K] at positions
P+1..P+1+K, and mask j predicts x_{P+1+j} against the target's distribution there (its final
states through its lm_head: the same distillation target as EAGLE-3's). Up to
`train.dflash.anchors` anchors per sequence are drawn per step among the positions whose first
draft counts (the token after is model output); each anchor's block sees only its own context
and block. Position j's loss is weighted `train.ttt_step_weight ** j`, and its statistics are
the TTT steps' (`eaglet.draft.ttt_loss`): anchor P's position j counts where EAGLE-3's step j
at index P would.

Layers: `hidden_states.aux_layer_ids` (eaglet's convention, ascending, 1..N-1), by default
EAGLE-3's three, so switching methods reuses the extracted hidden states. vLLM reads them as
`dflash_config.target_layer_ids` in z-lab's convention (the output of layer k = eaglet id k+1),
which the export writes. The vocabulary is the target's whole one (its lm_head, shared).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eaglet.draft.methods.dflash_model import DFlashConfig, DFlashDraft, block_mask
from eaglet.draft.ttt_loss import counted_positions, position_loss, target_probs
from eaglet.storage import atomic_folder

ARCHITECTURE = "DFlashDraftModel"  # vLLM maps it to qwen3_dflash.DFlashQwen3ForCausalLM


class DFlashMethod:
    name = "dflash"
    full_vocab = True
    # TrainConfig fields only EAGLE-3 reads: set away from their defaults, they would do nothing
    foreign_settings = ("ttt_length", "draft_vocab_size", "lm_head_init", "norm_before_fc",
                        "norm_before_residual", "norm_output", "init_from")  # fmt: skip

    # ---------------------------------------------------------------------------- layers

    def layer_ids(self, requested: list[int] | None, num_layers: int, train: Any) -> list[int]:
        from eaglet.hidden_states.layers import default_aux_layer_ids

        ids = list(requested) if requested is not None else default_aux_layer_ids(num_layers)
        if not ids or ids != sorted(set(ids)):
            raise ValueError(
                f"DFlash reads target layers in ascending order, each once (vLLM concatenates "
                f"them so); got aux_layer_ids={ids}"
            )
        if ids[0] < 1 or ids[-1] > num_layers - 1:
            raise ValueError(
                f"DFlash's aux_layer_ids {ids} must lie in 1..{num_layers - 1} (its checkpoint "
                "names the output of layer k, eaglet id k+1; the last layer's is not HF's)"
            )
        return ids

    def problems(self, config: Any, target: dict[str, Any]) -> list[str]:
        found = []
        settings, k = config.train.dflash, config.evaluate.num_speculative_tokens
        if k != settings.block_size - 1:
            found.append(
                f"evaluate.num_speculative_tokens={k}: a DFlash draft with train.dflash."
                f"block_size={settings.block_size} drafts {settings.block_size - 1} tokens a "
                "round, and vLLM serves it at that k: set them to agree"
            )
        mask = settings.mask_token_id
        if mask is not None and not 0 <= mask < target["vocab_size"]:
            found.append(
                f"train.dflash.mask_token_id={mask} is not a token of the target's vocabulary "
                f"(0..{target['vocab_size'] - 1})"
            )
        if config.train.hidden_states == "online":
            from eaglet.hidden_states.backends import hidden_states_backend

            if hidden_states_backend(config.hidden_states.backend).served:
                found.append(
                    "train.method=dflash trains online from a backend in the training process "
                    f"only, not from hidden_states.backend={config.hidden_states.backend}'s "
                    "servers: set hidden_states.backend=hf or train.hidden_states=offline"
                )
        return found

    # ---------------------------------------------------------------------------- training

    def build(self, head: Any, train: Any, vocab: Any, layer_ids: list[int]) -> DFlashDraft:
        c, settings = head.config, train.dflash
        mask = settings.mask_token_id
        if mask is None:  # the pad token (never in a training sequence), else the last id
            pad = c.get("pad_token_id")
            mask = (
                pad if isinstance(pad, int) and 0 <= pad < c["vocab_size"] else c["vocab_size"] - 1
            )
        return DFlashDraft(
            DFlashConfig(
                hidden_size=c["hidden_size"],
                intermediate_size=train.intermediate_size or c["intermediate_size"],
                num_hidden_layers=settings.num_layers,
                num_attention_heads=c["num_attention_heads"],
                num_key_value_heads=c["num_key_value_heads"],
                head_dim=c["head_dim"],
                vocab_size=c["vocab_size"],
                target_hidden_size=c["hidden_size"],
                target_layer_ids=list(layer_ids),
                block_size=settings.block_size,
                mask_token_id=int(mask),
                rms_norm_eps=c["rms_norm_eps"],
                rope_theta=c["rope_theta"],
                max_position_embeddings=c["max_position_embeddings"],
            )
        )

    def positions(self, train: Any) -> int:
        return train.dflash.block_size - 1

    def prepare(self, run: Any, batch: dict[str, torch.Tensor]) -> None:
        """`anchors` bool [B, T]: up to train.dflash.anchors per row, drawn among the
        positions whose first draft counts, the same for the same step and windows."""
        candidates = counted_positions(0, batch["in_vocab"], batch["loss_mask"], batch["lengths"])
        seed = hash((run.config.seed, run.step, tuple(batch["windows"].tolist()))) % 2**63
        generator = torch.Generator().manual_seed(seed)
        anchors = torch.zeros_like(candidates)
        for row in range(candidates.shape[0]):
            found = candidates[row].nonzero().squeeze(-1).cpu()  # [n]
            pick = torch.randperm(len(found), generator=generator)[: run.config.dflash.anchors]
            anchors[row, found[pick].to(anchors.device)] = True
        batch["anchors"] = anchors

    def counted(self, i: int, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        counted = counted_positions(i, batch["in_vocab"], batch["loss_mask"], batch["lengths"])
        return counted & batch["anchors"]

    def piece_loss(self, run: Any, b: dict, denominators: list[int] | None):
        c, draft = run.config, run.draft
        K = self.positions(c)
        probs = target_probs(b["final_hidden_states"], run.draft_lm_head)  # [B, T, V]
        sums = [None] * K
        hits, counts = [0] * K, [0] * K
        with torch.autocast(
            run.device.type, dtype=run.autocast or torch.bfloat16, enabled=run.autocast is not None
        ):
            counted = [self.counted(i, b) for i in range(K)]  # bool [B, T] each
            for row in range(b["input_ids"].shape[0]):
                anchors = b["anchors"][row].nonzero().squeeze(-1)  # [A]
                if not len(anchors):
                    continue
                logits = self._block_logits(run, b, row, anchors)  # [A, K, V]
                for i in range(K):
                    keep = counted[i][row, anchors]  # [A]
                    if not bool(keep.any()):
                        continue
                    log_q = logits[keep, i].float().log_softmax(-1)  # [N, V]
                    p = probs[row, anchors[keep] + 1 + i]  # [N, V]
                    part = position_loss(p, log_q, c.loss)
                    sums[i] = part if sums[i] is None else sums[i] + part
                    hits[i] += int((log_q.argmax(-1) == p.argmax(-1)).sum())
                    counts[i] += int(keep.sum())
        total = probs.new_zeros((), dtype=torch.float32)
        stats: dict[str, list[float]] = {
            "loss": [],
            "acc": [],
            "count": [],
            "loss_sum": [],
            "hits": [],
        }
        for i in range(K):
            step_sum = sums[i] if sums[i] is not None else total.new_zeros(())
            denominator = max(counts[i] if denominators is None else denominators[i], 1)
            total = total + c.ttt_step_weight**i * step_sum / denominator
            stats["loss"].append(float(step_sum.detach()) / max(counts[i], 1))
            stats["acc"].append(hits[i] / max(counts[i], 1))
            stats["count"].append(counts[i])
            stats["loss_sum"].append(float(step_sum.detach()))
            stats["hits"].append(hits[i])
        if not any(counts):  # keep the graph: a piece with nothing counted adds zero
            total = total + 0.0 * sum(p.sum() for p in draft.parameters())
        return total, stats

    def _block_logits(self, run: Any, b: dict, row: int, anchors: torch.Tensor) -> torch.Tensor:
        """The draft's logits [A, K, V] of the masks of every anchor's block in one row."""
        draft, c = run.draft, run.config
        K, M = self.positions(c), draft.config.mask_token_id
        n = int(b["lengths"][row])
        aux = b["aux_hidden_states"][row : row + 1, :n]  # [1, n, k * H]
        if c.hidden_noise and draft.training:
            aux = aux + c.hidden_noise * torch.randn_like(aux)
        context = draft.context(aux)  # [1, n, H]
        ids = b["input_ids"][row]
        block = torch.full((len(anchors), K + 1), M, dtype=ids.dtype, device=ids.device)
        block[:, 0] = ids[anchors + 1]  # the token after the anchor, known; then K masks
        offsets = torch.arange(1, K + 2, device=ids.device)
        positions = (anchors[:, None] + offsets).reshape(1, -1)  # [1, A * (K + 1)]
        mask = block_mask(anchors, n, K + 1)[None, None]  # [1, 1, A(K+1), n + A(K+1)]
        context_positions = torch.arange(n, device=ids.device)[None]
        embeds = F.embedding(block.reshape(1, -1), run.embed)
        hidden = draft(embeds, positions, context, context_positions, mask)  # [1, A(K+1), H]
        masks = hidden.view(len(anchors), K + 1, -1)[:, 1:]  # [A, K, H]
        return masks @ run.draft_lm_head.T.to(masks.dtype)  # [A, K, V]

    # ---------------------------------------------------------------------------- files

    def save(self, draft: DFlashDraft, folder: Path, layer_ids: list[int], convention: str):
        c = draft.config
        config = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps,
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_theta": c.rope_theta,
            "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
            "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            # z-lab's convention: the output of layer k, eaglet's id k + 1
            "dflash_config": {
                "target_layer_ids": [int(i) - 1 for i in c.target_layer_ids],
                "mask_token_id": c.mask_token_id,
                "block_size": c.block_size,
            },
            "eaglet": {
                "method": self.name,
                "target_layer_ids": [int(i) for i in c.target_layer_ids],
                "aux_layer_convention": convention,
            },
        }
        with atomic_folder(Path(folder)) as tmp:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            tensors = {k: v.float() for k, v in draft.checkpoint_tensors().items()}
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        return Path(folder)

    def load(self, folder: Path, device: str | torch.device = "cpu") -> tuple[DFlashDraft, dict]:
        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text())
        dflash = raw["dflash_config"]
        ids = raw.get("eaglet", {}).get("target_layer_ids")
        if ids is None:  # a peer's checkpoint: z-lab's convention
            ids = [int(i) + 1 for i in dflash["target_layer_ids"]]
        rope = raw.get("rope_parameters") or {}
        config = DFlashConfig(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            vocab_size=raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size", raw["hidden_size"]),
            target_layer_ids=ids,
            block_size=int(dflash.get("block_size") or 16),
            mask_token_id=int(dflash.get("mask_token_id", raw.get("mask_token_id"))),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta") or raw.get("rope_theta") or 10000.0),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
        )
        draft = DFlashDraft(config)
        draft.load_checkpoint_tensors(load_file(str(folder / "model.safetensors")))
        return draft.to(device), raw

    def fresh_like(self, draft: DFlashDraft, seed: int) -> DFlashDraft:
        torch.manual_seed(seed)
        return DFlashDraft(DFlashConfig(**draft.config.to_dict()))

    # ---------------------------------------------------------------------------- rounds

    def drafter(self, draft: DFlashDraft, target: Any, use_cache: bool) -> BlockDrafter:
        return BlockDrafter(
            draft, target.get_input_embeddings().weight, target.get_output_embeddings().weight
        )

    def evaluation_k(self, config_json: dict, requested: int) -> int:
        return int(config_json["dflash_config"].get("block_size") or requested + 1) - 1

    def speculative_config(self, draft_dir: Path, k: int) -> dict[str, Any]:
        return {"method": "dflash", "model": str(Path(draft_dir).resolve()),
                "num_speculative_tokens": k}  # fmt: skip

    def exports(self, draft_dir: Path, target: Any, num_speculative_tokens: int) -> dict[str, str]:
        return {"vllm": Path(draft_dir).name}  # vLLM's qwen3_dflash layout is the draft's own


class BlockDrafter:
    """One round as vLLM runs it for DFlash: the context is every accepted position's target
    states (their keys and values are final once accepted, so each round could keep them; the
    round computes them again, which only costs time), the block is the target's token after
    them and k masks, one forward, each mask's argmax."""

    def __init__(self, draft: DFlashDraft, embed: torch.Tensor, lm_head: torch.Tensor):
        self.draft, self.embed, self.lm_head = draft, embed, lm_head

    @torch.no_grad()
    def propose(self, ids: list[int], aux: torch.Tensor, next_token: int, k: int) -> list[int]:
        draft, L, device = self.draft, len(ids), aux.device
        context = draft.context(aux[None, :L])  # [1, L, H]
        block = torch.tensor([[next_token] + [draft.config.mask_token_id] * k], device=device)
        positions = torch.arange(L, L + k + 1, device=device)[None]  # [1, k + 1]
        hidden = draft(
            F.embedding(block, self.embed), positions, context, torch.arange(L, device=device)[None]
        )  # [1, k + 1, H]: nothing masked
        logits = hidden[0, 1:] @ self.lm_head.T  # [k, V]
        return [int(t) for t in logits.argmax(-1)]


METHOD = DFlashMethod()
