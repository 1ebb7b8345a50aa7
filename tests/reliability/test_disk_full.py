"""Disk full while `generations.jsonl` and while a hidden-state shard is written.

A size-limited tmpfs is mounted on the stage folder (`WORK_DIR/generate`, then
`WORK_DIR/hidden_states`); mounting needs root (CI runs as root), elsewhere the test is
skipped with the reason. Each time the disk fills: the run fails clearly (the message says
no space is left and names the stage folder), nothing half-written is taken as done (no
manifest), and once space is back (the tmpfs remounted bigger, its files kept) the same
command resumes and completes: every record exactly once, no temporary file left.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli, small_run_overrides
from tests.reliability.conftest import records_by_id, temporary_leftovers

pytestmark = pytest.mark.slow


def mount_tmpfs(folder: Path, size: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")


def remount(folder: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True)


def unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def run_args(tmp_path: Path, name: str, until: str, model: Path, data: Path) -> list[str]:
    """`eaglet run` of a small pipeline named `name` in `tmp_path/work`, up to `until`."""
    config = tmp_path / "config.yaml"
    config.write_text(f"name: {name}\n")
    args = ["run", str(config), "--until", until]
    for override in small_run_overrides(tmp_path / "work", model, data):
        args += ["--set", override]
    return args


def finished(stage_dir: Path) -> list[Path]:
    return [f for f in stage_dir.iterdir() if (f / "manifest.json").exists()]


def output(result) -> str:
    return result.stdout[-4000:] + result.stderr[-4000:]


def test_disk_full_in_generate_and_in_hidden_states_fails_clearly_then_resumes(
    tmp_path, fixture_model_dir, sample_data_dir
):
    work_dir = tmp_path / "work"
    generate_dir, hidden_dir = work_dir / "generate", work_dir / "hidden_states"
    args = run_args(tmp_path, "disk-full", "hidden_states", fixture_model_dir, sample_data_dir)
    mount_tmpfs(generate_dir, "16k")
    try:
        mount_tmpfs(hidden_dir, "256k")
        full_in_generate = run_cli(args, cwd=tmp_path)
        assert full_in_generate.returncode != 0, "generate wrote 16 KiB of records?"
        text = output(full_in_generate)
        assert "No space left on device" in text and str(generate_dir) in text, text
        assert not finished(generate_dir), "a stage that ran out of disk was taken as done"
        [partial] = generate_dir.iterdir()
        kept = partial / "generations.jsonl"
        kept_lines = kept.read_bytes().count(b"\n") if kept.exists() else 0

        remount(generate_dir, "8m")
        full_in_hidden = run_cli(args, cwd=tmp_path)
        assert full_in_hidden.returncode != 0, "hidden states fit in 256 KiB?"
        text = output(full_in_hidden)
        assert "No space left on device" in text and str(hidden_dir) in text, text
        assert not finished(hidden_dir), "a stage that ran out of disk was taken as done"
        [generations] = finished(generate_dir)
        records, duplicates = records_by_id(generations / "generations.jsonl")
        assert not duplicates and len(records) >= kept_lines

        remount(hidden_dir, "64m")
        resumed = run_cli(args, cwd=tmp_path)
        assert resumed.returncode == 0, output(resumed)
        [generations] = finished(generate_dir)
        records, duplicates = records_by_id(generations / "generations.jsonl")
        assert not duplicates
        [tokenize] = finished(work_dir / "tokenize")
        assert records.keys() == records_by_id(tokenize / "prompts.jsonl")[0].keys()
        [examples] = finished(work_dir / "extract")
        [shards] = finished(hidden_dir)
        index, duplicates = records_by_id(shards / "index.jsonl")
        assert not duplicates
        assert index.keys() == records_by_id(examples / "examples.jsonl")[0].keys()
        assert not temporary_leftovers(work_dir), temporary_leftovers(work_dir)
    finally:
        unmount(hidden_dir)
        unmount(generate_dir)


def test_disk_full_in_train_ends_on_the_line_that_names_the_folder(
    tmp_path, fixture_model_dir, sample_data_dir
):
    """Issue 40: a full disk during train ended on a bare `OSError [Errno 28]`, though the stage
    had raised the DiskFullError naming its folder. The last `error:` line is that one."""
    work_dir = tmp_path / "work"
    train_dir = work_dir / "train"
    args = run_args(tmp_path, "disk-full-train", "train", fixture_model_dir, sample_data_dir)
    mount_tmpfs(train_dir, "24k")
    try:
        result = run_cli(args, cwd=tmp_path)
        assert result.returncode != 0, "a draft fit in 24 KiB?"
        [error] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert "No space left on device while writing" in error, output(result)
        assert str(train_dir) in error, error
        # Issue 40: the console showed Prefect's tracebacks before it; the UI keeps them
        assert "Traceback (most recent call last)" not in result.stdout + result.stderr
        assert not finished(train_dir), "a stage that ran out of disk was taken as done"
    finally:
        unmount(train_dir)


def test_a_full_disk_outside_a_stage_folder_names_the_file(tmp_path, capsys):
    """Issue 46: a full disk met writing the run's own records (not a stage's folder) ended on
    a bare `OSError: [Errno 28]`; the last line names the file and what to do."""
    import argparse
    import errno

    from eaglet_prefect.flows.cli import _run_command

    record = tmp_path / "work" / "run.json"

    def handler(args):
        raise OSError(errno.ENOSPC, "No space left on device", str(record))

    assert _run_command(argparse.Namespace(command="run", handler=handler)) == 1
    [error] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "No space left on device while writing" in error and str(record) in error
