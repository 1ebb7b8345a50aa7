"""Which target layers feed the draft, and the one convention their ids are written in.

Layer ids follow the vLLM/speculators convention: id i is HF `hidden_states[i]`, the input of
decoder layer i (0 = the embeddings). SpecForge/SGLang count "output of layer i" (= id i + 1).
The convention's name is written into the hidden-states manifest and the draft's config, and
evaluation checks it, so nobody has to guess. `tests/test_hidden_states_vllm.py` proves the
convention: vLLM's `extract_hidden_states` at these ids equals HF `hidden_states[i]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eaglet.config import PipelineConfig

AUX_LAYER_CONVENTION = "hf_hidden_states_index"  # id i = HF hidden_states[i] = input of layer i


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
    # 0 (the embeddings) .. num_layers - 1; id num_layers would be HF's final-normed state,
    # which vLLM's id num_layers (the last layer's output before the norm) is not.
    if any(i < 0 or i >= num_layers for i in ids):
        raise ValueError(f"aux_layer_ids {ids} must lie in 0..{num_layers - 1}")
    return ids


def layer_ids_of(config: PipelineConfig, num_layers: int) -> list[int]:
    """The target layers this run extracts and trains on: `hidden_states.aux_layer_ids` as the
    draft method (`train.method`) reads them, or that method's default (EAGLE-3's three for
    both built-in methods, so switching methods reuses the extracted states)."""
    from eaglet.draft.methods import draft_method

    method = draft_method(config.train.method)
    return method.layer_ids(config.hidden_states.aux_layer_ids, num_layers)
