"""`train`: the draft method's own constraints and settings of another method left set
(`train.method`, another method's section such as `train.dflash`); `train.init_from`: the
starting draft reads this target (hidden size, vocabulary) and the layers this run extracts
(`eaglet.draft.init_from`), its weights are whole and finite, and the train settings it
overrides are named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglet.config.pipeline import PipelineConfig
from eaglet.preflight.report import PreflightReport, first_line
from eaglet.preflight.target import check_safetensors


def check_method(config: PipelineConfig, model_config: Any, report: PreflightReport) -> None:
    """The draft method's own constraints (`DraftMethod.problems`), and settings of another
    method set away from their defaults: with this method they would do nothing."""
    from eaglet.config.train import TrainConfig
    from eaglet.draft.methods import METHODS, draft_method
    from eaglet.draft.target_head import head_config

    method = draft_method(config.train.method)
    try:
        found = method.problems(config, head_config(model_config))
    except (AttributeError, TypeError):  # a config the checks above already named
        return
    defaults = TrainConfig()
    for name in getattr(method, "foreign_settings", ()):
        value = getattr(config.train, name)
        if value != getattr(defaults, name):
            found.append(
                f"train.{name}={value}: train.method={method.name} does not read it; remove it "
                f"(or set train.method to the method it belongs to)"
            )
    for other in METHODS:  # another method's own section (train.dflash, train.dspark, ...)
        section = getattr(config.train, other, None)
        if other != method.name and section is not None and section != getattr(defaults, other):
            found.append(
                f"train.{other} is set but train.method={method.name}: the settings would do "
                f"nothing; remove them, or set train.method={other}"
            )
    report.problems.extend(f"train.method={method.name}: {p}" for p in found)
    if not found:
        report.passed.append(f"train.method={method.name}: its settings fit this target")


def _non_finite_tensor(path: Path) -> str | None:
    """The first tensor of a safetensors file holding NaN or infinity, named; None if none."""
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    bad = int((~torch.isfinite(tensor)).sum())
                    return f"{path}: tensor {name} holds {bad} NaN or infinite value(s)"
    except (SafetensorError, OSError) as exc:
        return f"{path}: not a readable safetensors file ({first_line(exc)})"
    return None


def check_init_from(config: PipelineConfig, model_config: Any, report: PreflightReport) -> None:
    from eaglet.draft.init_from import (
        StartingDraftError,
        problems,
        read_starting_draft,
        unused_settings,
    )
    from eaglet.draft.target_head import head_config
    from eaglet.hidden_states.layers import layer_ids_of

    train = config.train
    if not train.init_from:
        return
    try:
        target = head_config(model_config)
        ids = layer_ids_of(config, target["num_hidden_layers"])
    except (ValueError, AttributeError):  # check_layers names what is wrong with the layers
        return
    try:
        start = read_starting_draft(
            train.init_from, train.init_from_layer_convention, target["num_hidden_layers"]
        )
    except StartingDraftError as exc:  # its message names train.init_from and the folder
        report.problems.append(str(exc))
        return
    found = problems(start, target, ids)
    weights = start.folder / "model.safetensors"
    damaged = check_safetensors(weights) or _non_finite_tensor(weights)
    if damaged:
        found.append(f"train.init_from weights: {damaged}: train it again or export it again")
    report.problems.extend(found)
    if found:
        return
    unused = unused_settings(start, train)
    if unused:
        report.warnings.append(
            f"train.init_from brings its own shape and vocabulary; not used: {', '.join(unused)}"
        )
    report.passed.append(
        f"train.init_from {start.folder} ({start.format} format) reads this target at layers "
        f"{start.aux_layer_ids}, draft vocab {start.config.draft_vocab_size}"
    )
