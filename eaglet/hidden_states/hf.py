"""Target features for EAGLE-3 training, computed with transformers and written as shards.

Per token we keep the three auxiliary residual states (concatenated, [T, 3H]) and the final
post-norm state ([T, H], from which `lm_head` gives the target's logits at train time: H per
token instead of V). Samples are concatenated along tokens into safetensors shards, and
`index.jsonl` says where each sample lies.

Layer ids follow the vLLM/speculators convention: id i is HF `hidden_states[i]`, the input of
decoder layer i (0 = embeddings). SpecForge/SGLang count "output of layer i" (= id i+1); the
convention is written into the manifest and the draft's config so nobody has to guess.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from eaglet.records.examples import Example

AUX_LAYER_CONVENTION = "vllm: id i = HF hidden_states[i] = input of decoder layer i"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default (2, N//2, N-3) in the vLLM convention."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(requested: list[int] | None, num_layers: int) -> list[int]:
    ids = list(requested) if requested is not None else default_aux_layer_ids(num_layers)
    if len(ids) != 3:
        raise ValueError(f"EAGLE-3 fuses exactly 3 target layers; got aux_layer_ids={ids}")
    if len(set(ids)) != 3:
        raise ValueError(
            f"aux_layer_ids {ids} repeat a layer (a {num_layers}-layer target's defaults "
            "collide); set hidden_states.aux_layer_ids explicitly"
        )
    if any(i < 1 or i >= num_layers for i in ids):
        raise ValueError(f"aux_layer_ids {ids} must lie in 1..{num_layers - 1}")
    return ids


@dataclass
class ShardWriter:
    """Collects per-sample tensors and writes a shard whenever `shard_tokens` is reached."""

    folder: Path
    shard_tokens: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        self._pending: list[tuple[str, dict[str, torch.Tensor]]] = []
        self._pending_tokens = 0
        self.shards: list[str] = []
        self._index = open(self.folder / "index.jsonl", "w", encoding="utf-8")

    def add(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
        self._pending.append((sample_id, tensors))
        self._pending_tokens += tensors["input_ids"].shape[0]
        if self._pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        name = f"shard-{len(self.shards):05d}.safetensors"
        offset = 0
        for sample_id, tensors in self._pending:
            length = tensors["input_ids"].shape[0]
            row = {"sample_id": sample_id, "shard": name, "offset": offset, "length": length}
            self._index.write(json.dumps(row) + "\n")
            offset += length
        joined = {
            key: torch.cat([t[key] for _, t in self._pending]).contiguous()
            for key in self._pending[0][1]
        }
        save_file(joined, str(self.folder / name))
        self._index.flush()
        self.shards.append(name)
        self._pending, self._pending_tokens = [], 0

    def close(self) -> None:
        self.flush()
        self._index.close()


@torch.inference_mode()
def extract_hidden_states(
    examples: Iterable[Example],
    model_dir: str,
    out_dir: Path,
    aux_layer_ids: list[int] | None,
    shard_tokens: int,
    batch_size: int,
    store_dtype: str = "float32",
    model_dtype: str = "float32",
    trust_remote_code: bool = False,
    progress: Callable[[int, int, float], None] | None = None,
) -> dict:
    """Run the target over every example and write shards; returns figures for the manifest."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=DTYPES[model_dtype], trust_remote_code=trust_remote_code
    ).eval()
    num_layers = model.config.num_hidden_layers
    ids = resolve_aux_layer_ids(aux_layer_ids, num_layers)
    ordered = sorted(examples, key=lambda e: len(e.input_ids))
    writer = ShardWriter(out_dir, shard_tokens, DTYPES[store_dtype])
    started, tokens = time.time(), 0
    for start in range(0, len(ordered), batch_size):
        batch = ordered[start : start + batch_size]
        width = max(len(e.input_ids) for e in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        for row, example in enumerate(batch):
            input_ids[row, : len(example.input_ids)] = torch.tensor(example.input_ids)
            attention_mask[row, : len(example.input_ids)] = 1
        # Right padding: with causal attention, real tokens never see the pads after them.
        outputs = model.model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True
        )
        aux = torch.cat([outputs.hidden_states[i] for i in ids], dim=-1)  # [B, T, 3H]
        final = outputs.last_hidden_state  # [B, T, H], after the final norm
        for row, example in enumerate(batch):
            n = len(example.input_ids)
            writer.add(
                example.sample_id,
                {
                    "input_ids": input_ids[row, :n].clone(),  # [T]
                    "loss_mask": torch.tensor(example.loss_mask, dtype=torch.uint8),  # [T]
                    "aux_hidden_states": aux[row, :n].to(writer.dtype).clone(),  # [T, 3H]
                    "final_hidden_states": final[row, :n].to(writer.dtype).clone(),  # [T, H]
                },
            )
            tokens += n
        if progress is not None:
            progress(min(start + batch_size, len(ordered)), len(ordered), time.time() - started)
    writer.close()
    return {
        "aux_layer_ids": ids,
        "aux_layer_convention": AUX_LAYER_CONVENTION,
        "num_hidden_layers": num_layers,
        "hidden_size": model.config.hidden_size,
        "dtype": store_dtype,
        "shards": writer.shards,
        "tokens": tokens,
        "samples": len(ordered),
    }
