"""Stage folders on disk: where a stage writes, its manifest, and the atomic rename that ends it.

A stage writes into `WORK_DIR/<stage>/<key>.partial/` and, once every file is written and
hashed, the manifest goes in and the folder is renamed to `WORK_DIR/<stage>/<key>/`. A folder
without `manifest.json` is not done. `generate` keeps its partial folder across crashes so a
rerun resumes; the other stages start their partial folder afresh.

A manifest names its folder relative to the work dir (`<stage>/<key>`): readers resolve it
with `stage_dir(work_dir, manifest)`, so a work dir copied elsewhere is used where it is.
A complete folder is checked before it is used again (`verify_files`): every file's size
always, its sha256 when the file is small enough to hash cheaply or `EAGLET_VERIFY=full`;
a manifest that is not valid JSON, or was edited (its checksum), is a `ManifestError`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from eaglet.errors import PermanentError
from eaglet.records.io import record_file_problems

MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
# EAGLET_VERIFY: "size" checks sizes only, "auto" (default) also hashes files up to
# HASH_LIMIT_BYTES, "full" hashes every file.
VERIFY_ENV = "EAGLET_VERIFY"
VERIFY_MODES = ("size", "auto", "full")
HASH_LIMIT_BYTES = 64 << 20
# ... and at most this many bytes per folder in all (a stage of many small shards is checked
# by size beyond it), so reusing a finished stage stays cheap.
HASH_BUDGET_BYTES = 256 << 20


class ManifestError(PermanentError, ValueError):
    """A manifest that cannot be read or was changed by hand; the message names its path."""


class StageCorruptError(PermanentError, ValueError):
    """A complete stage folder whose files differ from its manifest; the message names each
    file, the expected and actual size or hash, and the stage to refresh."""


class SealError(PermanentError, ValueError):
    """A stage's record file that is not one record per sample id, or not as many records as
    the stage counted: the folder stays `.partial` (never sealed); the message names each line."""


LATER_FIELDS = ("code_modules", "upstream_outputs", "why", "read_later")


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
    checksum: str | None = Field(
        None, description="sha256 of the manifest without this field: a hand edit shows"
    )
    # Why the stage ran and what it ran on (`eaglet.stage_reasons`); older manifests lack them.
    code_modules: dict[str, str] = Field(
        default_factory=dict, description="module -> sha256 of the code that wrote it"
    )
    upstream_outputs: dict[str, str] = Field(
        default_factory=dict, description="stage -> output_hash of what it read"
    )
    why: list[str] = Field(default_factory=list, description="why it ran, one reason a line")
    read_later: list[str] = Field(
        default_factory=list,
        description="globs of the files later stages read (`Stage.read_later`); empty: all",
    )

    def folder_in(self, work_dir: str | Path) -> Path:
        """The stage folder this manifest describes, inside `work_dir`."""
        return stage_folder(Path(work_dir), self.stage, self.key)

    def own_checksum(self) -> str:
        # Fields added after manifests were first written count only when set, so an older
        # manifest still checks out.
        later = {name for name in LATER_FIELDS if not getattr(self, name)}
        return hashlib.sha256(
            canonical_json(self.model_dump(exclude={"checksum"} | later)).encode()
        ).hexdigest()

    def output_hash(self) -> str:
        """What the stage wrote for later stages, by content: the sha256 and size of the files
        they read (`Stage.read_later`: train's draft, not its timings) and its counts. A
        later stage's key holds this, not this stage's key, so a stage that ran again (a code
        edit) and wrote the same bytes leaves every later stage Cached (early cutoff)."""
        files = self.files
        if self.read_later:
            files = {n: e for n, e in files.items() if any(fnmatch(n, g) for g in self.read_later)}
        written = {"stage": self.stage, "files": files, "counts": self.counts}
        return hashlib.sha256(canonical_json(written).encode()).hexdigest()


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
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(value, handle, indent=2, sort_keys=True, default=str)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: no orphaned temporary file (its name is ours)
        tmp.unlink(missing_ok=True)
        raise


class DiskFullError(PermanentError, OSError):
    """No space left on the device a stage writes to; unlike the OS error, the message names
    the folder and what to do."""


def is_disk_full(exc: BaseException) -> bool:
    """An ENOSPC, as the OS error or as a library's own error that carries it (safetensors'
    Rust writer raises a `SafetensorError` "... No space left on device (os error 28)"),
    itself or in its chain of `raise ... from` causes."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if "(os error 28)" in str(exc):
            return True
        exc = exc.__cause__
    return False


@contextmanager
def naming_a_full_disk(folder: Path) -> Iterator[None]:
    """Raise an ENOSPC from the block again as a `DiskFullError` naming `folder`."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, DiskFullError) or not is_disk_full(exc):
            raise
        raise DiskFullError(
            errno.ENOSPC,
            f"No space left on device while writing {folder}: free space on its filesystem "
            "(or move work_dir), then run the same command again; the partial folder is kept "
            "and nothing in it is taken as done",
        ) from exc


def replace_folder(tmp: Path, final: Path) -> None:
    """Move the finished folder `tmp` to `final`, replacing what is there: the old folder is
    renamed aside first and removed after, so `final` is always either the old folder or the
    new one, never half of each. (The one atomic folder swap of eaglet.)"""
    tmp, final = Path(tmp), Path(final)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """Yield an empty sibling folder to write into; when the block ends without an error, it
    replaces `final` (which is never seen half-written). On an error the sibling is removed."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_folder(tmp, final)


