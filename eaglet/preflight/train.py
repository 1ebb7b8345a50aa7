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


def check_mask_token(
    config: PipelineConfig, model_config: Any, tokenizer: Any, report: PreflightReport
) -> None:
    """DFlash's mask token (`train.dflash.mask_token_id`, blank: the pad token) must be a token
    no answer holds: not an end token, nor a special token the chat template renders (the
    draft could not tell a mask slot from it)."""
    if config.train.method != "dflash":
        return
    from eaglet.target import end_token_ids

    mask = config.train.dflash.mask_token_id
    setting, said = f"train.dflash.mask_token_id={mask}", report.problems
    if mask is None:  # the default: said, not refused (a target's pad is rarely in answers)
        said = report.warnings
        pad = getattr(model_config, "pad_token_id", None)
        mask = pad if isinstance(pad, int) else model_config.vocab_size - 1
        setting = f"train.dflash.mask_token_id (blank: the pad token, {mask})"
    ends = set(end_token_ids(config.target, tokenizer))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}],
            tokenize=True, **config.tokenize.chat_template_kwargs,
        )  # fmt: skip
        rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        special |= {int(i) for i in rendered if int(i) in set(tokenizer.get_added_vocab().values())}
    except Exception:  # check_template names a template that cannot render
        pass
    if mask in ends or mask in special - {getattr(tokenizer, "pad_token_id", None)} - {None}:
        what = (
            "an end token of the target's answers"
            if mask in ends
            else ("a special token the chat template renders")
        )
        said.append(
            f"{setting} is {tokenizer.convert_ids_to_tokens(mask)!r}, {what}: a mask slot "
            "would look like it to the draft; choose a token no answer holds (a reserved or "
            "unused id)"
        )


def non_finite_tensor(path: Path) -> str | None:
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


# What a draft's config.json holds and a target's does not (eaglet's exports, speculators',
# vLLM's EAGLE-3, P-EAGLE and DFlash checkpoints).
DRAFT_KEYS = ("eaglet", "draft_vocab_size", "dflash_config", "pard_token", "speculators_config")
DRAFT_ARCHITECTURE_WORDS = ("eagle", "dflash", "dspark", "speculator", "draft")


def draft_folder_problem(folder: Path) -> str | None:
    """Why `folder` is not a draft that can be scored (no config.json, a target's folder, no
    weights, weights cut short, or NaN/inf in them), in one line naming the file; None when
    it is one."""
    import json

    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return f"{folder} holds no config.json: give a draft folder"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return f"{config_file}: not valid JSON ({first_line(exc)})"
    if not isinstance(config, dict):
        return f"{config_file}: not a model config (a JSON object)"
    architectures = [str(a) for a in config.get("architectures") or []]
    named = any(w in a.lower() for a in architectures for w in DRAFT_ARCHITECTURE_WORDS)
    if not named and not any(key in config for key in DRAFT_KEYS):
        return (
            f"{folder} is not a draft: its config.json describes {architectures or 'a model'} "
            "with none of a draft's keys (a target model's folder?); give the draft's folder"
        )
    weights = sorted(Path(folder).glob("*.safetensors"))
    if not weights:
        return f"{folder} holds no .safetensors weights"
    for path in weights:
        damaged = check_safetensors(path) or non_finite_tensor(path)
        if damaged:
            return f"{damaged}: a draft with these weights is never scored"
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
        if train.init_from_vocab != "keep":
            report.problems.append(
                f"train.init_from_vocab={train.init_from_vocab} grows a starting draft's "
                "vocabulary, but train.init_from names none: remove it, or set train.init_from"
            )
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
    found = problems(start, dict(target), ids)
    weights = start.folder / "model.safetensors"
    damaged = check_safetensors(weights) or non_finite_tensor(weights)
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


def check_nodes(config: PipelineConfig, report: PreflightReport) -> None:
    """train.nnodes > 1: the machines joining read the features from servers they reach,
    never from one eaglet starts on the leading machine's 127.0.0.1."""
    train, vllm = config.train, config.hidden_states.vllm
    if train.nnodes == 1:
        return
    served = train.hidden_states == "online" and config.hidden_states.backend == "vllm"
    if served and vllm.vllm_python:
        report.problems.append(
            f"train.nnodes={train.nnodes} with hidden_states.vllm.vllm_python: eaglet would "
            "start the capture server on the leading machine's 127.0.0.1, which the other "
            "machines cannot reach; start capture servers every machine reaches (python -m "
            "eaglet.hidden_states.capture_server) and list them in hidden_states.vllm.endpoints"
        )
    else:
        report.passed.append(
            f"train.nnodes={train.nnodes}: the machines meet at {train.rdzv_endpoint}"
        )
