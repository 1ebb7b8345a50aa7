"""The network pieces every draft method is built from, kept once: RMSNorm, rotary position
embedding (Llama's "default" RoPE, rotate-half layout, as vLLM applies it to drafts) and the
SiLU-gated MLP. Parameter names are the checkpoints' (`weight`, `gate_proj`, `up_proj`,
`down_proj`), so every method's files keep their layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Llama "default" RoPE, rotate-half (neox) layout, as vLLM applies it to drafts."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, D]
        return emb.cos()[:, None], emb.sin()[:, None]  # [B, 1, T, D] each


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin  # [B, heads, T, D]


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the decoder layers' MLP in every method."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
