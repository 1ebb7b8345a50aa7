"""`hidden_states`: `hidden_states.aux_layer_ids` against the target's layer count (a 4-layer
target's defaults collide: [2, 2, 1]), and the chosen backend's own checks, owned by its
module (`eaglet.hidden_states.backends`: the vllm backend's servers and connector folder).
"""

from __future__ import annotations

from typing import Any

from eaglet.config.pipeline import PipelineConfig
from eaglet.preflight.report import PreflightReport


def check_layers(config: PipelineConfig, model_config: Any, report: PreflightReport) -> None:
    from eaglet.hidden_states.layers import layer_ids_of

    layers = getattr(model_config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        report.warnings.append(
            "hidden_states.aux_layer_ids: the target's config names no num_hidden_layers; "
            "not checked"
        )
        return
    try:
        ids = layer_ids_of(config, layers)
    except ValueError as exc:
        report.problems.append(f"hidden_states.aux_layer_ids: {exc}")
        return
    report.passed.append(f"hidden_states.aux_layer_ids {ids} fit the {layers}-layer target")


def check_hidden_states_backend(config: PipelineConfig, report: PreflightReport) -> None:
    """The chosen hidden-state backend's own checks (its servers, its settings), owned by its
    module (`eaglet.hidden_states.backends`)."""
    from eaglet.hidden_states.backends import hidden_states_backend

    hidden_states_backend(config.hidden_states.backend).preflight(config, report)
