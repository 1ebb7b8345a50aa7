"""Stage folders on disk: where a stage writes, its manifest, and the atomic rename that ends it.

A stage writes into `WORK_DIR/<stage>/<key>.partial/` and, once every file is written and
hashed, the manifest goes in and the folder is renamed to `WORK_DIR/<stage>/<key>/`. A folder
without `manifest.json` is not done. `generate` keeps its partial folder across crashes so a
rerun resumes; the other stages start their partial folder afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"


class Manifest(BaseModel):
    """What a finished stage folder holds; also the small result handed between tasks."""

    stage: str
    key: str
    path: str
    code_hash: str
    config: dict[str, Any]
    upstream: dict[str, str] = Field(default_factory=dict, description="stage -> key")
    counts: dict[str, int] = Field(default_factory=dict)
    files: dict[str, dict[str, Any]] = Field(default_factory=dict, description="sha256, bytes")
    info: dict[str, Any] = Field(default_factory=dict, description="stage-specific figures")
    started: float
    finished: float

    @property
    def folder(self) -> Path:
        return Path(self.path)

    def content_hash(self) -> str:
        return hashlib.sha256(canonical_json(self.model_dump()).encode()).hexdigest()


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: Path, value: Any) -> None:
    """Write JSON to a temporary sibling and rename it into place (never a torn file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(value, handle, indent=2, sort_keys=True, default=str)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_manifest(folder: Path) -> Manifest | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    return Manifest.model_validate_json(path.read_text())


def stage_folder(work_dir: Path, stage: str, key: str) -> Path:
    return Path(work_dir).resolve() / stage / key


@dataclass
class StageOutput:
    """What a stage body reports back: record counts and stage-specific figures."""

    counts: dict[str, int]
    info: dict[str, Any]
    # Files the body already hashed while writing them (name -> sha256, bytes): the manifest
    # takes these instead of reading the files again (terabytes of hidden-state shards).
    files: dict[str, dict[str, Any]] = field(default_factory=dict)


def _file_entry(path: Path, known: dict[str, Any] | None) -> dict[str, Any]:
    """sha256 and size of a stage file; a hash the body computed while writing is taken as
    is when the size still matches."""
    size = path.stat().st_size
    if known is not None and known.get("bytes") == size and known.get("sha256"):
        return {"sha256": known["sha256"], "bytes": size}
    return {"sha256": sha256_file(path), "bytes": size}


def run_stage(
    *,
    work_dir: Path,
    stage: str,
    key: str,
    code_hash: str,
    config: dict[str, Any],
    upstream: list[Manifest],
    body: Callable[[Path], StageOutput],
    resume_partial: bool = False,
    refresh: bool = False,
    reopen_if: Callable[[Manifest], bool] | None = None,
) -> Manifest:
    """Run `body(partial_folder)` unless the stage folder for `key` is already complete.

    The body writes its files into the partial folder; this function hashes them, writes the
    manifest and renames the folder into place, so a crash at any point leaves no folder that
    looks complete. `refresh` sets a complete folder aside (never deletes it) and runs again.
    `reopen_if(manifest)` true turns a complete folder back into the partial one, its records
    kept, so a resumable body carries on from them (the generate stage retrying its failed
    samples).
    """
    final = stage_folder(work_dir, stage, key)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if refresh and final.exists():
        os.replace(final, final.with_name(f"{key}.replaced-{int(time.time())}"))
    complete = read_manifest(final)
    if reopen_if is not None and complete is not None and reopen_if(complete):
        if partial.exists():
            raise RuntimeError(f"cannot reopen {final}: {partial} exists too; remove one of them")
        (final / MANIFEST).unlink()
        os.replace(final, partial)
        resume_partial = True
    existing = read_manifest(final)
    if existing is not None:
        return existing
    if partial.exists() and not resume_partial:
        shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    started = time.time()
    output = body(partial)
    names = [
        str(path.relative_to(partial))
        for path in sorted(partial.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    ]
    files = {name: _file_entry(partial / name, output.files.get(name)) for name in names}
    manifest = Manifest(
        stage=stage,
        key=key,
        path=str(final),
        code_hash=code_hash,
        config=config,
        upstream={m.stage: m.key for m in upstream},
        counts=output.counts,
        files=files,
        info=output.info,
        started=started,
        finished=time.time(),
    )
    write_json_atomic(partial / MANIFEST, manifest.model_dump())
    if final.exists():  # an incomplete leftover without a manifest
        shutil.rmtree(final)
    os.replace(partial, final)
    return manifest
