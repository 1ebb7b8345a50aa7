"""The EAGLE-3 draft network: one Llama-style decoder layer over (token embedding, fused features).

Owns the network and nothing else: no data, no loss, no files. Read top to bottom like a Hugging
Face modeling file: config -> the training-time-test attention -> attention -> decoder layer
("midlayer") -> model (fc + midlayer + norm + lm_head + the d2t/t2d vocab maps); the norm, the
rotary embedding and the MLP are every method's (`eaglet.draft.methods.modules`).

One draft step maps (embedding of the next token, a hidden state) to (a new pre-norm hidden state,
draft-vocab logits). The hidden input is `fc(aux)` (three target layers fused) at the first step
and the draft's own previous output afterwards. Keys/values of earlier steps are passed back in as
`past_key_values` and concatenated with the current step's keys before the softmax, so the same
`forward` serves training-time test (TTT, all positions at once: the `TTT` pattern, which computes
what SDPA under `ttt_attention_mask` computes without the masked scores) and inference (one
position, everything visible). Parameter names are the
EAGLE/SGLang/vLLM checkpoint names (`midlayer.self_attn.q_proj.weight`, `fc.weight`, ...).
Embeddings are the target's, frozen, and are passed in: they are not part of this module.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.draft.methods.modules import MLP, RMSNorm, RotaryEmbedding, apply_rotary

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # one (k, v) per earlier step, [B, n_kv, S, D]


# config keys (and Eagle3Config fields) of the architecture variants, named as vLLM reads them
ARCHITECTURE_VARIANTS = ("norm_before_fc", "norm_before_residual", "norm_output")


@dataclass
class Eagle3Config:
    hidden_size: int  # H, equal to the target's hidden size
    intermediate_size: int  # I, MLP width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # V, the target vocabulary (t2d is [V])
    draft_vocab_size: int  # Vd, rows of lm_head (d2t is [Vd])
    target_hidden_size: int  # fc input is 3 * target_hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    num_aux_layers: int = 3
    # Variants of the architecture that other trainers' drafts use (speculators' eagle3 defaults
    # all three to True); eaglet trains with all three False. vLLM reads the same three keys.
    norm_before_fc: bool = False  # RMSNorm (`input_norm`, 3H wide) on the aux states before fc
    norm_before_residual: bool = False  # the residual is hidden_norm(hidden), not hidden
    norm_output: bool = False  # a step outputs norm(hidden): fed back, and lm_head reads it
    sliding_window: int | None = None  # attention window of a draft trained with one

    def to_dict(self) -> dict:
        return asdict(self)


def ttt_attention_mask(
    seq_len: int, step: int, device: torch.device | None = None, start: int = 0
) -> torch.Tensor:
    """Which keys a query may see at TTT step `step` (0-based), all positions at once.

    Keys are [step-0 keys (seq_len) | step-1 keys | ... | step-`step` keys]. The query at index t
    sees step-0 keys at indices <= t (causal) and, for each later step, only the key at index t
    (the diagonal): that is what position t's drafted chain looks like at inference. With
    `start`, the later steps (and a step > 0's queries) cover indices start..seq_len-1 only
    (`ttt_unroll` skips the indices where no later step can count). Returns bool
    [seq_len - start, seq_len + step * (seq_len - start)] (start is 0 at step 0), True = visible.
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[start:]
    diagonal = torch.eye(seq_len - start, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=-1)


# `attention_mask` value for training-time test: this step's queries see the step-0 keys causally
# and each later step's key at their own index (`ttt_attention_mask`); `ttt_attention` computes it
TTT = "ttt"

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _TTTAttentionCPU(torch.autograd.Function):
    """Flash attention over the step-0 keys, merged with the later steps' diagonal scores through
    the flash kernel's log-sum-exp; the backward reuses the flash backward.

    The queries sit at indices start..T-1. The step-0 keys come in two blocks: indices < start,
    which every query sees (plain flash), and start..T-1, causal to the queries (causal flash).
    With l_b the log-sum-exp of a query's scores in block b, d_j its score against step j's key
    at its own index and L = logsumexp(l_b.., d_1..d_s), the output is
        out = sum_b exp(l_b - L) * flash_out_b + sum_j exp(d_j - L) * v_j.
    The flash backward of block b, given grad_out * exp(l_b - L) and the merged `out`, yields
    exactly that block's gradients under the merged softmax (its D term is rowsum(dO * out))."""

    @staticmethod
    def forward(ctx, q, k0, v0, k_later, v_later):
        # q [B, h, Tq, D]; k0, v0 [B, kv, T, D]; k_later, v_later [B, kv, Tq, s, D]; Tq <= T
        B, h, Tq, D = q.shape
        kv, start = k0.shape[1], k0.shape[2] - q.shape[2]
        scale = D**-0.5
        acc = torch.promote_types(q.dtype, torch.float32)  # softmax weights in >= fp32
        blocks = [(slice(start, None), True)] + ([(slice(0, start), False)] if start else [])
        outs, lses = [], []
        for keys, causal in blocks:
            out_b, lse_b = _flash_cpu(q, k0[:, :, keys], v0[:, :, keys], 0.0, causal, scale=scale)
            outs.append(out_b.reshape(B, kv, h // kv, Tq, D))  # g = h // kv heads per kv head
            lses.append(lse_b.reshape(B, kv, h // kv, Tq, 1).to(acc))
        qg = q.reshape(B, kv, h // kv, Tq, D)
        later = torch.einsum("bkgtd,bktsd->bkgts", qg, k_later).to(acc) * scale  # [B,kv,g,Tq,s]
        lse = torch.logsumexp(torch.cat(lses + [later], dim=-1), dim=-1, keepdim=True)
        block_w = torch.cat([(lse_b - lse).exp() for lse_b in lses], dim=-1)  # [.., Tq, blocks]
        w = (later - lse).exp()  # [B, kv, g, Tq, s], each later key's weight
        out = torch.einsum("bkgts,bktsd->bkgtd", w.to(q.dtype), v_later)
        for b, out_b in enumerate(outs):
            out = out + block_w[..., b : b + 1].to(q.dtype) * out_b
        out = out.reshape(B, h, Tq, D)
        ctx.blocks = blocks
        ctx.save_for_backward(q, k0, v0, k_later, v_later, out, torch.cat(lses, -1), block_w, w)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, k_later, v_later, out, lses, block_w, w = ctx.saved_tensors
        B, h, Tq, D = q.shape
        kv = k0.shape[1]
        scale = D**-0.5
        grad_out = grad_out.contiguous()
        grad_g = grad_out.reshape(B, kv, h // kv, Tq, D)  # [B, kv, g, Tq, D]
        dq = torch.zeros_like(q)
        dk0, dv0 = torch.zeros_like(k0), torch.zeros_like(v0)
        for b, (keys, causal) in enumerate(ctx.blocks):
            grad_block = (grad_g * block_w[..., b : b + 1].to(grad_out.dtype)).reshape(q.shape)
            lse_b = lses[..., b].reshape(B, h, Tq)  # the kernel's dtype: >= float32, as w's
            dq_b, dk_b, dv_b = _flash_cpu_backward(
                grad_block, q, k0[:, :, keys], v0[:, :, keys], out, lse_b, 0.0, causal, scale=scale
            )
            dq += dq_b
            dk0[:, :, keys] += dk_b
            dv0[:, :, keys] += dv_b
        acc = w.dtype
        rowdot = (grad_g * out.reshape(grad_g.shape)).sum(-1, keepdim=True).to(acc)
        grad_w = torch.einsum("bkgtd,bktsd->bkgts", grad_g, v_later).to(acc)
        grad_later = (w * (grad_w - rowdot) * scale).to(q.dtype)  # d loss / d (q . k_j)
        qg = q.reshape(grad_g.shape)
        dq = dq + torch.einsum("bkgts,bktsd->bkgtd", grad_later, k_later).reshape(q.shape)
        dk_later = torch.einsum("bkgts,bkgtd->bktsd", grad_later, qg)
        dv_later = torch.einsum("bkgts,bkgtd->bktsd", w.to(grad_out.dtype), grad_g)
        return dq, dk0, dv0, dk_later, dv_later


def ttt_attention(
    q: torch.Tensor,  # [B, h, Tq, D], this step's queries, at indices T - Tq .. T - 1
    keys: list[torch.Tensor],  # per step so far (this one last): step 0 [B, kv, T, D], later
    # steps [B, kv, Tq, D]
    values: list[torch.Tensor],  # as keys
) -> torch.Tensor:
    """SDPA under `ttt_attention_mask(T, len(keys) - 1, start=T - Tq)`. Returns [B, h, Tq, D].

    The mask is causal over the step-0 keys and diagonal over every later step's keys: the dense
    form scores (step + 1) * T keys per query, of which at most T + step are visible (10 T^2
    scores at TTT length 4 where 4 T^2, half of them masked by causality, are needed). On the CPU
    the step-0 keys run as flash attention, which skips the masked half, and each later step
    adds one score per query (`_TTTAttentionCPU`); elsewhere it is the dense masked SDPA."""
    gqa = q.shape[1] != keys[0].shape[1]
    T, start = keys[0].shape[2], keys[0].shape[2] - q.shape[2]
    if len(keys) == 1 and start == 0:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, enable_gqa=gqa)
    if q.device.type == "cpu" and len(keys) > 1:
        # one dtype for the kernel: autocast's (as SDPA under autocast) or q's
        autocast = torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu") if autocast else q.dtype
        k_later = torch.stack(keys[1:], dim=-2).to(dtype)  # [B, kv, Tq, s, D]
        v_later = torch.stack(values[1:], dim=-2).to(dtype)
        with torch.autocast("cpu", enabled=False):
            return _TTTAttentionCPU.apply(
                q.to(dtype), keys[0].to(dtype), values[0].to(dtype), k_later, v_later
            )
    mask = ttt_attention_mask(T, len(keys) - 1, q.device, start)
    k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Eagle3Attention(nn.Module):
    """GQA self-attention whose input is [norm(embedding), norm(hidden)], 2H wide."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        in_features = 2 * config.hidden_size
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, 2H]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        past_key_values: KVCache,
        attention_mask: torch.Tensor | str | None,  # bool [T, S_total] or [B, 1, T, S_total];
        # None = all visible; TTT = the training-time-test pattern (`ttt_attention`)
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        B, T, _ = x.shape
        h, kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, h, D).transpose(1, 2)  # [B, h, T, D]
        k = self.k_proj(x).view(B, T, kv, D).transpose(1, 2)  # [B, kv, T, D]
        v = self.v_proj(x).view(B, T, kv, D).transpose(1, 2)  # [B, kv, T, D]
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)

        if isinstance(attention_mask, str):
            if attention_mask != TTT:
                raise ValueError(f"unknown attention pattern {attention_mask!r}; use {TTT!r}")
            keys = [pk for pk, _ in past_key_values] + [k]
            out = ttt_attention(q, keys, [pv for _, pv in past_key_values] + [v])  # [B, h, T, D]
        else:
            # keys of earlier steps first, this step's last: [B, kv, S_total, D]
            all_k = torch.cat([pk for pk, _ in past_key_values] + [k], dim=2)
            all_v = torch.cat([pv for _, pv in past_key_values] + [v], dim=2)
            # each group of h // kv query heads reads one key/value head (GQA)
            out = F.scaled_dot_product_attention(
                q, all_k, all_v, attn_mask=attention_mask, enable_gqa=h != kv
            )  # [B, h, T, D]
        out = out.transpose(1, 2).reshape(B, T, h * D)
        return self.o_proj(out), (k, v)  # [B, T, H]; this step's rotated k/v for later steps


class Eagle3DecoderLayer(nn.Module):
    """The "midlayer": pre-norm Llama block whose attention also reads the token embedding."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on embeddings
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on hidden input
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, embeds, hidden, cos_sin, past_key_values, attention_mask):
        normed = self.hidden_norm(hidden)  # [B, T, H]
        residual = normed if self.norm_before_residual else hidden  # [B, T, H]
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        attn_out, kv = self.self_attn(x, cos_sin, past_key_values, attention_mask)
        hidden = residual + attn_out  # [B, T, H]
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))  # [B, T, H]
        return hidden, kv


class Eagle3Draft(nn.Module):
    """fc (fuse 3 target layers) -> midlayer -> norm -> lm_head, plus d2t/t2d buffers."""

    method_name = "eagle3"  # eaglet.draft.methods
    d2t: torch.Tensor  # int64 [Vd] (buffers, registered below)
    t2d: torch.Tensor  # bool [V]

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        aux_width = config.num_aux_layers * config.target_hidden_size
        if config.norm_before_fc:
            self.input_norm = RMSNorm(aux_width, config.rms_norm_eps)
        self.fc = nn.Linear(aux_width, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        # d2t[i] = target_id(i) - i (EAGLE convention); t2d[v] = v is in the draft vocab
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        if self.config.norm_before_fc:
            aux_hidden_states = self.input_norm(aux_hidden_states)  # [B, T, 3H_target]
        return self.fc(aux_hidden_states)  # [B, T, 3H_target] -> [B, T, H]

    def forward(
        self,
        input_embeds: torch.Tensor,  # [B, T, H], target embeddings of the tokens fed at this step
        hidden_states: torch.Tensor,  # [B, T, H], fuse(aux) at step 0, own output afterwards
        position_ids: torch.Tensor,  # [B, T]
        past_key_values: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """One draft step. Returns the output [B, T, H] (pre-norm; post-norm with
        `norm_output`) and the cache with this step's (k, v) appended; the output is the next
        step's hidden input, and its logits are `compute_logits(output)`."""
        past_key_values = list(past_key_values or [])
        cos_sin = self.rotary(position_ids)
        hidden, kv = self.midlayer(
            input_embeds, hidden_states, cos_sin, past_key_values, attention_mask
        )
        if self.config.norm_output:
            hidden = self.norm(hidden)
        return hidden, past_key_values + [kv]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.norm_output:  # `forward` normed it already
            return self.lm_head(hidden)  # [B, T, Vd]
        return self.lm_head(self.norm(hidden))  # [B, T, Vd]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
