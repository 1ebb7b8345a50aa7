"""Storage forms of the feature tensors in a shard, and the one way back to float.

- `float32`: 4 bytes per value (16·H bytes per token for aux [3H] + final [H]).
- `bfloat16`: 2 bytes per value (8·H per token, the anchor other tools use).
- `int8`: 1 byte per value (4·H per token) plus one float32 absmax scale per token and per
  layer (`<name>_scale` [T, G], G = 3 for aux, 1 for final): value ≈ q * scale / 127.
- `fp8`: float8 e4m3 values (4·H per token) with the same per-token scales (value ≈ q * scale /
  448), where the installed torch supports the dtype.

A shard stores each feature tensor under its usual name (`aux_hidden_states`,
`final_hidden_states`) in the storage dtype; the compact forms add `<name>_scale`.
"""

from __future__ import annotations

import torch

STORAGES = ("float32", "bfloat16", "int8", "fp8")
# benchmarks/hidden_states.py on the fixture: int8 0.7% relative error, 99.7% of greedy tokens
# unchanged against float32 (fp8: 2.6%, 99.2%), at half of bf16's bytes.
DEFAULT_STORAGE = "int8"
SCALE_SUFFIX = "_scale"
_FP8 = getattr(torch, "float8_e4m3fn", None)
_QMAX = {"int8": 127.0, "fp8": 448.0}


def value_bytes(storage: str) -> int:
    return {"float32": 4, "bfloat16": 2, "int8": 1, "fp8": 1}[storage]


def bytes_per_token(hidden_size: int, storage: str, layers: int = 3) -> int:
    """Bytes one token costs in a shard: aux [layers * H] + final [H] values, their scales
    (compact forms: layers + 1 float32 per token), input id (int64) and loss mask (uint8)."""
    scales = 4 * (layers + 1) if storage in _QMAX else 0
    return (layers + 1) * hidden_size * value_bytes(storage) + scales + 8 + 1


def check_storage(storage: str) -> None:
    if storage not in STORAGES:
        raise ValueError(f"unknown hidden_states.storage {storage!r}; use one of {STORAGES}")
    if storage == "fp8" and _FP8 is None:
        raise ValueError("hidden_states.storage=fp8 needs a torch with float8_e4m3fn; use int8")


def encode(name: str, values: torch.Tensor, storage: str, groups: int) -> dict[str, torch.Tensor]:
    """`values` [T, W] (float) in `storage`; `groups` layers of W/groups each get their own
    per-token scale in the compact forms."""
    if storage == "float32":
        return {name: values.to(torch.float32).contiguous()}
    if storage == "bfloat16":
        return {name: values.to(torch.bfloat16).contiguous()}
    check_storage(storage)
    T, W = values.shape
    grouped = values.to(torch.float32).reshape(T, groups, W // groups)  # [T, G, W/G]
    absmax = grouped.abs().amax(dim=-1).clamp_min(1e-12)  # [T, G]
    scaled = grouped / absmax[..., None] * _QMAX[storage]
    if storage == "int8":
        q = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        q = scaled.to(_FP8)
    return {name: q.reshape(T, W).contiguous(), name + SCALE_SUFFIX: absmax.contiguous()}


def decode(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Float32 [T, W] from stored values [T, W] and, for compact forms, scales [T, G]."""
    if scale is None:
        return values.to(torch.float32)
    qmax = _QMAX["int8"] if values.dtype == torch.int8 else _QMAX["fp8"]
    T, W = values.shape
    G = scale.shape[-1]
    step = (scale.to(torch.float32) / qmax)[..., None]  # [T, G, 1]
    out = values.to(torch.float32).reshape(T, G, W // G) * step
    return out.reshape(T, W)
