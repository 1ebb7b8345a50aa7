"""The DFlash draft network: a block drafter conditioned on the target's hidden states, as vLLM
0.32 serves it (`qwen3_dflash.DFlashQwen3ForCausalLM`), and the backbone DSpark adds its Markov
head to (`eaglet.draft.methods.dspark`, as vLLM's `Qwen3DSparkModel` subclasses it). Owns the
network and nothing else.

Read top to bottom like a Hugging Face modeling file: config -> attention -> decoder layer ->
model. Per round the draft sees

- a context: the target's states at `target_layer_ids` for every position up to the last
  accepted token P, concatenated in ascending layer order and projected once,
  `c = hidden_norm(fc(aux))` [C, H]; each layer turns `c` into its own keys and values
  (`k_norm(k_proj(c))` with RoPE at the context positions, `v_proj(c)`); contexts are never
  queries and pass through no other layer;
- a block of `block_size` tokens: the token the target just chose at P+1, then mask tokens at
  P+2.., run through Qwen3 decoder layers (pre-norm, q_norm/k_norm per head, SiLU MLP) whose
  attention sees the whole context and the whole block, without a causal mask. One forward
  gives all K drafts: DFlash reads slots 1..K (the mask at P+1+j predicts the token at its own
  position, draft j; K = block_size - 1); a layout that also predicts from the anchor
  (`first_slot` 0, DSpark's) reads slots 0..K-1 (slot s predicts the token after it).

The embedding and lm_head are the target's (frozen, passed in, never saved): vLLM uses the
target's when the checkpoint has none. `k_norm` is one module shared by every layer: vLLM
0.32's CPU kernel applies layer 0's k_norm to every layer's context keys, so drafts whose layers
share it are served the same on a CPU and a GPU (the export writes the same weight per layer).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.draft.methods.modules import MLP, RMSNorm, RotaryEmbedding, apply_rotary


@dataclass
class DFlashConfig:
    hidden_size: int  # H, equal to the target's (the target's embedding and lm_head are used)
    intermediate_size: int
    num_hidden_layers: int  # draft decoder layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # V, the target's
    target_hidden_size: int
    target_layer_ids: list[int]  # eaglet's convention (HF hidden_states[i])
    block_size: int  # tokens per block: the bonus token and block_size - 1 masks
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768

    @property
    def first_slot(self) -> int:
        """The block's first slot whose output is a draft: 1, the masks after the bonus."""
        return 1

    @property
    def drafts(self) -> int:
        """K: the tokens one round drafts."""
        return self.block_size - self.first_slot

    def to_dict(self) -> dict:
        return asdict(self)


class BlockAttention(nn.Module):
    """Queries of the block over [context keys ; block keys], bidirectional."""

    def __init__(self, c: DFlashConfig, k_norm: RMSNorm):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads, c.num_key_value_heads, c.head_dim
        )  # fmt: skip
        self.q_proj = nn.Linear(c.hidden_size, self.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = k_norm  # shared by every layer (see the module docstring)

    def _keys(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, *rope), v  # [B, kv, T, D] each

    def forward(
        self,
        x: torch.Tensor,  # [B, Q, H], the block (after input_layernorm)
        context: torch.Tensor,  # [B, C, H], hidden_norm(fc(aux))
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,  # bool [B, 1, Q, C + Q], True = visible
    ) -> torch.Tensor:
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, *block_rope)  # [B, h, Q, D]
        k_ctx, v_ctx = self._keys(context, context_rope)
        k_blk, v_blk = self._keys(x, block_rope)
        k, v = torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2)  # [B, kv, C + Q, D]
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, 1)
            v = v.repeat_interleave(self.heads // self.kv_heads, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, h, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, c: DFlashConfig, k_norm: RMSNorm):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = BlockAttention(c, k_norm)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def forward(self, x, context, block_rope, context_rope, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, block_rope, context_rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """fc + hidden_norm (the context), decoder layers and norm (the block). Parameter names are
    vLLM's checkpoint names without the `model.` prefix (`layers.0.self_attn.q_proj.weight`,
    `fc.weight`, `hidden_norm.weight`, `norm.weight`); see `checkpoint_tensors`."""

    method_name = "dflash"  # eaglet.draft.methods
    config: DFlashConfig

    def __init__(self, config: DFlashConfig):
        super().__init__()
        c = self.config = config
        width = len(c.target_layer_ids) * c.target_hidden_size
        self.fc = nn.Linear(width, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(c, self.k_norm) for _ in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """[B, C, n * H_t] target states -> [B, C, H]."""
        return self.hidden_norm(self.fc(aux))

    def logits_bias(self, previous: torch.Tensor) -> torch.Tensor | None:
        """What a draft adds to the logits of the draft after each of `previous` [...] (token
        ids): [..., V]; None for DFlash, whose drafts do not depend on each other."""
        return None

    def forward(
        self,
        block_embeds: torch.Tensor,  # [B, Q, H], the target's embeddings of the block tokens
        block_positions: torch.Tensor,  # [B, Q]
        context: torch.Tensor,  # [B, C, H], `self.context(aux)`
        context_positions: torch.Tensor,  # [B, C]
        mask: torch.Tensor | None = None,  # bool [B, 1, Q, C + Q]; None: all visible
    ) -> torch.Tensor:
        """The block's final-normed hidden states [B, Q, H] (logits: lm_head of these)."""
        block_rope, context_rope = self.rotary(block_positions), self.rotary(context_positions)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, context, block_rope, context_rope, mask)
        return self.norm(x)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What vLLM loads: every layer's weights, its k_norm included (the shared one, once
        per layer), fc, hidden_norm and norm; no embedding or lm_head (the target's)."""
        out = {}
        for name, tensor in self.state_dict().items():
            if name == "k_norm.weight":
                continue  # written under each layer below
            out[name] = tensor.detach().contiguous().clone()
        for i in range(len(self.layers)):
            out[f"layers.{i}.self_attn.k_norm.weight"] = self.k_norm.weight.detach().clone()
        return out

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of `checkpoint_tensors` (every layer's k_norm must be the same)."""
        norms = [tensors[f"layers.{i}.self_attn.k_norm.weight"] for i in range(len(self.layers))]
        if any(not torch.equal(n, norms[0]) for n in norms):
            raise ValueError("the layers' k_norm weights differ: not a draft eaglet wrote")
        state = {k: v for k, v in tensors.items() if ".k_norm." not in k}
        state["k_norm.weight"] = norms[0]
        for i in range(len(self.layers)):
            state[f"layers.{i}.self_attn.k_norm.weight"] = norms[0]
        self.load_state_dict(state, strict=True)


def block_mask(anchors: torch.Tensor, context_len: int, block: int) -> torch.Tensor:
    """Training's attention mask for A anchor blocks over one sequence's context: bool
    [A * block, context_len + A * block]; block a (anchor P_a) sees context positions <= P_a and
    its own block, bidirectionally, and nothing of other blocks."""
    A = anchors.shape[0]
    device = anchors.device
    ctx = torch.arange(context_len, device=device)[None] <= anchors[:, None]  # [A, C]
    ctx = ctx.repeat_interleave(block, 0)  # [A * block, C]
    own = torch.block_diag(*[torch.ones(block, block, dtype=torch.bool, device=device)] * A)
    return torch.cat([ctx, own], dim=1)