def read_manifest(folder: Path) -> Manifest | None:
    """The manifest of a complete stage folder; None when the folder is not complete.

    A manifest that is not valid JSON, not a manifest, or edited by hand since it was
    written is a `ManifestError` naming its path and the stage to refresh."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    stage = Path(folder).parent.name
    advice = (
        f"the folder {folder} cannot be trusted: rerun with --refresh-from {stage} "
        "(it is set aside, not deleted)"
    )
    try:
        manifest = Manifest.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        what = "not valid JSON" if error["type"].startswith("json") else "not a stage manifest"
        raise ManifestError(
            f"{path}: {what} ({error['msg']}{f' at {where}' if where else ''}); {advice}"
        ) from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot be read ({exc}); {advice}") from None
    if manifest.checksum is not None and manifest.checksum != manifest.own_checksum():
        raise ManifestError(
            f"{path}: edited since the stage wrote it (its checksum no longer matches); {advice}"
        )
    return manifest


def stage_dir(work_dir: str | Path, manifest: Manifest | dict[str, Any]) -> Path:
    """The folder a stage's manifest (or the manifest dict a task returned) describes, in
    `work_dir`: manifests name folders relative to the work dir, so a copied work dir reads
    its own files."""
    if isinstance(manifest, Manifest):
        return manifest.folder_in(work_dir)
    return stage_folder(Path(work_dir), manifest["stage"], manifest["key"])


def verify_files(folder: Path, manifest: Manifest, mode: str | None = None) -> list[str]:
    """What differs between a complete stage folder and its manifest, one line per file:
    missing, another size, another sha256 (hashed when `mode` is "full", or "auto" and the
    file is at most HASH_LIMIT_BYTES, up to HASH_BUDGET_BYTES per folder). Empty when the
    folder holds what its manifest says."""
    mode = mode or os.environ.get(VERIFY_ENV) or "auto"
    if mode not in VERIFY_MODES:
        raise ValueError(f"{VERIFY_ENV}={mode!r}: use one of {', '.join(VERIFY_MODES)}")
    problems = []
    hashed = 0
    for name, entry in sorted(manifest.files.items()):
        path = Path(folder) / name
        expected = entry.get("bytes")
        if not path.is_file():
            problems.append(f"{path}: missing (the manifest lists {expected} bytes)")
            continue
        size = path.stat().st_size
        if expected is not None and size != expected:
            problems.append(f"{path}: {size} bytes, the manifest says {expected}")
            continue
        wanted = entry.get("sha256")
        affordable = size <= HASH_LIMIT_BYTES and hashed + size <= HASH_BUDGET_BYTES
        if wanted and (mode == "full" or (mode == "auto" and affordable)):
            hashed += size
            actual = sha256_file(path)
            if actual != wanted:
                problems.append(f"{path}: sha256 {actual}, the manifest says {wanted}")
    return problems


def check_stage_folder(folder: Path, mode: str | None = None) -> Manifest | None:
    """The manifest of a complete stage folder whose files match it; None when the folder is
    not complete. Raises `ManifestError` or `StageCorruptError` (naming every file that
    differs and the stage to refresh) when it cannot be trusted."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    problems = verify_files(folder, manifest, mode)
    if problems:
        raise StageCorruptError(
            f"the complete {manifest.stage} folder {Path(folder)} does not hold what its "
            f"manifest says:\n  {_listed(problems)}\nrerun with --refresh-from {manifest.stage} to "
            "rebuild it (the folder is set aside, not deleted)"
        )
    return manifest


def reusable_stage(work_dir: Path, stage: str, key: str) -> bool:
    """True when `WORK_DIR/<stage>/<key>` is complete and holds what its manifest says: the
    cache policy reports a stage as Cached only then (otherwise the task runs, and
    `run_stage` says what is wrong)."""
    try:
        return check_stage_folder(stage_folder(work_dir, stage, key)) is not None
    except (ManifestError, StageCorruptError):
        return False


def stage_folder(work_dir: Path, stage: str, key: str) -> Path:
    return Path(work_dir).resolve() / stage / key


def finished_folder(folder: Path) -> Path:
    """Where a stage's `.partial` folder will be once it finishes (what a message should
    name: the partial folder is gone by the time a person reads it)."""
    return folder.with_name(folder.name.removesuffix(PARTIAL_SUFFIX))


def final_path(path: Path) -> Path:
    """`path` inside a stage's `.partial` folder, as it will be once the stage finishes."""
    for parent in path.parents:
        if parent.name.endswith(PARTIAL_SUFFIX):
            return finished_folder(parent) / path.relative_to(parent)
    return path


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


