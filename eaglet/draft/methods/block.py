"""What the block drafters (DFlash, DSpark) share: training on anchored blocks, the round vLLM
runs for them, their layers, checks and the Qwen3 layout of their checkpoints. Each method's
module says what differs: its settings section, its network, its config.json.

A round (vLLM 0.32): the context is the target's states at every accepted position up to P,
the block is [x_{P+1}, mask x (block_size - 1)] at positions P+1..P+block_size, one forward;
draft j (1..K) is read at slot j - 1 + `first_slot` (DFlash: the masks, each predicting the
token at its own position; DSpark: every slot, each predicting the token after it). A draft
whose `logits_bias` is set (DSpark's Markov head) adds to draft j's logits a bias of the token
before it and is drafted left to right: that token is the bonus for j = 1, else draft j - 1.

Training (the rule those rounds imply): for an anchor P of a training sequence, the context is
the target's states at 0..P and the block as above; position i = j - 1 predicts x_{P+2+i}
against the target's distribution there (its final states through its lm_head: the same
distillation target as EAGLE-3's), its bias from the true x_{P+1+i}. Up to `anchors` anchors per
sequence are drawn per step among the positions whose first draft counts; each anchor's block
sees only its own context and block. Position i's loss is weighted `train.ttt_step_weight ** i`
and counts where EAGLE-3's step i at index P would (`eaglet.draft.methods.loss`).

Layers: `hidden_states.aux_layer_ids` (eaglet's convention, ascending, 1..N-1), by default
EAGLE-3's three, so switching methods reuses the extracted hidden states; the checkpoints name
them in z-lab's convention (the output of layer k = eaglet id k+1). The vocabulary is the
target's whole one (its lm_head, shared).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.draft.checkpoint import save_tensors
from eaglet.draft.methods.base import (
    Batch,
    ConfigJson,
    ExportConvention,
    TargetModel,
    TrainingView,
    mask_token,
    own,
)
from eaglet.draft.methods.dflash_model import DFlashConfig, DFlashDraft, block_mask
from eaglet.draft.methods.loss import PositionStats, counted_positions, position_loss, target_probs
from eaglet.draft.methods.speculators import speculators_section, verifier_name, write_same_weights
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION, default_aux_layer_ids
from eaglet.storage import atomic_folder

if TYPE_CHECKING:
    from eaglet.config.pipeline import PipelineConfig
    from eaglet.config.target import TargetConfig
    from eaglet.config.train import TrainConfig
    from eaglet.draft.methods.settings import BlockSettings
    from eaglet.draft.target_head import TargetHead, TargetNumbers
    from eaglet.draft.vocab import DraftVocab


class BlockMethod:
    """A block drafter's method; subclasses give its name, settings section and files."""

    name = "block"
    label = "block"  # how messages name it
    full_vocab = True
    # TrainConfig fields only EAGLE-3 reads: set away from their defaults, they would do nothing
    foreign_settings: tuple[str, ...] = (
        "ttt_length", "draft_vocab_size", "lm_head_init", "norm_before_fc",
        "norm_before_residual", "norm_output", "init_from",
    )  # fmt: skip

    speculators_folder = "draft-speculators-block"  # the method's name in it: vLLM's method
    # what the engine check holds each export to (`export_convention`): the vLLM export's
    # architecture, the class vLLM 0.32's registry must route it to, where its layer ids are
    architecture = "?"
    speculators_architecture = "?"
    vllm_class = "?"
    layer_ids_key = "?"  # in z-lab's convention: eaglet's id - 1

    def settings(self, train: TrainConfig) -> BlockSettings:
        raise NotImplementedError

    def new_draft(self, fields: dict[str, Any], settings: BlockSettings) -> DFlashDraft:
        """The method's draft from the fields every block config has (`DFlashConfig`'s)."""
        raise NotImplementedError

    def layout(self, config: DFlashConfig) -> dict[str, object]:
        """The method's own keys of its vLLM config.json (architecture, block, layers, mask)."""
        raise NotImplementedError

    def speculators_layout(self, config: DFlashConfig) -> dict[str, object]:
        """The method's own keys of its speculators config.json."""
        raise NotImplementedError

    def load(
        self, folder: Path, device: str | torch.device = "cpu"
    ) -> tuple[DFlashDraft, dict[str, Any]]:
        """The draft and config.json of the method's folder (either layout)."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------- layers

    def layer_ids(self, requested: list[int] | None, num_layers: int) -> list[int]:
        ids = list(requested) if requested is not None else default_aux_layer_ids(num_layers)
        if not ids or ids != sorted(set(ids)):
            raise ValueError(
                f"{self.label} reads target layers in ascending order, each once (vLLM "
                f"concatenates them so); got aux_layer_ids={ids}"
            )
        if ids[0] < 1 or ids[-1] > num_layers - 1:
            raise ValueError(
                f"{self.label}'s aux_layer_ids {ids} must lie in 1..{num_layers - 1} (its "
                "checkpoint names the output of layer k, eaglet id k+1; the last layer's is "
                "not HF's)"
            )
        return ids

    def problems(self, config: PipelineConfig, target: TargetNumbers) -> list[str]:
        found = []
        settings, k = self.settings(config.train), config.evaluate.num_speculative_tokens
        if k != settings.drafts:
            found.append(
                f"evaluate.num_speculative_tokens={k}: a {self.label} draft with train."
                f"{self.name}.block_size={settings.block_size} drafts {settings.drafts} tokens "
                "a round, and vLLM serves it at that k: set them to agree"
            )
        mask = settings.mask_token_id
        if mask is not None and not 0 <= mask < target["vocab_size"]:
            found.append(
                f"train.{self.name}.mask_token_id={mask} is not a token of the target's "
                f"vocabulary (0..{target['vocab_size'] - 1})"
            )
        if config.train.hidden_states == "online":
            from eaglet.hidden_states.backends import hidden_states_backend

            if hidden_states_backend(config.hidden_states.backend).served:
                found.append(
                    f"train.method={self.name} trains online from a backend in the training "
                    f"process only, not from hidden_states.backend="
                    f"{config.hidden_states.backend}'s servers: set hidden_states.backend=hf "
                    "or train.hidden_states=offline"
                )
        return found

    # ---------------------------------------------------------------------------- training

    def build(
        self, head: TargetHead, train: TrainConfig, vocab: DraftVocab, layer_ids: list[int]
    ) -> DFlashDraft:
        c, settings = head.config, self.settings(train)
        fields = dict(
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
            mask_token_id=mask_token(c, settings.mask_token_id),
            rms_norm_eps=c["rms_norm_eps"],
            rope_theta=c["rope_theta"],
            max_position_embeddings=c["max_position_embeddings"],
        )
        return self.new_draft(fields, settings)

    def positions(self, train: TrainConfig) -> int:
        return self.settings(train).drafts

    def prepare(self, view: TrainingView, step: int, batch: Batch) -> None:
        """`anchors` bool [B, T]: up to `anchors` per row, drawn among the positions whose
        first draft counts, the same for the same step and windows."""
        candidates = counted_positions(0, batch["in_vocab"], batch["loss_mask"], batch["lengths"])
        seed = hash((view.settings.seed, step, tuple(batch["windows"].tolist()))) % 2**63
        generator = torch.Generator().manual_seed(seed)
        per_row = self.settings(view.settings).anchors
        anchors = torch.zeros_like(candidates)
        for row in range(candidates.shape[0]):
            found = candidates[row].nonzero().squeeze(-1).cpu()  # [n]
            pick = torch.randperm(len(found), generator=generator)[:per_row]
            anchors[row, found[pick].to(anchors.device)] = True
        batch["anchors"] = anchors

    def counted(self, i: int, batch: Batch) -> torch.Tensor:
        counted = counted_positions(i, batch["in_vocab"], batch["loss_mask"], batch["lengths"])
        return counted & batch["anchors"]

    def piece_loss(
        self, view: TrainingView, b: Batch, denominators: list[int] | None
    ) -> tuple[torch.Tensor, PositionStats]:
        c, draft = view.settings, own(view.draft, DFlashDraft)
        K = draft.config.drafts
        probs = target_probs(b["final_hidden_states"], view.draft_lm_head)  # [B, T, V]
        sums: list[torch.Tensor | None] = [None] * K
        hits, counts = [0] * K, [0] * K
        with view.autocasting():
            counted = [self.counted(i, b) for i in range(K)]  # bool [B, T] each
            for row in range(b["input_ids"].shape[0]):
                anchors = b["anchors"][row].nonzero().squeeze(-1)  # [A]
                if not len(anchors):
                    continue
                logits = block_logits(view, draft, b, row, anchors)  # [A, K, V]
                for i in range(K):
                    keep = counted[i][row, anchors]  # [A]
                    if not bool(keep.any()):
                        continue
                    log_q = logits[keep, i].float().log_softmax(-1)  # [N, V]
                    p = probs[row, anchors[keep] + 1 + i]  # [N, V]
                    part = position_loss(p, log_q, c.loss)
                    previous = sums[i]
                    sums[i] = part if previous is None else previous + part
                    hits[i] += int((log_q.argmax(-1) == p.argmax(-1)).sum())
                    counts[i] += int(keep.sum())
        total = probs.new_zeros((), dtype=torch.float32)
        stats = PositionStats()
        for i in range(K):
            step_sum = sums[i]
            if step_sum is None:
                step_sum = total.new_zeros(())
            denominator = max(counts[i] if denominators is None else denominators[i], 1)
            total = total + c.ttt_step_weight**i * step_sum / denominator
            stats.add(step_sum, hits[i], counts[i])
        if not any(counts):  # keep the graph: a piece with nothing counted adds zero
            total = total + 0.0 * sum(p.sum() for p in draft.parameters())
        return total, stats

    # ---------------------------------------------------------------------------- files

    def save(self, draft: nn.Module, folder: Path, layer_ids: list[int], convention: str) -> Path:
        """vLLM's layout: the Qwen3 layer keys, the method's own (`layout`), eaglet's label;
        the tensors by vLLM's names, float32, without the target's embedding and lm_head."""
        draft = own(draft, DFlashDraft)
        c = draft.config
        config = {
            **qwen3_layer_config(c),
            "target_hidden_size": c.target_hidden_size,
            "torch_dtype": "float32",
            **self.layout(c),
            "eaglet": {
                "method": self.name,
                "target_layer_ids": [int(i) for i in c.target_layer_ids],
                "aux_layer_convention": convention,
            },
        }
        with atomic_folder(Path(folder)) as tmp:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            tensors = {k: v.float() for k, v in draft.checkpoint_tensors().items()}
            save_tensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        return Path(folder)

    def exports(self, draft_dir: Path, target: TargetConfig, k: int) -> dict[str, str]:
        """vLLM's layout is the draft's own; speculators' beside it (the same tensors, eaglet's
        layer ids as `aux_hidden_state_layer_ids`, no eaglet label: a peer's file)."""
        from eaglet.target import load_config

        draft_dir = Path(draft_dir)
        c = own(self.load(draft_dir)[0], DFlashDraft).config
        architectures = list(getattr(load_config(target), "architectures", None) or [])
        spec = {
            "speculators_model_type": self.name,
            "transformer_layer_config": qwen3_layer_config(c),
            "draft_vocab_size": c.vocab_size,
            "block_size": c.block_size,
            "target_hidden_size": c.target_hidden_size,
            "aux_hidden_state_layer_ids": [int(i) for i in c.target_layer_ids],
            "mask_token_id": c.mask_token_id,
            # bidirectional within the block: vLLM makes every layer causal when this is false
            "sliding_window_non_causal": True,
            "torch_dtype": "float32",
            **self.speculators_layout(c),
            "speculators_config": speculators_section(
                self.name,
                c.drafts,
                verifier_name(target, draft_dir.with_name(self.speculators_folder)),
                architectures,
            ),  # fmt: skip
        }
        write_same_weights(draft_dir, draft_dir.with_name(self.speculators_folder), spec)
        return {"vllm": draft_dir.name, "speculators": self.speculators_folder}

    def evaluation_k(self, config: ConfigJson, requested: int) -> int:
        raise NotImplementedError(f"{type(self).__name__}: the drafts its block holds")

    def export_convention(self, export: str) -> ExportConvention:
        if export == "speculators":  # speculators' layout names HF hidden_states indices
            return ExportConvention(
                "vllm", self.speculators_architecture, self.vllm_class,
                "aux_hidden_state_layer_ids", 0, AUX_LAYER_CONVENTION,
            )  # fmt: skip
        return ExportConvention(
            "vllm", self.architecture, self.vllm_class, self.layer_ids_key, -1,
            "z-lab: id k = the output of decoder layer k = HF hidden_states[k+1]",
        )  # fmt: skip

    def export_problems(
        self, folder: Path, config: ConfigJson, target_vocab: int, k: int
    ) -> list[tuple[str, str]]:
        """The block against k (a round drafts `evaluation_k` of a block: the export's own k
        and the one it is served at must be that), the full vocabulary and the mask token."""
        raw: dict[str, Any] = dict(config)
        where = Path(folder) / "config.json"
        problems = []
        block = (raw.get("dflash_config") or {}).get("block_size") or raw.get("block_size")
        served = self.evaluation_k(raw, k)
        if block is None:
            problems.append(("block size", f"{where}: no block_size"))
        elif served != k:
            problems.append((
                "block size",
                f"{where}: block_size {block} drafts k = {served} per round, the run's k is {k}",
            ))  # fmt: skip
        proposals = (raw.get("speculators_config") or {}).get("proposal_methods") or []
        for proposal in proposals:
            if proposal.get("speculative_tokens") != served:
                problems.append((
                    "block size",
                    f"{where}: speculators_config speculative_tokens "
                    f"{proposal.get('speculative_tokens')}, block_size {block} drafts {served}",
                ))  # fmt: skip
        numbers = layer_numbers(raw)
        if numbers["vocab_size"] != target_vocab:
            problems.append((
                "vocabulary",
                f"{where}: vocab_size {numbers['vocab_size']}, the target's {target_vocab}",
            ))  # fmt: skip
        mask = (raw.get("dflash_config") or {}).get("mask_token_id", raw.get("mask_token_id"))
        if mask is None or not 0 <= int(mask) < target_vocab:
            problems.append(
                ("vocabulary", f"{where}: mask_token_id {mask} outside 0..{target_vocab - 1}")
            )
        return problems

    def fresh_like(self, draft: nn.Module, seed: int) -> DFlashDraft:
        draft = own(draft, DFlashDraft)
        torch.manual_seed(seed)
        return type(draft)(type(draft.config)(**draft.config.to_dict()))

    def draft_layer_ids(self, config: ConfigJson, where: Path | str) -> list[int]:
        raw: dict[str, Any] = dict(config)
        ids = (raw.get("eaglet") or {}).get("target_layer_ids")
        return [int(i) for i in ids] if ids else [int(i) + 1 for i in peer_layer_ids(raw)]

    # ---------------------------------------------------------------------------- rounds

    def drafter(self, draft: nn.Module, target: TargetModel, use_cache: bool) -> BlockDrafter:
        return BlockDrafter(
            own(draft, DFlashDraft),
            target.get_input_embeddings().weight,
            target.get_output_embeddings().weight,
        )

    def speculative_config(self, draft_dir: Path, k: int) -> dict[str, object]:
        return {"method": self.name, "model": str(Path(draft_dir).resolve()),
                "num_speculative_tokens": k}  # fmt: skip


