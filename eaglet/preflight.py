"""Preflight: every check that needs only the config, the target's `config.json` and its
tokenizer, run before the first stage (the flow) and by `eaglet doctor`.

A run lasts days; an error the config already shows must not wait for its stage. `preflight`
checks, each finding naming the config key or the file and what to do:

- `datasets`: not empty; each local file exists, is a file, and is not empty;
- `work_dir`: a folder (or creatable), writable;
- `target.model`: a local folder with `config.json` and a tokenizer, or a hub id that loads;
  a path that looks local and is missing is named as a folder, never as a hub-id error;
- weights: each `*.safetensors` file of a local target is as long as its header says
  (a cut download is found here, not at hidden_states), shards of an index exist;
- `hidden_states.aux_layer_ids` against the target's layer count (a 4-layer target's
  defaults collide: [2, 2, 1]);
- `train.init_from`: the starting draft reads this target (hidden size, vocabulary) and the
  layers this run extracts (`eaglet.draft.init_from`), and the train settings it overrides;
- the tokenizer against the target's vocabulary, and `train.draft_vocab_size`;
- `tokenize.chat_template_kwargs`: the template renders a prompt with them, and reads every
  key (a misspelt `enable_thinkng` is otherwise silently ignored); `reasoning.format` fits;
- lengths: `tokenize.max_prompt_tokens + generation.max_tokens` within the target's context;
- the disk budget of the hidden_states shards (`eaglet.hidden_states.budget`), as an upper
  bound: every sample at full length;
- the chosen hidden-state backend's own checks, owned by its module
  (`eaglet.hidden_states.backends`: the vllm backend's servers and connector folder).

`PreflightReport.raise_if_failed()` raises `PreflightError` (permanent: a retry cannot mend it)
listing every problem; warnings are printed and left to the run.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglet.config import PipelineConfig
from eaglet.errors import PermanentError
from eaglet.local_paths import is_hub_dataset, is_hub_id
from eaglet.progress import say
from eaglet.stages import STAGE, STAGES

PROBE = [{"role": "user", "content": "What is 2 + 2?"}]
MIN_FREE_BYTES = 1 << 30
HUB_TIMEOUT_S = 10.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class PreflightError(PermanentError, RuntimeError):
    """The config cannot run; the message lists every problem and its fix (`problems`: each
    in one line)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems) if problems else [message]


@dataclass
class PreflightReport:
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    recommendations: list[str] = field(default_factory=list)  # a better setting, not a fault
    tokenizer: Any = field(default=None, repr=False)  # the target's, when it loaded
    model_config: Any = field(default=None, repr=False)  # its transformers config

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        verdict = "ok" if self.ok else f"{len(self.problems)} problem(s)"
        lines = [f"preflight: {verdict}"]
        lines += [f"  ok:      {line}" for line in self.passed]
        lines += [f"  warning: {line}" for line in self.warnings]
        lines += [f"  problem: {line}" for line in self.problems]
        lines += [f"  recommend: {line}" for line in self.recommendations]
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if self.problems:
            raise PreflightError(
                "preflight found problems the config already shows (nothing was run):\n  "
                + "\n  ".join(self.problems)
                + "\n(`eaglet doctor CONFIG` runs the same checks)",
                self.problems,
            )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# --- datasets and work dir -----------------------------------------------------------------