_REFRESHED: set[Path] = set()  # stage folders this process already set aside for a refresh


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
    records_file: str | None = None,
    code_modules: dict[str, str] | None = None,
    why: list[str] | None = None,
    warn: Callable[[str], None] | None = None,
    read_later: tuple[str, ...] = (),
) -> Manifest:
    """Run `body(partial_folder)` unless the stage folder for `key` is already complete.

    The body writes its files into the partial folder; this function hashes them, writes the
    manifest and renames the folder into place, so a crash at any point leaves no folder that
    looks complete. `refresh` sets a complete folder aside (never deletes it) and runs again.
    `reopen_if(manifest)` true turns a complete folder back into the partial one, its records
    kept, so a resumable body carries on from them (the generate stage retrying its failed
    samples). `records_file` (a JSONL file the body writes) is checked before sealing: one
    line per sample id, as many lines as the body's `records` count (`SealError` otherwise).
    A stage folder with files but no manifest (deleted, or a copy cut short) is never rebuilt
    silently: a resumable stage carries on from its files as a partial folder, and `warn` is
    told either way. `read_later`: the globs of the files later stages read, which alone its
    output hash covers (`Manifest.output_hash`).
    """
    final = stage_folder(work_dir, stage, key)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if refresh and final not in _REFRESHED:  # start over, whatever either folder holds; a
        _REFRESHED.add(final)  # retry of the same task in this process resumes what it wrote
        for folder, name in ((final, f"{key}.replaced-"), (partial, f"{key}.replaced-partial-")):
            if folder.exists():
                os.replace(folder, folder.with_name(f"{name}{time.time_ns()}"))
    complete = check_stage_folder(final)
    if reopen_if is not None and complete is not None and reopen_if(complete):
        _reopen(final, partial)
        resume_partial = True
    existing = read_manifest(final)  # checked above
    if existing is not None:
        return existing
    _take_up_unsealed(stage, final, partial, resume_partial, warn or (lambda line: None))
    if partial.exists() and not resume_partial:
        shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with naming_a_full_disk(partial):
        output = body(partial)
    if records_file is not None:
        _check_records(stage, partial / records_file, output.counts.get("records"))
    files = _hashed_files(partial, output)
    manifest = Manifest(
        stage=stage,
        key=key,
        path=f"{stage}/{key}",  # relative to the work dir: a copied work dir reads its own files
        code_hash=code_hash,
        config=config,
        upstream={m.stage: m.key for m in upstream},
        counts=output.counts,
        files=files,
        info=output.info,
        started=started,
        finished=time.time(),
        code_modules=code_modules or {},
        upstream_outputs={m.stage: m.output_hash() for m in upstream},
        why=why or [],
        read_later=list(read_later),
    )
    _publish(manifest, partial, final)
    return manifest


def _take_up_unsealed(
    stage: str, final: Path, partial: Path, resumable: bool, warn: Callable[[str], None]
) -> None:
    """A stage folder holding files but no manifest: a resumable stage's becomes the partial
    folder (its finished work kept, checked by the body as any partial folder's is); any other
    is built again. Both are said."""
    if not final.is_dir() or not any(final.iterdir()):
        return
    missing = f"{stage}: {final} holds files but no {MANIFEST} (deleted, or a copy cut short)"
    if resumable and not partial.exists():
        os.replace(final, partial)
        warn(f"{missing}: not trusted as finished; carrying on from its files as a partial folder")
    else:
        warn(f"{missing}: not trusted as finished; {stage} runs again and replaces it")


def _listed(problems: list[str], most: int = 20) -> str:
    """The first `most` problems, one per indented line, and how many more there are."""
    more = f"\n  ... and {len(problems) - most} more" if len(problems) > most else ""
    return "\n  ".join(problems[:most]) + more


def _check_records(stage: str, path: Path, expected: int | None) -> None:
    problems = record_file_problems(path, expected) if path.is_file() else []
    if problems:
        raise SealError(
            f"{stage}: not sealed, its records are not one per sample: \n  {_listed(problems)}\n"
            f"the folder {path.parent} is kept as it is; rerun with --refresh-from {stage} to "
            "write it again"
        )


def _reopen(final: Path, partial: Path) -> None:
    """Turn the complete folder `final` back into the partial one, its files kept."""
    if partial.exists():
        raise RuntimeError(f"cannot reopen {final}: {partial} exists too; remove one of them")
    (final / MANIFEST).unlink()
    os.replace(final, partial)


def _hashed_files(partial: Path, output: StageOutput) -> dict[str, dict[str, Any]]:
    """The manifest's `files`: every file the body wrote (name -> sha256, bytes), sorted."""
    names = [
        str(path.relative_to(partial))
        for path in sorted(partial.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    ]
    return {name: _file_entry(partial / name, output.files.get(name)) for name in names}


def _publish(manifest: Manifest, partial: Path, final: Path) -> None:
    """Seal `manifest` (its checksum), write it into `partial`, and rename that into place."""
    manifest.checksum = manifest.own_checksum()
    with naming_a_full_disk(partial):
        write_json_atomic(partial / MANIFEST, manifest.model_dump())
    replace_folder(partial, final)  # over an incomplete leftover without a manifest, if any
