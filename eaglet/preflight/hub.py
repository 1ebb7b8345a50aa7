"""What the Hugging Face hub says about an id that names no local file or folder: a target
model (`target.model`) or a dataset (`datasets[].path`), in one look of `HUB_TIMEOUT_S`;
offline (HF_HUB_OFFLINE), or when the hub does not answer, a copy in the local caches
counts.
"""

from __future__ import annotations

from pathlib import Path

from eaglet.preflight.report import first_line

HUB_TIMEOUT_S = 10.0


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
            f"be found ({first_line(exc)}): set target.model to the folder that holds the "
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
            f"({first_line(exc)}): give a local .json/.jsonl/.parquet file, or check the id, "
            "the network and HF_TOKEN (HF_HUB_OFFLINE=1 reads only the local cache)"
        )