def block_logits(
    view: TrainingView, draft: DFlashDraft, b: Batch, row: int, anchors: torch.Tensor
) -> torch.Tensor:
    """The draft's logits [A, K, V] of the drafts of every anchor's block in one row."""
    c, cfg = view.settings, draft.config
    size, first, K = cfg.block_size, cfg.first_slot, cfg.drafts
    n = int(b["lengths"][row])
    aux = b["aux_hidden_states"][row : row + 1, :n]  # [1, n, k * H]
    if c.hidden_noise and draft.training:
        aux = aux + c.hidden_noise * torch.randn_like(aux)
    context = draft.context(aux)  # [1, n, H]
    ids = b["input_ids"][row]
    block = torch.full((len(anchors), size), cfg.mask_token_id, dtype=ids.dtype, device=ids.device)
    block[:, 0] = ids[anchors + 1]  # the token after the anchor, known; then the masks
    offsets = torch.arange(1, size + 1, device=ids.device)
    positions = (anchors[:, None] + offsets).reshape(1, -1)  # [1, A * size]
    mask = block_mask(anchors, n, size)[None, None]  # [1, 1, A * size, n + A * size]
    context_positions = torch.arange(n, device=ids.device)[None]
    embeds = F.embedding(block.reshape(1, -1), view.embed)
    hidden = draft(embeds, positions, context, context_positions, mask)  # [1, A * size, H]
    slots = hidden.view(len(anchors), size, -1)[:, first : first + K]  # [A, K, H]
    logits = slots @ view.draft_lm_head.T.to(slots.dtype)  # [A, K, V]
    # the token before each draft, as the target wrote it: x_{P+1+i} (past the end: unused)
    before = (anchors[:, None] + 1 + torch.arange(K, device=ids.device)).clamp(max=len(ids) - 1)
    bias = draft.logits_bias(ids[before])  # [A, K, V] or None
    return logits if bias is None else logits + bias.to(logits.dtype)


