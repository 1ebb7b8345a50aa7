"""`eaglet gc WORK_DIR`: the stage folders nothing uses any more, and their removal.

A folder is kept whenever anything may still use it:

- a key the work dir's current config (`WORK_DIR/config.yaml`, the last run's) computes for any
  stage, as `eaglet run --plan` does: after `--until extract`, that config's hidden_states,
  train and evaluate folders are still its Cached ones; and each such key's `.partial` folder;
- a key the last run recorded (`run.json`), and its `.partial` folder (a failed run resumes it);
- the current draft's train folder (`draft.json`: what serves the target, `eaglet.refresh`);
- what another work dir uses through a symlink into this one: every run names its work dir in
  `.eaglet-linked-work-dirs` of each stage folder of another work dir it reaches through a
  link (`eaglet.run_report.record_links`); that work dir's `run.json` keys are kept, and while
  a run holds it (its lock), nothing in that stage folder is removed.

Only eaglet's own folders are ever listed: a key's folder holding a manifest, a `.partial`
folder, a folder set aside by `--refresh-from` (`.replaced-…`). A user's folder in a stage
folder (`train/my_backup/`) is not eaglet's and is never touched. Nothing is reached through a
symlink: a stage folder or an entry of one that is a symlink is left alone and said. What is
listed is what is removed: `remove` takes the same list and checks each entry again first.
A superseded folder is also what per-sample reuse (`eaglet.reuse`) copies from: removing it
means a later change computes every sample again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from eaglet import work_dir_lock
from eaglet.run_report import CONFIG_FILE, RUN_FILE, linked_users, read_run_record, recorded_keys
from eaglet.stages import PRODUCER, STAGES
from eaglet.storage import MANIFEST, PARTIAL_SUFFIX

KEY = re.compile(r"^[0-9a-f]{20}$")
SET_ASIDE = re.compile(r"^[0-9a-f]{20}\.replaced-(partial-)?\d+$")


class NothingKnownInUse(ValueError):
    """The work dir has no record of what a run uses: gc removes nothing."""


@dataclass(frozen=True)
class Superseded:
    folder: Path
    bytes: int


@dataclass
class Survey:
    """What `survey` found: the folders to remove, and what it left alone and why."""

    superseded: list[Superseded] = field(default_factory=list)
    kept: int = 0  # eaglet's folders something uses
    not_followed: list[str] = field(default_factory=list)  # symlinks, one line each
    held: list[str] = field(default_factory=list)  # stage folders a live run may write
    notes: list[str] = field(default_factory=list)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _run_keys(work_dir: Path) -> dict[str, set[str]] | None:
    """stage -> the keys a work dir's `run.json` names (None without a readable record)."""
    run = read_run_record(work_dir)
    return None if run is None else {stage: {key} for stage, key in recorded_keys(run).items()}


def _plan_keys(work_dir: Path) -> tuple[dict[str, set[str]], str | None]:
    """stage -> the keys the work dir's current config computes (as `--plan` does), and a
    note when there is no such config to read."""
    from eaglet.config import ConfigError, load_config
    from eaglet.stage_reasons import plan_run

    config_file = Path(work_dir) / CONFIG_FILE
    if not config_file.is_file():
        return {}, f"no {CONFIG_FILE}: only the keys {RUN_FILE} names are known to be in use"
    try:  # where the work dir is now, whatever its config says (a work dir moves)
        config = load_config(str(config_file), [f"work_dir={Path(work_dir).resolve()}"])
    except ConfigError as exc:
        raise NothingKnownInUse(
            f"{config_file} cannot be read ({exc}): what its config uses is unknown, so gc "
            "removes nothing; run the pipeline once with a config that loads"
        ) from None
    keys: dict[str, set[str]] = {}
    for plan in plan_run(config):
        if plan.key:
            keys.setdefault(plan.stage, set()).add(plan.key)
    return keys, None


def survey(work_dir: Path) -> Survey:
    """Every stage folder of `work_dir` that nothing uses (see the module's docstring), with
    its size. Raises `NothingKnownInUse` when the work dir records no run."""
    work_dir = Path(work_dir)
    run_keys = _run_keys(work_dir)
    if run_keys is None:
        raise NothingKnownInUse(
            f"{work_dir} has no {RUN_FILE}: no run is recorded, so nothing is known to be in "
            "use; run the pipeline once first"
        )
    plan_keys, note = _plan_keys(work_dir)
    promoted = work_dir / "draft.json"  # eaglet.refresh.PROMOTED_FILE
    if promoted.is_file():
        try:
            key = json.loads(promoted.read_text())["train_key"]
            run_keys.setdefault(PRODUCER["draft"], set()).add(key)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise NothingKnownInUse(
                f"{promoted} cannot be read ({exc}): gc removes nothing"
            ) from None
    found = Survey(notes=[note] if note else [])
    real_work_dir = work_dir.resolve()
    for stage in STAGES:
        root = work_dir / stage
        if root.is_symlink():
            found.not_followed.append(
                f"{stage}/ -> {os.readlink(root)}: a symlink; its folders belong to the work "
                "dir it points into (gc that one)"
            )
            continue
        if not root.is_dir():
            continue
        in_use = run_keys.get(stage, set()) | plan_keys.get(stage, set())
        users = [u for u in linked_users(root) if u.resolve() != real_work_dir]
        live = [u for u in users if work_dir_lock.is_held(u)]
        if live:
            found.held.append(
                f"{stage}/: a run of {live[0]} (linked here) holds its work dir now; nothing "
                "in this stage folder is removed while it runs"
            )
            continue
        for user in users:
            in_use |= (_run_keys(user) or {}).get(stage, set())
        for entry in sorted(root.iterdir()):
            if entry.is_symlink():
                found.not_followed.append(f"{stage}/{entry.name} -> {os.readlink(entry)}")
                continue
            if not entry.is_dir():
                continue
            name = entry.name
            key = name.removesuffix(PARTIAL_SUFFIX)
            ours = (
                (KEY.match(name) and (entry / MANIFEST).is_file())
                or (name.endswith(PARTIAL_SUFFIX) and KEY.match(key))
                or SET_ASIDE.match(name)
            )
            if not ours:
                continue  # not a folder eaglet wrote: never listed
            if key in in_use:
                found.kept += 1
                continue
            found.superseded.append(Superseded(entry, folder_bytes(entry)))
    return found


def remove(folders: list[Superseded], work_dir: Path) -> int:
    """Remove the listed folders (each checked again: a real folder inside `work_dir`);
    returns the bytes freed."""
    real = Path(work_dir).resolve()
    freed = 0
    for item in folders:
        folder = Path(item.folder)
        if folder.is_symlink() or real not in folder.resolve().parents:
            raise RuntimeError(f"{folder} is not a folder of {work_dir} itself: not removed")
        shutil.rmtree(folder)
        freed += item.bytes
    return freed
