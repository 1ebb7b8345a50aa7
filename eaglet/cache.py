"""Cache keys: what makes a stage's output reusable, and nothing else.

key(stage) = hash(the stage's config subset, the upstream manifests' content hashes, the hash of
the source of every module the stage's work runs through). Module sources are hashed whole,
not just the task function (Prefect's TASK_SOURCE misses helpers), and files are hashed by
content, never by path, so an edited file changes the key and a moved one does not.
"""

from __future__ import annotations

import hashlib
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

from eaglet.config import PipelineConfig
from eaglet.storage import Manifest, canonical_json, sha256_file

# The modules whose source decides each stage's output. Editing any of them re-runs the stage
# and, through the upstream hashes, every stage after it; editing none re-runs nothing.
STAGE_MODULES: dict[str, tuple[str, ...]] = {
    "download": ("eaglet.datasets", "tasks.download"),
    "tokenize": ("eaglet.prompts", "tasks.tokenize"),
    "generate": ("eaglet.engines.base", "eaglet.generation", "tasks.generate"),
    "extract": ("eaglet.reasoning", "eaglet.extract", "tasks.extract"),
    "hidden_states": ("eaglet.hidden_states.hf", "tasks.hidden_states"),
    "train": (
        "eaglet.draft.train",
        "eaglet.draft.model",
        "eaglet.draft.vocab",
        "eaglet.draft.checkpoint",
        "eaglet.split",
        "tasks.train",
    ),
    "evaluate": ("eaglet.draft.evaluate", "eaglet.draft.model", "eaglet.split", "tasks.evaluate"),
}

# The generate stage also hashes the modules of the engine it runs, and only those: a fix to
# the HTTP client does not invalidate what the embedded engine generated.
ENGINE_MODULES: dict[str, tuple[str, ...]] = {
    "local": ("eaglet.engines.local",),
    "vllm": ("eaglet.engines.http", "eaglet.engines.vllm"),
    "sglang": ("eaglet.engines.http", "eaglet.engines.sglang"),
    "openai": ("eaglet.engines.http", "eaglet.engines.openai_chat"),
}

# Files of a model folder that change what the stages compute. Weights over this size are
# fingerprinted by size plus their first and last MiB: hashing 100 GB of shards on every run
# would cost minutes, and a re-exported checkpoint changes its header bytes anyway.
_FULL_HASH_LIMIT = 256 << 20


def module_source_hash(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"cannot find the source of module {module} to hash it")
    return sha256_file(Path(spec.origin))


def stage_modules(stage: str, config: PipelineConfig | None = None) -> tuple[str, ...]:
    modules = STAGE_MODULES[stage]
    if stage == "generate" and config is not None:
        modules += ENGINE_MODULES[config.generation.engine]
        if config.tokenize.regenerate == "all":  # later turns' prompts depend on the split
            modules += ("eaglet.turns", "eaglet.reasoning", "eaglet.prompts")
    return modules


def code_hash(stage: str, config: PipelineConfig | None = None) -> str:
    digest = hashlib.sha256()
    for module in stage_modules(stage, config):
        digest.update(f"{module}:{module_source_hash(module)}\n".encode())
    return digest.hexdigest()


def _file_fingerprint(path: Path) -> str:
    size = path.stat().st_size
    if size <= _FULL_HASH_LIMIT:
        return sha256_file(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        digest.update(handle.read(1 << 20))
        handle.seek(size - (1 << 20))
        digest.update(handle.read(1 << 20))
    return "sampled:" + digest.hexdigest()


@cache
def _folder_fingerprint(folder: str, mtimes: tuple[tuple[str, float], ...]) -> str:
    digest = hashlib.sha256()
    for name, _ in mtimes:
        digest.update(f"{name}:{_file_fingerprint(Path(folder) / name)}\n".encode())
    return digest.hexdigest()


def model_fingerprint(model: str, revision: str | None = None) -> str:
    """Content fingerprint of a local model folder; for a hub id, the id and revision."""
    folder = Path(model)
    if not folder.is_dir():
        return f"hub:{model}@{revision or 'main'}"
    files = sorted(
        (str(p.relative_to(folder)), p.stat().st_mtime)
        for p in folder.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    )
    return _folder_fingerprint(str(folder.resolve()), tuple(files))


def file_fingerprint(path: str) -> str:
    """Content hash of a local dataset file; hub ids are keyed by their id and revision."""
    local = Path(path)
    return _file_fingerprint(local) if local.is_file() else f"hub:{path}"


def stage_config(stage: str, config: PipelineConfig) -> dict[str, Any]:
    """The part of the configuration that can change a stage's output (and so its key)."""
    target = {"model": model_fingerprint(config.target.model, config.target.revision)}
    gen = config.generation
    subsets: dict[str, dict[str, Any]] = {
        "download": {
            "datasets": [
                {**d.model_dump(exclude={"path"}), "content": file_fingerprint(d.path)}
                for d in config.datasets
            ]
        },
        "tokenize": {"tokenize": config.tokenize.model_dump(), "target": target},
        # Endpoints, concurrency and batch size change how fast, not what is generated.
        "generate": {
            "engine": gen.engine,
            "max_tokens": gen.max_tokens,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "seed": gen.seed,
            "stop": gen.stop,
            "target": target,
        },
        "extract": {"reasoning": config.reasoning.model_dump(), "target": target},
        "hidden_states": {
            # Batching, placement and where the vllm servers are change how fast, not what.
            "hidden_states": config.hidden_states.model_dump(
                exclude={
                    "batch_size",
                    "batch_tokens",
                    "device_map",
                    "endpoints",
                    "connector_path",
                    "served_model",
                    "concurrency",
                    "request_timeout_s",
                }
            ),
            "target": target,
            "target_dtype": config.target.dtype,
        },
        "train": {"train": config.train.model_dump(), "target": target},
        "evaluate": {"evaluate": config.evaluate.model_dump(), "target": target},
    }
    return subsets[stage]


def stage_key(stage: str, config: PipelineConfig, upstream: list[Manifest]) -> str:
    payload = {
        "stage": stage,
        "config": stage_config(stage, config),
        "upstream": sorted(m.content_hash() for m in upstream),
        "code": code_hash(stage, config),
    }
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:20]
