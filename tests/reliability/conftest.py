"""Helpers of the fault matrix: `eaglet run` as a killable process group, the processes it left
behind, the temporary files it left behind, and the final records of a run, read by content.

Every child started here carries a unique `EAGLET_FAULT_RUN` marker in its environment, which
its own children (the temporary Prefect server, workers) inherit: a process still holding the
marker after its run ended is a leftover, whatever its process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from tests.conftest import cli_env

MARKER = "EAGLET_FAULT_RUN"
TEMPORARY_SUFFIXES = (".partial", ".tmp", ".temp")


def start_run(args: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None):
    """`python -m eaglet_prefect.flows.cli ARGS` (`eaglet ARGS`) in its own session (so the
    whole group can be killed), with a fresh marker; stdout and stderr go to `log`. Returns
    (process, marker)."""
    marker = uuid.uuid4().hex
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    full_env = cli_env(cwd, {**threads, **(env or {}), MARKER: marker})
    handle = open(log, "ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "eaglet_prefect.flows.cli", *args],
        cwd=cwd,
        env=full_env,
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    handle.close()
    return process, marker


def marked_processes(marker: str) -> list[int]:
    """Pids of live processes whose environment holds `EAGLET_FAULT_RUN=marker`."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def wait_for_no_marked_processes(marker: str, timeout_s: float = 20.0) -> list[int]:
    """Wait until no process holds `marker`; the pids still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (alive := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def kill_marked(marker: str) -> None:
    """SIGKILL whatever a test's own run left behind (cleanup after the assertion)."""
    for pid in marked_processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process group of a run started by `start_run`, and reap its leader."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def temporary_leftovers(work_dir: Path) -> list[str]:
    """Paths under `work_dir` that only an unfinished write leaves: `.partial` folders and
    temporary files."""
    return sorted(
        str(path.relative_to(work_dir))
        for path in work_dir.rglob("*")
        if path.name.endswith(TEMPORARY_SUFFIXES) or ".tmp" in path.suffixes
    )


def final_stage_folders(work_dir: Path) -> dict[str, Path]:
    """stage -> the folder the last run of `work_dir` used (from `run.json`)."""
    run = json.loads((work_dir / "run.json").read_text())
    return {stage: Path(entry["path"]) for stage, entry in run["stages"].items() if "path" in entry}


def records_by_id(path: Path) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The records of a JSONL file keyed by `sample_id` (or by the whole line when it has
    none), and the ids seen more than once."""
    records: dict[str, dict[str, Any]] = {}
    duplicates = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        key = record.get("sample_id") if isinstance(record, dict) else None
        key = key if key is not None else json.dumps(record, sort_keys=True)
        if key in records:
            duplicates.append(key)
        records[key] = record
    return records, duplicates
