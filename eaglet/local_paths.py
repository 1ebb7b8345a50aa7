"""What a model or dataset named in the config is: a local path, or a hub id.

One rule, used by config loading (which paths it makes absolute), the preflight, the download
stage and the demo: a value is a hub id only when it has a hub id's shape ("name" or
"org/name", nothing before it such as ".", "/" or "~", and for a dataset no file suffix eaglet
knows) and nothing exists at that path. Everything else is a local path, whether it exists yet
or not: `runs/demo/models/fixture` is a folder to build, never an id to download.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# "org/name" or "name": the shape of a hub model or dataset id.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# Dataset files eaglet reads itself.
DATASET_SUFFIXES = (".json", ".jsonl", ".parquet")
# File types people try that eaglet does not read: an error naming the file, not a hub lookup.
UNSUPPORTED_DATASET_SUFFIXES = (".csv", ".tsv", ".txt", ".xlsx", ".xls", ".arrow", ".gz", ".zip")
UNSUPPORTED_DATASET_SUFFIXES += (".tar", ".yaml", ".yml", ".md", ".html", ".xml", ".pkl", ".pickle")


def is_hub_id(value: str, base: str | Path = ".") -> bool:
    """`value` names something on the hub: a hub id's shape, and no file or folder at it
    (relative to `base`)."""
    return bool(HUB_ID.match(value)) and not (Path(base) / value).exists()


def is_hub_dataset(value: str, base: str | Path = ".") -> bool:
    """A dataset `path` that names a hub dataset (one with a dataset file's suffix is a
    file, read or refused by eaglet)."""
    known = DATASET_SUFFIXES + UNSUPPORTED_DATASET_SUFFIXES
    return not value.lower().endswith(known) and is_hub_id(value, base)


def absolute(value: str, base: str | Path, hub_id: bool) -> str:
    """`value` as an absolute, normalised path against `base`; unchanged when it is a hub id
    (`hub_id`, from the rule above) or already absolute."""
    if hub_id:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return os.path.normpath(path)
    return os.path.normpath(Path(base).expanduser().absolute() / path)


def same_path(a: str | Path, b: str | Path) -> bool:
    """Two local paths name the same place (relative ones against the current directory)."""
    return os.path.normpath(Path(a).expanduser().absolute()) == os.path.normpath(
        Path(b).expanduser().absolute()
    )
