"""Fingerprints of what a run reads from outside its work dir, by content: dataset and
evaluation-set files, the target's folder, a draft folder to start from.

Every byte a fingerprint claims to cover is hashed (sha256, streamed): a row edited in the
middle of a 270 MiB file changes it. So that a rerun stays fast, each large file's hash is
kept in a small record (`EAGLET_HASH_CACHE`, default `~/.cache/eaglet/file-hashes/`) beside
the file's size, mtime, ctime, inode and device; it is taken only while all five are equal.
An edit changes the ctime even when the mtime is set back (`touch -r`), which no user can
set, so an edited file is always hashed again.

The target's folder is fingerprinted in parts, by what reads them, so a stage is keyed by the
parts it reads and by no other (`TARGET_PARTS`, `eaglet.stages`):

- `weights`: the weights, `config.json`, a model's own code and any file not named below;
- `tokenizer`: the vocabulary and special tokens (`tokenizer_config.json` without its
  `chat_template`);
- `chat_template`: the template (`chat_template.jinja`, or `tokenizer_config.json`'s);
- `generation_config`: `generation_config.json` (the end tokens, the sampling defaults).

Files no stage reads (`README.md` and other documents, licences, pictures, hidden files) and
eaglet work dirs inside the folder are in no part. A hub id is fingerprinted by its id and
revision.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from eaglet.storage import canonical_json

log = logging.getLogger(__name__)

HASH_CACHE_ENV = "EAGLET_HASH_CACHE"
# Files at least this large have their hash recorded; smaller ones are read again (cheaper
# than the record).
RECORDED_BYTES = 8 << 20
PROGRESS_EVERY_S = 30.0  # a line while one large file is hashed
WORK_DIR_MARKER = ".eaglet.lock"  # eaglet.work_dir_lock.LOCK_FILE: every work dir a run used

TARGET_PARTS = ("weights", "tokenizer", "chat_template", "generation_config")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "*.tiktoken",
)  # fmt: skip
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates/*")
GENERATION_FILES = ("generation_config.json",)
# Files of a model folder that no stage reads: documents, licences, pictures.
UNREAD_FILES = (
    "readme*", "*.md", "license*", "licence*", "notice*", "use_policy*", "*.pdf", "*.png",
    "*.jpg", "*.jpeg", "*.gif", "*.svg", "*.webp",
)  # fmt: skip


def hash_cache_dir() -> Path:
    """Where the records of large files' hashes are kept."""
    configured = os.environ.get(HASH_CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eaglet" / "file-hashes"


def _stamp(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


def _hash_stream(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    started = last = time.monotonic()
    done = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(4 << 20):
            digest.update(chunk)
            done += len(chunk)
            now = time.monotonic()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                rate = done / (now - started)
                log.warning(
                    "hashing %s: %.1f of %.1f GiB, %.0f MiB/s, ETA %.0f s (once: the hash is "
                    "recorded for later runs)", path, done / 2**30, size / 2**30, rate / 2**20,
                    (size - done) / max(rate, 1.0),
                )  # fmt: skip
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """The sha256 of every byte of `path`; a large file's from its record when the file's
    size, mtime, ctime, inode and device are those recorded."""
    path = Path(path).resolve()
    stat = path.stat()
    if stat.st_size < RECORDED_BYTES:
        return _hash_stream(path, stat.st_size)
    stamp = _stamp(stat)
    record = hash_cache_dir() / (hashlib.sha256(str(path).encode()).hexdigest()[:40] + ".json")
    try:
        saved = json.loads(record.read_text())
        if saved["path"] == str(path) and saved["stamp"] == stamp:
            return str(saved["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = _hash_stream(path, stat.st_size)
    if _stamp(path.stat()) == stamp:  # not written to while it was read: worth recording
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"path": str(path), "stamp": stamp, "sha256": digest}))
            os.replace(tmp, record)
        except OSError:  # a read-only home: hashed again next time, still right
            pass
    return digest


def file_fingerprint(path: str) -> str:
    """A local dataset or evaluation-set file by content; a hub id by its id."""
    local = Path(path)
    return file_sha256(local) if local.is_file() else f"hub:{path}"


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    lowered = name.lower()
    return any(fnmatch.fnmatch(lowered, p) for p in patterns)


def part_of(name: str) -> str | None:
    """The target part a file of a model folder belongs to (`name` relative to the folder),
    None for a file no stage reads."""
    base = name.rsplit("/", 1)[-1]
    if _matches(base, UNREAD_FILES):
        return None
    if _matches(name, TEMPLATE_FILES):
        return "chat_template"
    if _matches(base, GENERATION_FILES) and "/" not in name:
        return "generation_config"
    if _matches(base, TOKENIZER_FILES):
        return "tokenizer"
    return "weights"


def model_files(folder: Path, work_dir: str | None = None) -> list[str]:
    """The files of a model folder that a stage may read, relative to it, sorted: hidden
    names, unread documents and eaglet work dirs inside it (`work_dir`, or any folder
    holding a work dir's lock file) left out."""
    skip = Path(work_dir).resolve() if work_dir else None
    found = []
    for here, folders, names in os.walk(folder):
        if WORK_DIR_MARKER in names or (skip is not None and Path(here).resolve() == skip):
            folders.clear()  # an eaglet work dir: not the model's
            continue
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        for name in names:
            path = Path(here) / name
            relative = str(path.relative_to(folder))
            if not name.startswith(".") and path.is_file() and part_of(relative) is not None:
                found.append(relative)
    return sorted(found)


def _tokenizer_config_parts(path: Path) -> tuple[str, str | None]:
    """`tokenizer_config.json`'s hash without its chat template, and its template's hash."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return file_sha256(path), None
    if not isinstance(value, dict):
        return file_sha256(path), None
    template = value.pop("chat_template", None)
    rest = hashlib.sha256(canonical_json(value).encode()).hexdigest()
    if template is None:
        return rest, None
    return rest, hashlib.sha256(canonical_json(template).encode()).hexdigest()


def target_parts(
    model: str, revision: str | None = None, work_dir: str | None = None
) -> dict[str, str]:
    """Each part of a target (`TARGET_PARTS`) -> its fingerprint: of a local folder, the
    files of that part by content; of a hub id, its id and revision."""
    folder = Path(model)
    if not folder.is_dir():
        return {part: f"hub:{model}@{revision or 'main'}" for part in TARGET_PARTS}
    digests = {part: hashlib.sha256() for part in TARGET_PARTS}
    for name in model_files(folder, work_dir):
        path = folder / name
        if name == "tokenizer_config.json":
            rest, template = _tokenizer_config_parts(path)
            digests["tokenizer"].update(f"{name}:{rest}\n".encode())
            if template is not None:
                digests["chat_template"].update(f"{name}:{template}\n".encode())
            continue
        part = part_of(name) or "weights"
        digests[part].update(f"{name}:{file_sha256(path)}\n".encode())
    return {part: digest.hexdigest() for part, digest in digests.items()}


def model_fingerprint(model: str, revision: str | None = None, work_dir: str | None = None) -> str:
    """One fingerprint of every part of a model folder (a target, or a draft folder to start
    from); a hub id's id and revision."""
    folder = Path(model)
    if not folder.is_dir():
        return f"hub:{model}@{revision or 'main'}"
    parts = target_parts(model, revision, work_dir)
    return hashlib.sha256(canonical_json(parts).encode()).hexdigest()
