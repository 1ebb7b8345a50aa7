"""The work-dir lock held by another process (tests/test_work_dir_lock.py and the reliability
tests of two runs on one work dir)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

HOLD = textwrap.dedent(
    """
    import sys, time
    from eaglet.work_dir_lock import acquire
    acquire(sys.argv[1], flow_run="run-a")
    print("held", flush=True)
    time.sleep(600)
    """
)


def hold_in_another_process(work_dir: Path) -> subprocess.Popen:
    """A Python process that holds the lock of `work_dir` (as flow run "run-a") for ten
    minutes, once it holds it."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(work_dir)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "held"
    return process
