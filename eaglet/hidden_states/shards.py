"""The safetensors shards `train` reads, written with their sha256 computed as the bytes go
out, and the one function that reads a window of a shard back as float tensors.

A shard concatenates samples along tokens: `input_ids` [T] (int64), `loss_mask` [T] (uint8),
`aux_hidden_states` [T, 3H] and `final_hidden_states` [T, H] (post final norm) in the storage
form of `eaglet.hidden_states.feature_encoding`, plus `<name>_scale` [T, G] for the compact forms.
`index.jsonl` holds one row per sample: sample_id, shard, offset, length.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglet.hidden_states.feature_encoding import SCALE_SUFFIX, decode

FEATURES = ("aux_hidden_states", "final_hidden_states")
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
}
if hasattr(torch, "float8_e4m3fn"):
    _ST_DTYPES[torch.float8_e4m3fn] = "F8_E4M3"

INDEX = "index.jsonl"  # the hidden_states folder's index: sample id -> shard, offset, length


@dataclass
class WrittenFile:
    bytes: int
    sha256: str


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


def write_safetensors_hashed(tensors: dict[str, torch.Tensor], path: Path) -> WrittenFile:
    """Write a safetensors file (same layout as `safetensors.torch.save_file`: 8-byte header
    length, JSON header padded to 8 bytes, tensors in sorted-name order) through a temporary
    sibling renamed into place, hashing the bytes as they are written."""
    names = sorted(tensors)
    header: dict = {}
    offset = 0
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    digest = hashlib.sha256()
    tmp = path.with_name(path.name + ".tmp")
    written = 0
    with open(tmp, "wb") as handle:

        def put(chunk) -> None:
            nonlocal written
            digest.update(chunk)
            handle.write(chunk)
            written += len(chunk)

        put(struct.pack("<Q", len(blob)))
        put(blob)
        for name in names:
            raw = _raw_bytes(tensors[name])
            for start in range(0, len(raw), 1 << 24):
                put(raw[start : start + (1 << 24)])
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return WrittenFile(bytes=written, sha256=digest.hexdigest())


def join_samples(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate per-sample tensors (already in their storage form) along tokens."""
    return {key: torch.cat([s[key] for s in samples]).contiguous() for key in samples[0]}


def read_window(handle, offset: int, length: int, keys=None) -> dict[str, torch.Tensor]:
    """Tokens [offset, offset + length) of an open shard (`safetensors.safe_open(path, "pt")`)
    as training tensors whatever the storage: input_ids long [n], loss_mask bool [n],
    aux_hidden_states float32 [n, 3H], final_hidden_states float32 [n, H]. `keys` limits what
    is read (e.g. only input_ids and loss_mask)."""
    names = set(handle.keys())
    wanted = keys or ("input_ids", "loss_mask", *FEATURES)
    end = offset + length
    out: dict[str, torch.Tensor] = {}
    for key in wanted:
        values = handle.get_slice(key)[offset:end]
        if key == "input_ids":
            out[key] = values.long()
        elif key == "loss_mask":
            out[key] = values.bool()
        else:
            scale_key = key + SCALE_SUFFIX
            scale = handle.get_slice(scale_key)[offset:end] if scale_key in names else None
            out[key] = decode(values, scale)
    return out


def read_index(folder: Path) -> list[dict]:
    lines = (Path(folder) / INDEX).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