class BlockDrafter:
    """One round as vLLM runs it for a block drafter: the context is every accepted position's
    target states (their keys and values are final once accepted, so each round could keep
    them; the round computes them again, which only costs time), the block is the target's
    token after them and the masks, one forward; each draft's argmax, left to right after the
    previous token's bias where the draft has one (DSpark)."""

    def __init__(self, draft: DFlashDraft, embed: torch.Tensor, lm_head: torch.Tensor):
        self.draft, self.embed, self.lm_head = draft, embed, lm_head

    @torch.no_grad()
    def propose(self, ids: list[int], aux: torch.Tensor, next_token: int, k: int) -> list[int]:
        draft, L, device = self.draft, len(ids), aux.device
        first, mask = draft.config.first_slot, draft.config.mask_token_id
        context = draft.context(aux[None, :L])  # [1, L, H]
        size = first + k  # the bonus token and the masks
        block = torch.tensor([[next_token] + [mask] * (size - 1)], device=device)
        positions = torch.arange(L, L + size, device=device)[None]  # [1, size]
        hidden = draft(
            F.embedding(block, self.embed), positions, context, torch.arange(L, device=device)[None]
        )  # [1, size, H]: nothing masked
        logits = hidden[0, first : first + k] @ self.lm_head.T  # [k, V]
        if draft.logits_bias(torch.tensor([next_token], device=device)) is None:
            return [int(t) for t in logits.argmax(-1)]
        drafts, previous = [], next_token
        for i in range(k):  # left to right: each draft's bias is of the token before it
            bias = draft.logits_bias(torch.tensor([previous], device=device))
            assert bias is not None
            previous = int((logits[i] + bias[0].to(logits.dtype)).argmax())
            drafts.append(previous)
        return drafts


