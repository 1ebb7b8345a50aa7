"""`target`: `target.model` is a local folder with `config.json`, whole safetensors weights
(each file as long as its header says, an index's shards there) and a tokenizer, or a hub
id that answers (`eaglet.preflight.hub`); a path that looks local and is missing is named
as a folder, never as a hub-id error. Its config and tokenizer load (into the report), and
the tokenizer fits the model's vocabulary (and `train.draft_vocab_size`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from eaglet.config.pipeline import PipelineConfig
from eaglet.local_paths import is_hub_id
from eaglet.preflight.hub import hub_lookup_problem
from eaglet.preflight.report import PreflightReport, first_line

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_safetensors(path: Path) -> str | None:
    """Why a safetensors file is unusable (cut short, bad header), or None when its size
    matches its header. Reads the header only."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path}: {size} bytes, shorter than a safetensors header"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return (
                f"{path}: the header says {length} bytes of metadata but the file has {size}: "
                "the file is cut short (an interrupted download or copy?): fetch it again"
            )
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return f"{path}: the safetensors header is not valid JSON: the file is damaged"
    tensors = [t for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    ends = [t["data_offsets"][1] for t in tensors if "data_offsets" in t]
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return (
            f"{path}: {size} bytes, but its header describes {expected}: the file is cut short "
            "(an interrupted download or copy?): fetch it again"
        )
    return None


def check_weights(folder: Path, report: PreflightReport) -> None:
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError) as exc:
            report.problems.append(f"{index}: not a valid index ({first_line(exc)})")
            shards = set()
        missing = sorted(s for s in shards if not (folder / s).exists())
        if missing:
            report.problems.append(
                f"target.model: {index} names shards that are missing: {missing[:5]}: fetch them"
            )
    if not files:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            report.warnings.append(
                f"target.model: {folder} holds only pickle weights (*.bin/*.pt), which eaglet "
                "does not check; safetensors are preferred"
            )
        else:
            report.warnings.append(
                f"target.model: no *.safetensors in {folder}: the stages that load the target "
                "(local generation, hidden_states, evaluate) will fail"
            )
        return
    bad = [problem for problem in map(check_safetensors, files) if problem]
    report.problems += [f"target.model weights: {problem}" for problem in bad]
    if not bad:
        report.passed.append(f"target.model: {len(files)} safetensors file(s) whole")


def _locate_target(config: PipelineConfig, report: PreflightReport) -> bool:
    """Where `target.model` points (a folder with config.json, weights and a tokenizer, or a
    hub id the hub answers for), into the report; False when the checks end there."""
    model = config.target.model
    path = Path(model)
    if path.exists():
        if not path.is_dir():
            report.problems.append(
                f"target.model: {model} is a file; it must name the model's folder (with "
                "config.json, the tokenizer and the weights)"
            )
            return False
        if not (path / "config.json").exists():
            report.problems.append(
                f"target.model: the folder {model} has no config.json: it is not a "
                "transformers model folder (point target.model at the folder that holds "
                "config.json)"
            )
        else:
            check_weights(path, report)
    elif not is_hub_id(model):
        report.problems.append(
            f"target.model: folder {model} not found (resolved: {path.resolve()}): build or "
            "download the model there, or fix target.model"
            + (" (`eaglet demo` builds the demo's model)" if "demo" in model else "")
        )
        return False
    else:
        # One quick look at the hub first: transformers' own loading retries a missing network
        # for about a minute before it says so.
        unreachable = hub_lookup_problem(model, config.target.revision)
        if unreachable is not None:
            report.problems.append(unreachable)
            return False
    if path.is_dir() and not any((path / name).exists() for name in TOKENIZER_FILES):
        report.problems.append(
            f"target.model: no tokenizer in the folder {model} (none of "
            f"{', '.join(TOKENIZER_FILES)}): copy the model's tokenizer files into it"
        )
        return False
    return True


def config_advice(exc: Exception) -> str:
    """What to do about a target config transformers could not load, from what it said: a
    model type it does not know (custom code), access (gated, token), or a damaged file."""
    text = str(exc)
    if "trust_remote_code" in text or "model type" in text or "model_type" in text:
        return (
            "its model type needs code from the model's repository: set "
            "target.trust_remote_code: true if you trust it, or upgrade transformers"
        )
    if any(word in text for word in ("gated", "401", "403", "Unauthorized", "restricted")):
        return "the model is gated: request access on the hub and set HF_TOKEN"
    return "is the file damaged, or the folder not a transformers model folder?"


def load_target(config: PipelineConfig, report: PreflightReport) -> None:
    """The tokenizer and transformers config of the target, into the report; problems name
    `target.model` and say what is missing."""
    from eaglet.target import load_config, load_tokenizer

    model = config.target.model
    path = Path(model)
    if not _locate_target(config, report):
        return
    # The config first: the tokenizer's loading reads it too, and would blame the tokenizer.
    if not (path.exists() and not (path / "config.json").exists()):
        try:
            report.model_config = load_config(config.target)
        except Exception as exc:
            report.problems.append(
                f"target.model: its config.json could not be read ({first_line(exc)}): "
                + config_advice(exc)
            )
            return
    try:
        report.tokenizer = load_tokenizer(config.target)
    except Exception as exc:  # transformers raises many kinds here
        if path.exists():
            report.problems.append(
                f"target.model: no tokenizer could be loaded from the folder {model} "
                f"({first_line(exc)}): copy the tokenizer files (tokenizer.json, "
                "tokenizer_config.json) into it"
            )
        else:
            report.problems.append(
                f"target.model={model!r}: no such local folder, and as a hub model id it could "
                f"not be loaded ({first_line(exc)}): set target.model to the folder that holds "
                "the model, or check the id, target.revision, the network and HF_TOKEN / "
                "HF_HUB_OFFLINE"
            )
        return
    if report.model_config is not None:
        report.passed.append(f"target.model {model}: config and tokenizer load")


def check_vocab(
    config: PipelineConfig, model_config: Any, tokenizer: Any, report: PreflightReport
) -> None:
    vocab = getattr(model_config, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    tokens = len(tokenizer)
    if tokens > vocab:
        report.problems.append(
            f"target.model: the tokenizer has {tokens} tokens but the model's vocab_size is "
            f"{vocab}: ids from {vocab} up have no embedding; is the tokenizer the model's own?"
        )
        return
    if config.train.draft_vocab_size > vocab and not config.train.init_from:  # it brings one
        # nothing to fix (the demo's small target meets it): the cap is automatic
        report.passed.append(
            f"train.draft_vocab_size={config.train.draft_vocab_size} is over the target's "
            f"vocab_size {vocab}: the draft vocabulary takes the tokens seen in the data"
        )
    report.passed.append(f"tokenizer ({tokens} tokens) fits the target's vocab_size {vocab}")
