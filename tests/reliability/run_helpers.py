"""The small test run of the reliability tests that interrupt `eaglet run` (SIGKILL, signals,
two runs on one work dir), and what they watch of it on disk: whether a stage has a `.partial`
or a finished folder, and a signature of the stage folders that changes when a run starts or
resumes one of them."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import small_run_overrides


def write_config(folder: Path, model_dir: Path, data_dir: Path) -> Path:
    """A config file holding the small test pipeline (the overrides go in as --set)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text("name: kill\n")
    return path


def run_args(folder: Path, model_dir: Path, data_dir: Path) -> list[str]:
    """`eaglet run` of the small test pipeline (tests/conftest.py's `small_run_overrides`)
    with its work dir in `folder / "work"`."""
    args = ["run", str(write_config(folder, model_dir, data_dir))]
    for override in small_run_overrides(folder / "work", model_dir, data_dir):
        args += ["--set", override]
    return args


def stage_state(work_dir: Path, stage: str) -> tuple[bool, bool]:
    """(a `.partial` folder of `stage` exists, a finished folder of `stage` exists)."""
    try:
        names = [entry.name for entry in (work_dir / stage).iterdir()]
    except FileNotFoundError:
        return False, False
    partial = any(name.endswith(".partial") for name in names)
    finished = any((work_dir / stage / name / "manifest.json").exists() for name in names)
    return partial, finished


def disk_signature(work_dir: Path, stages: list[str]) -> frozenset:
    """Every path under the folders of `stages`, with inode, mtime and size: it changes when
    a run starts (or resumes) one of these stages."""
    items = []
    for stage in stages:
        for path in (work_dir / stage).rglob("*"):
            try:
                info = path.stat()
            except FileNotFoundError:  # renamed meanwhile
                continue
            items.append((str(path), info.st_ino, info.st_mtime_ns, info.st_size))
    return frozenset(items)