def count_rows(path: Path) -> int | None:
    """Rows of a local dataset file, cheaply (lines of a JSONL, Parquet metadata); None when
    not cheap to know."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return None


def check_datasets(config: PipelineConfig, report: PreflightReport) -> list[int | None]:
    """Rows per dataset (its limit, or counted; None unknown)."""
    if not config.datasets:
        report.problems.append(
            "datasets: the list is empty: add at least one {source, path} to regenerate"
        )
        return []
    rows: list[int | None] = []
    for i, spec in enumerate(config.datasets):
        key = f"datasets[{i}] (source {spec.source!r})"
        if is_hub_dataset(spec.path):
            problem = hub_dataset_problem(key, spec.path, spec.revision)
            if problem:
                report.problems.append(problem)
            else:
                report.passed.append(f"{key}: hub dataset {spec.path} (read by the download stage)")
            rows.append(spec.limit)
            continue
        path = Path(spec.path)
        if not path.exists():
            report.problems.append(
                f"{key}: file {path} not found (resolved: {path.resolve()}): fix datasets[{i}].path"
            )
        elif path.is_dir():
            report.problems.append(
                f"{key}: {path} is a folder; datasets[{i}].path must name a .json, .jsonl or "
                ".parquet file"
            )
        elif not path.is_file():  # a named pipe or device: read once, by the download stage
            report.passed.append(f"{key}: {path} (not a regular file; not read here)")
        elif path.stat().st_size == 0 or (
            path.suffix.lower() in (".json", ".jsonl") and not _has_text(path)
        ):
            report.problems.append(
                f"{key}: file {path} is empty: it gives 0 samples; fill it or remove datasets[{i}]"
            )
        else:
            try:
                counted = count_rows(path)
            except Exception as exc:  # a damaged Parquet footer, unreadable file
                report.problems.append(f"{key}: file {path} cannot be read ({_first_line(exc)})")
                rows.append(None)
                continue
            if counted == 0:
                report.problems.append(f"{key}: file {path} holds no rows: fill it or remove it")
            n = counted if spec.limit is None or counted is None else min(counted, spec.limit)
            rows.append(n)
            report.passed.append(f"{key}: {path} ({'?' if n is None else n} rows)")
            continue
        rows.append(None)
    return rows


def check_eval_sets(config: PipelineConfig, report: PreflightReport) -> None:
    """Each named evaluation set's file is there and in its format (read now: sets are small),
    rather than failing after training."""
    from eaglet.eval_sets import EvalSetError, read_set

    for i, spec in enumerate(config.evaluate.sets):
        key = f"evaluate.sets[{i}] ({spec.name})"
        if is_hub_dataset(spec.path) and not Path(spec.path).exists():
            report.passed.append(f"{key}: hub dataset {spec.path} (read by the evaluate stage)")
            continue
        if not Path(spec.path).is_file():
            report.problems.append(
                f"{key}: file {spec.path} not found: fix evaluate.sets[{i}].path, or remove the "
                "set (evaluate.sets: [] measures the held-out prompts only)"
            )
            continue
        try:
            prompts = read_set(spec)
        except (EvalSetError, OSError, ValueError) as exc:
            report.problems.append(f"{key}: {_first_line(exc)}")
            continue
        if not prompts:
            report.problems.append(f"{key}: {spec.path} holds no prompts")
        else:
            report.passed.append(f"{key}: {spec.path} ({len(prompts)} prompts)")


def check_holdout(config: PipelineConfig, rows: list[int | None], report: PreflightReport) -> None:
    """evaluate measures τ on the held-out samples: none held out fails it after training."""
    fraction = config.train.holdout_fraction
    if fraction == 0:
        report.problems.append(
            "train.holdout_fraction=0 holds no sample out, and evaluate measures the draft on "
            "held-out samples: set it above 0 (0.05 is usual), or run --until train"
        )
        return
    if rows and all(r is not None for r in rows):
        expected = sum(rows) * fraction  # type: ignore[arg-type]
        if expected < 1:  # the split is by id hash: some may still be held out
            report.warnings.append(
                f"train.holdout_fraction={fraction:g} of at most {sum(rows)} samples holds out "
                f"{expected:.2f} on average: evaluate may find none after training; raise it "
                f"to at least {min(1.0, 2 / max(1, sum(rows))):.2g} or add samples"  # type: ignore[arg-type]
            )


def _has_text(path: Path) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return True
    return False


def check_work_dir(config: PipelineConfig, report: PreflightReport) -> None:
    work_dir = Path(config.work_dir)
    if work_dir.exists() and not work_dir.is_dir():
        report.problems.append(
            f"work_dir: {work_dir} is a file, not a folder: set work_dir to a folder (every "
            "stage writes there)"
        )
        return
    existing = next((p for p in [work_dir, *work_dir.parents] if p.exists()), Path("."))
    if not existing.is_dir():
        report.problems.append(
            f"work_dir: {work_dir} cannot be created: {existing} is a file; set work_dir elsewhere"
        )
        return
    if not os.access(existing, os.W_OK | os.X_OK):
        report.problems.append(
            f"work_dir: {existing} is not writable by this user: set work_dir to a folder "
            "you can write"
        )
        return
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        report.problems.append(
            f"work_dir: only {free / 2**30:.2f} GiB free under {existing.resolve()}: free "
            "space or move work_dir"
        )
        return
    report.passed.append(f"work_dir {work_dir}: usable, {free / 2**30:.1f} GiB free")


# --- the target ------------------------------------------------------------------------------


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
            report.problems.append(f"{index}: not a valid index ({_first_line(exc)})")
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


def hub_lookup_problem(model: str, revision: str | None) -> str | None:
    """Why the hub id `model` cannot be used (not found, hub unreachable and not cached), or
    None when it can. Offline mode (HF_HUB_OFFLINE) looks in the local cache only."""
    import huggingface_hub
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        cached = huggingface_hub.try_to_load_from_cache(model, "config.json", revision=revision)
        if isinstance(cached, str):
            return None
        return (
            f"target.model={model!r}: no such local folder, and HF_HUB_OFFLINE is set while no "
            "copy of this hub model is in the local cache: download it first on a machine "
            "that reaches the hub (a gated model such as Llama needs access granted and "
            "HF_TOKEN), or set target.model to the folder that holds the model"
        )
    try:
        huggingface_hub.model_info(model, revision=revision, timeout=HUB_TIMEOUT_S)
        return None
    except Exception as exc:
        cached = huggingface_hub.try_to_load_from_cache(model, "config.json", revision=revision)
        if isinstance(cached, str):
            return None
        return (
            f"target.model={model!r}: no such local folder, and as a hub model id it could not "
            f"be found ({_first_line(exc)}): set target.model to the folder that holds the "
            "model, or check the id, target.revision, the network and HF_TOKEN"
        )


def dataset_cached(path: str, revision: str | None) -> bool:
    """Whether a copy of the hub dataset `path` is on this machine: a snapshot in the hub's
    cache, or a prepared copy in datasets' own cache (`HF_DATASETS_CACHE`), which
    `load_dataset` reads offline."""
    import huggingface_hub

    try:
        huggingface_hub.snapshot_download(
            path, repo_type="dataset", revision=revision, local_files_only=True
        )
        return True
    except Exception:
        pass
    try:
        from datasets import config as datasets_config

        cache = Path(datasets_config.HF_DATASETS_CACHE)
    except Exception:
        return False
    return (cache / path.replace("/", "___")).is_dir()


def hub_dataset_problem(key: str, path: str, revision: str | None) -> str | None:
    """Why the hub dataset `path` cannot be read (not found, or the hub unreachable and no
    cached copy), in one look of HUB_TIMEOUT_S; None when it can. Offline mode trusts the
    cache."""
    import huggingface_hub
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        if dataset_cached(path, revision):
            return None
        return (
            f"{key}: {path!r} is no local file, and HF_HUB_OFFLINE is set while no copy of "
            "this hub dataset is in the local caches (the hub's and datasets'): unset "
            "HF_HUB_OFFLINE on a machine that reaches the hub, or give a local "
            ".json/.jsonl/.parquet file"
        )
    try:
        huggingface_hub.dataset_info(path, revision=revision, timeout=HUB_TIMEOUT_S)
        return None
    except Exception as exc:
        if dataset_cached(path, revision):
            return None  # cached: the download stage reads the copy
        return (
            f"{key}: {path!r} is no local file, and as a hub dataset id it could not be found "
            f"({_first_line(exc)}): give a local .json/.jsonl/.parquet file, or check the id, "
            "the network and HF_TOKEN (HF_HUB_OFFLINE=1 reads only the local cache)"
        )


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
                f"target.model: its config.json could not be read ({_first_line(exc)}): "
                + config_advice(exc)
            )
            return
    try:
        report.tokenizer = load_tokenizer(config.target)
    except Exception as exc:  # transformers raises many kinds here
        if path.exists():
            report.problems.append(
                f"target.model: no tokenizer could be loaded from the folder {model} "
                f"({_first_line(exc)}): copy the tokenizer files (tokenizer.json, "
                "tokenizer_config.json) into it"
            )
        else:
            report.problems.append(
                f"target.model={model!r}: no such local folder, and as a hub model id it could "
                f"not be loaded ({_first_line(exc)}): set target.model to the folder that holds "
                "the model, or check the id, target.revision, the network and HF_TOKEN / "
                "HF_HUB_OFFLINE"
            )
        return
    if report.model_config is None:
        return
    report.passed.append(f"target.model {model}: config and tokenizer load")


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


def check_method(config: PipelineConfig, model_config: Any, report: PreflightReport) -> None:
    """The draft method's own constraints (`DraftMethod.problems`), and settings of another
    method set away from their defaults: with this method they would do nothing."""
    from eaglet.config import TrainConfig
    from eaglet.draft.methods import draft_method
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
    if method.name != "dflash" and config.train.dflash != defaults.dflash:
        found.append(
            f"train.dflash is set but train.method={method.name}: the settings would do "
            "nothing; remove them, or set train.method=dflash"
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
        return f"{path}: not a readable safetensors file ({_first_line(exc)})"
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


def check_template(config: PipelineConfig, tokenizer: Any, report: PreflightReport) -> None:
    from eaglet.reasoning import detect_format

    kwargs = config.tokenize.chat_template_kwargs
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        report.problems.append(
            "target.model: the tokenizer has no chat template: eaglet renders prompts with "
            "it; use a chat (instruct/reasoning) model or add chat_template to its "
            "tokenizer_config.json"
        )
        return
    texts = template if isinstance(template, str) else json.dumps(template)
    unread = [key for key in kwargs if key not in texts]
    if unread:
        report.problems.append(
            f"tokenize.chat_template_kwargs: the target's chat template never reads {unread} "
            f"(misspelt? it is ignored silently, so the prompts would not be what you meant): "
            "fix or remove the key"
        )
    try:
        text = tokenizer.apply_chat_template(
            PROBE, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception as exc:
        report.problems.append(
            f"tokenize.chat_template_kwargs={kwargs}: the chat template cannot render a "
            f"prompt with them ({_first_line(exc)})"
        )
        return
    effort_problem = _plan_effort_problem(config, tokenizer, texts)
    if effort_problem:
        report.problems.append(effort_problem)
    try:
        reasoning_format = detect_format(tokenizer, config.reasoning.format, kwargs)
    except ValueError as exc:
        report.problems.append(f"reasoning.format: {exc}: set reasoning.format to auto or none")
        return
    if not unread:
        report.passed.append(
            f"chat template renders a prompt ({len(text)} chars) with {kwargs or 'no kwargs'}; "
            f"reasoning format {reasoning_format.name}"
        )


def _plan_effort_problem(config: PipelineConfig, tokenizer: Any, template: str) -> str | None:
    """Why the sampling plan's reasoning efforts would not reach the prompts (None when each
    one renders a prompt of its own): a template that never reads `reasoning_effort`, or two
    efforts that render the same prompt. Every record would claim an effort it never had."""
    efforts = sorted({e.reasoning_effort for e in config.generation.sampling_plan} - {""})
    if not efforts:
        return None
    setting = f"generation.sampling_plan (reasoning_effort {', '.join(efforts)})"
    if "reasoning_effort" not in template:
        return (
            f"{setting}: the target's chat template never reads reasoning_effort, so every "
            "prompt would be the same whatever the plan says: remove reasoning_effort from "
            "the plan's entries, or use a target whose template reads it (gpt-oss)"
        )
    kwargs = config.tokenize.chat_template_kwargs
    rendered: dict[str, str] = {}
    for effort in efforts:
        try:
            text = tokenizer.apply_chat_template(
                PROBE, add_generation_prompt=True, tokenize=False,
                **{**kwargs, "reasoning_effort": effort},
            )  # fmt: skip
        except Exception as exc:
            return f"{setting}: the chat template cannot render {effort} ({_first_line(exc)})"
        same = next((e for e, t in rendered.items() if t == text), None)
        if same is not None:
            return (
                f"{setting}: the chat template renders the same prompt for reasoning_effort "
                f"{same} and {effort}: keep one of them"
            )
        rendered[effort] = text
    return None


def check_lengths(config: PipelineConfig, model_config: Any, report: PreflightReport) -> None:
    from eaglet.prompt_rendering import context_length

    context = context_length(model_config)
    if context is None:
        report.warnings.append("the target's config names no context length; lengths not checked")
        return
    prompt, output = config.tokenize.max_prompt_tokens, config.generation.max_tokens
    if prompt + output > context:
        report.problems.append(
            f"tokenize.max_prompt_tokens ({prompt}) + generation.max_tokens ({output}) = "
            f"{prompt + output} exceeds the target's context of {context} tokens "
            "(max_position_embeddings): lower one of them"
        )
        return
    report.passed.append(f"max lengths {prompt} + {output} fit the context of {context}")


def check_disk_budget(
    config: PipelineConfig, model_config: Any, rows: list[int | None], report: PreflightReport
) -> None:
    """The hidden_states shards' upper bound (every sample at full length) against the free
    space; a warning when it may not fit (real lengths are known only after generation)."""
    from eaglet.hidden_states.budget import disk_budget, human

    if config.train.hidden_states == "online":
        report.passed.append("disk budget: online training stores no hidden-state shards")
        return
    hidden = getattr(model_config, "hidden_size", None)
    if not rows or not isinstance(hidden, int):
        return
    if any(r is None for r in rows):
        report.warnings.append(
            "disk budget: the number of samples is not known before download (a hub dataset "
            "without limit); checked by the hidden_states stage"
        )
        return
    per_sample = config.tokenize.max_prompt_tokens + config.generation.max_tokens
    tokens = sum(rows) * per_sample
    storage = config.hidden_states.storage
    try:
        budget = disk_budget(Path(config.work_dir), tokens, hidden, storage)
    except (ValueError, OSError) as exc:
        report.warnings.append(f"disk budget: not checked ({_first_line(exc)})")
        return
    line = (
        f"disk budget: hidden_states needs at most {human(budget.needed)} ({sum(rows)} "
        f"samples x {per_sample} tokens, storage {storage}); {human(budget.free)} free under "
        f"{budget.path}"
    )
    if budget.fits:
        report.passed.append(line)
        return
    report.warnings.append(
        f"{line}: may not fit (an upper bound); the hidden_states stage checks the real "
        "figure before it writes. Options: datasets[].limit, shorter max lengths, "
        "hidden_states.storage=int8, another disk"
    )
    report.recommendations.append(
        "use online training (train.hidden_states=online): the draft then gets the "
        "target's hidden states batch by batch while it trains and stores none, "
        f"saving up to {human(budget.needed)} here"
    )


def check_vllm_python(config: PipelineConfig, report: PreflightReport) -> None:
    """The vLLM python the serving check starts a server with names an executable: the server
    starts only at the evaluate stage, hours into a run (the hidden-state backend's is its
    own check, `check_hidden_states_backend`)."""
    wanted = {
        "evaluate.vllm_python": config.evaluate.serving == "vllm"
        and not config.evaluate.serving_endpoint
        and config.evaluate.vllm_python,
    }
    for setting, python in wanted.items():
        if not python:
            continue
        if Path(python).is_file() and os.access(python, os.X_OK):
            report.passed.append(f"{setting} {python}: executable")
        else:
            report.problems.append(
                f"{setting}: {python} is not an executable file: give the python of a venv "
                "with vLLM installed (e.g. .vllm-venv/bin/python)"
            )
    if wanted["evaluate.vllm_python"] and config.evaluate.temperature > 0:
        import torch

        if not torch.cuda.is_available():  # the vLLM eaglet starts here is its CPU build
            report.problems.append(
                f"evaluate.temperature={config.evaluate.temperature:g} with evaluate.serving="
                "vllm on a vLLM eaglet starts on this CPU: vLLM 0.32's CPU build verifies sampled "
                "drafts wrongly (its _expand_kernel_impl casts each request's temperature to "
                "an integer), so the served check would fail after the whole run; set "
                "evaluate.temperature: 0, evaluate.serving: none, or a GPU server in "
                "evaluate.serving_endpoint"
            )


ENDPOINT_TIMEOUT_S = 5.0


def vllm_endpoint_problem(setting: str, url: str) -> str | None:
    """Why `url` is not a vLLM server that answers (refused, timed out, no `/v1/models`), in
    one line naming `setting` and the URL; None when it answers as vLLM does."""
    import httpx

    probe = f"{url}/v1/models"
    try:
        response = httpx.get(probe, timeout=ENDPOINT_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return (
            f"{setting}: {url} does not answer (GET {probe}: {_first_line(exc)}): start the "
            "server, fix the URL, or leave it unset so that eaglet starts one (vllm_python)"
        )
    try:
        models = response.json().get("data") if response.status_code == 200 else None
    except ValueError:
        models = None
    if not isinstance(models, list):
        return (
            f"{setting}: {url} answers, but not as a vLLM server (GET {probe}: HTTP "
            f"{response.status_code}): point it at vLLM's OpenAI API server"
        )
    return None


def not_vllm_problem(setting: str, url: str, needed: str, instead: str) -> str | None:
    """Why `url` is not vLLM: no Prometheus `/metrics` with vLLM's `vllm:` series (any
    OpenAI-compatible server answers /v1/models too). `needed` says what needs vLLM,
    `instead` what to do."""
    import httpx

    try:
        response = httpx.get(f"{url}/metrics", timeout=ENDPOINT_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return f"{setting}: GET {url}/metrics failed ({_first_line(exc)}): {needed}"
    if response.status_code != 200 or "vllm:" not in response.text:
        return (
            f"{setting}: {url} answers /v1/models but is not vLLM (its /metrics, HTTP "
            f"{response.status_code}, has no vLLM counters): {needed}; {instead}"
        )
    return None


SERVED_TAU_NEEDS = "served τ is read from vLLM's spec-decode counters"
SERVED_TAU_INSTEAD = (
    "point it at a vLLM server started with the draft, or set evaluate.serving: none"
)


def _tcp_problem(setting: str, address: str) -> str | None:
    import socket

    host_port = address.split("://", 1)[-1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=ENDPOINT_TIMEOUT_S):
            return None
    except ValueError:
        return f"{setting}: {address!r} has no port; write tcp://host:8786"
    except OSError as exc:
        return (
            f"{setting}: nothing answers at {address} ({exc.strerror or exc}): start the "
            "Dask scheduler, fix the address, or leave it unset for a local cluster"
        )


def check_hidden_states_backend(config: PipelineConfig, report: PreflightReport) -> None:
    """The chosen hidden-state backend's own checks (its servers, its settings), owned by its
    module (`eaglet.hidden_states.backends`)."""
    from eaglet.hidden_states.backends import hidden_states_backend

    hidden_states_backend(config.hidden_states.backend).preflight(config, report)


def check_endpoints(config: PipelineConfig, report: PreflightReport) -> None:
    """Servers the later stages will use, checked now rather than hours into the run: the
    serving check's running server and a Dask scheduler. The generation servers are the
    canary's (the first minute of generate); the hidden-state backend's are its own check."""
    url = config.evaluate.serving_endpoint
    if config.evaluate.serving == "vllm" and url:
        setting = "evaluate.serving_endpoint"
        problem = vllm_endpoint_problem(setting, url) or not_vllm_problem(
            setting, url, SERVED_TAU_NEEDS, SERVED_TAU_INSTEAD
        )
        if problem:
            report.problems.append(problem)
        else:
            report.passed.append(f"{setting} {url}: a vLLM server answers")
    execution = config.execution
    if execution.task_runner == "dask" and execution.dask_address:
        problem = _tcp_problem("execution.dask_address", execution.dask_address)
        if problem:
            report.problems.append(problem)
        else:
            report.passed.append(f"execution.dask_address {execution.dask_address}: answers")


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bf16 units


def cpu_has_bf16_units(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether the CPU computes in bfloat16 natively (Linux's CPU flags); None when unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), None)  # fmt: skip
    return None if flags is None else any(flag in flags for flag in CPU_BF16_FLAGS)


def check_devices(
    config: PipelineConfig, report: PreflightReport, bf16_units: bool | None = None
) -> None:
    """A CUDA device asked for where torch sees none fails now, not at the stage that uses it;
    a dtype the device computes slowly is a warning (`bf16_units`: whether the CPU has
    bfloat16 units, read from /proc/cpuinfo when not given)."""
    import torch

    settings = {"target.device": config.target.device, "train.device": config.train.device}
    for setting, device in settings.items():
        if device.startswith("cuda") and not torch.cuda.is_available():
            report.problems.append(
                f"{setting}={device}: torch sees no CUDA device on this machine "
                f"(torch {torch.__version__}); use cpu, or auto for the GPU when there is one"
            )
    on_cpu = {
        setting: device == "cpu" or device == "auto" and not torch.cuda.is_available()
        for setting, device in settings.items()
    }
    bf16_units = cpu_has_bf16_units() if bf16_units is None else bf16_units
    slow_bf16 = (
        "this CPU has no bfloat16 units (no avx512_bf16 or amx_bf16 among its flags): torch "
        "emulates bfloat16 on it, often a hundred times slower than float32"
    )
    from eaglet.target import target_dtype

    dtype = target_dtype(config.target)  # what auto picks never warns
    if on_cpu["target.device"] and dtype == "bfloat16" and bf16_units is False:
        report.warnings.append(f"target.dtype=bfloat16 on the CPU: {slow_bf16}; use float32")
    if on_cpu["target.device"] and dtype == "float16":
        report.problems.append(
            "target.dtype=float16 on the CPU: the CPU has no float16 arithmetic (slow, "
            "float16's range overflows, and evaluate's float32 draft cannot read float16 "
            "states); use float32 (or auto), or bfloat16 on a CPU with bfloat16 units"
        )
    if on_cpu["train.device"] and config.train.precision == "bfloat16" and bf16_units is False:
        report.warnings.append(f"train.precision=bfloat16 on the CPU: {slow_bf16}; use float32")


def preflight(config: PipelineConfig, until: str = STAGES[-1]) -> PreflightReport:
    """Every check that needs only the config, the target's config.json and tokenizer; see
    the module docstring. Never raises for a bad config: the report lists the problems.
    `until`: the last stage the run will run (checks of later stages are left out)."""
    report = PreflightReport()
    rows = check_datasets(config, report)
    if any(STAGE[stage].evaluates for stage in STAGES[: STAGES.index(until) + 1]):
        check_holdout(config, rows, report)
        check_eval_sets(config, report)
    check_work_dir(config, report)
    check_vllm_python(config, report)
    check_devices(config, report)
    check_hidden_states_backend(config, report)
    check_endpoints(config, report)
    load_target(config, report)
    model_config, tokenizer = report.model_config, report.tokenizer
    if model_config is not None:
        check_layers(config, model_config, report)
        check_method(config, model_config, report)
        check_lengths(config, model_config, report)
        check_init_from(config, model_config, report)
    if tokenizer is not None:
        check_template(config, tokenizer, report)
        if model_config is not None:
            check_vocab(config, model_config, tokenizer, report)
    if model_config is not None:
        check_disk_budget(config, model_config, rows, report)
    return report


def run_preflight(
    config: PipelineConfig, log: Callable[[str], None] = say, until: str = STAGES[-1]
) -> PreflightReport:
    """The flow's one call before its first stage: `preflight(config)`, its report logged, a
    `PreflightError` raised on any problem. It only checks: whoever runs the demo's config
    builds its model and data first (`eaglet.fixture.demo.ensure_demo_inputs`)."""
    report = preflight(config, until)
    log(report.render())
    report.raise_if_failed()
    return report


# config (as JSON) -> the report lines of a preflight that passed before its flow run existed
_PASSED_AHEAD: dict[str, list[str]] = {}


def run_preflight_ahead(config: PipelineConfig, until: str = STAGES[-1]) -> None:
    """`eaglet run`'s preflight, before Prefect loads and while its temporary server starts:
    a problem raises `PreflightError` in seconds, its report printed first; a pass is kept
    for the flow to log (`take_passed_ahead`) instead of checking again."""
    lines: list[str] = []
    try:
        run_preflight(config, log=lines.append, until=until)
    except PreflightError:
        print("\n".join(lines))
        raise
    _PASSED_AHEAD[config.model_dump_json()] = lines


def take_passed_ahead(config: PipelineConfig) -> list[str] | None:
    """The report lines of `config`'s preflight when `run_preflight_ahead` passed it, once."""
    return _PASSED_AHEAD.pop(config.model_dump_json(), None)