def peer_layer_ids(raw: dict[str, Any]) -> list[int]:
    """A block draft's target layers in z-lab's convention (the output of layer k), wherever
    its config names them: DFlash's `dflash_config`, DSpark's own keys, speculators' layout
    (in eaglet's convention there: one more)."""
    if "aux_hidden_state_layer_ids" in raw:  # speculators: HF hidden_states indices
        return [int(i) - 1 for i in raw["aux_hidden_state_layer_ids"]]
    for key in ("dspark_target_layer_ids", "target_layer_ids"):
        if raw.get(key):
            return [int(i) for i in raw[key]]
    return [int(i) for i in (raw.get("dflash_config") or {})["target_layer_ids"]]


def qwen3_layer_config(c: DFlashConfig) -> dict[str, object]:
    """The Qwen3 decoder keys of a block draft's config.json (vLLM builds its layers from
    them; speculators nests them as `transformer_layer_config`)."""
    return {
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
        "tie_word_embeddings": False,
    }


def layer_numbers(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields of `DFlashConfig` but the layout's own (layers, block, mask) from a block
    draft's config.json, vLLM's layout or speculators' (`transformer_layer_config`)."""
    layer = {**raw, **(raw.get("transformer_layer_config") or {})}
    rope = layer.get("rope_parameters") or {}
    heads = layer["num_attention_heads"]
    return dict(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_hidden_layers=layer["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        vocab_size=layer["vocab_size"],
        target_hidden_size=raw.get("target_hidden_size") or layer["hidden_size"],
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta") or layer.get("rope_theta") or 10000.0),
        max_position_embeddings=layer.get("max_position_embeddings", 32768),
    )
