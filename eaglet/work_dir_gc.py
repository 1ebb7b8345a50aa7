"""`eaglet gc WORK_DIR`: the stage folders no run uses any more, and their removal.

What the last run used is kept: each stage folder `run.json` names, and that key's `.partial`
folder (a failed run resumes it). Everything else under a stage's folder is superseded: folders
of other keys (an earlier code or config), folders set aside by `--refresh-from`
(`.replaced-…`) and partial folders of other keys. Nothing is removed without being listed
first; the caller removes only after the person said so (`--yes`). A superseded folder is also
what per-sample reuse (`eaglet.reuse`) copies from: removing it means a later change computes
every sample again.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from eaglet.run_report import RUN_FILE, read_run_record
from eaglet.stages import STAGES
from eaglet.storage import PARTIAL_SUFFIX


@dataclass(frozen=True)
class Superseded:
    folder: Path
    bytes: int


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def superseded_folders(work_dir: Path) -> list[Superseded]:
    """Every stage folder the last run did not use, with its size. Raises `ValueError` when
    the work dir has no run record (then nothing is known to be in use)."""
    run = read_run_record(work_dir)
    if run is None:
        raise ValueError(
            f"{work_dir} has no {RUN_FILE}: no run is recorded, so nothing is known to be in use; "
            "run the pipeline once first"
        )
    keep = {stage: entry.get("key") for stage, entry in run.get("stages", {}).items()}
    found = []
    for stage in STAGES:
        root = Path(work_dir) / stage
        for entry in sorted(root.iterdir()) if root.is_dir() else ():
            kept = keep.get(stage)
            if entry.is_dir() and kept and entry.name in (kept, kept + PARTIAL_SUFFIX):
                continue
            if entry.is_dir():
                found.append(Superseded(entry, folder_bytes(entry)))
    return found


def remove(folders: list[Superseded]) -> int:
    """Remove the listed folders; returns the bytes freed."""
    for item in folders:
        shutil.rmtree(item.folder)
    return sum(item.bytes for item in folders)
