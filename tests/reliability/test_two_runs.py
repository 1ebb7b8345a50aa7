"""Two runs on one work dir: the second is refused at once, naming the first, at every stage of
the first; the first finishes untouched (each record once), and a rerun finds every stage
Cached. A flow run started directly (the Prefect UI's path, no `eaglet run` around it) is
refused the same way before it writes anything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eaglet.stages import STAGES
from eaglet.work_dir_lock import LOCK_FILE
from eaglet_prefect.flows.cli import WORK_DIR_LOCKED_EXIT
from tests.conftest import cli_env, run_cli
from tests.reliability.conftest import (
    kill_group,
    kill_marked,
    records_by_id,
    start_run,
    temporary_leftovers,
    wait_for_no_marked_processes,
)
from tests.reliability.run_helpers import disk_signature, run_args
from tests.work_dir_lock_helpers import hold_in_another_process

# serial: the second runs race a first run of about 16 s, one per stage; on a loaded machine the
# first ended before the race reached its last stages (CI, 3 workers, 2026-12-05); each race
# now pauses the first (SIGSTOP) while the second starts
pytestmark = [pytest.mark.slow, pytest.mark.serial]

POLL_S = 0.005
RUN_TIMEOUT_S = 900
REFUSED_WITHIN_S = 60  # a Python start-up and a config load on a loaded machine


def second_run(args: list[str], folder: Path) -> tuple[int, str, float]:
    started = time.monotonic()
    result = run_cli(args, cwd=folder, timeout=REFUSED_WITHIN_S * 2)
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


def test_a_second_run_is_refused_at_every_stage_of_the_first(
    tmp_path, fixture_model_dir, sample_data_dir
):
    args = run_args(tmp_path, fixture_model_dir, sample_data_dir)
    work_dir = tmp_path / "work"
    first, marker = start_run(args, tmp_path, tmp_path / "first.log")
    refusals = []
    try:
        for i, stage in enumerate(STAGES):
            # Wait until the first run touches this stage (or a later one), then race it.
            before = disk_signature(work_dir, list(STAGES[i:]))
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while disk_signature(work_dir, list(STAGES[i:])) == before:
                assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"{stage} did not start"
                time.sleep(POLL_S)
            # Paused in the stage (the whole group: the run and its children), so the race is
            # not lost to a loaded machine: a second run's start-up (seconds on CI) outlasted
            # the first's short last stages (CI, 2026-12-06).
            os.killpg(first.pid, signal.SIGSTOP)
            try:
                if first.poll() is not None:  # it ended before the pause
                    break
                code, output, seconds = second_run(args, tmp_path)
            finally:
                os.killpg(first.pid, signal.SIGCONT)
            refusals.append({"stage": stage, "code": code, "seconds": round(seconds, 1)})
            assert code == WORK_DIR_LOCKED_EXIT, f"during {stage}: exit {code}\n{output[-3000:]}"
            assert f"pid {first.pid}" in output and "in use by another eaglet run" in output, output
            assert "Traceback" not in output, output
            if first.poll() is not None:
                break
        print(json.dumps(refusals))
        assert first.wait(timeout=RUN_TIMEOUT_S) == 0, (tmp_path / "first.log").read_text()[-4000:]
        assert not wait_for_no_marked_processes(marker), "processes outlived a finished run"
    finally:
        if first.poll() is None:
            kill_group(first)
        kill_marked(marker)
    # The second runs were refused during the first's long stages, not only after them.
    assert {"generate", "hidden_states", "train"} <= {r["stage"] for r in refusals}, refusals

    run = json.loads((work_dir / "run.json").read_text())
    generations = Path(run["stages"]["generate"]["path"]) / "generations.jsonl"
    records, duplicates = records_by_id(generations)
    assert not duplicates, duplicates
    examples, duplicates = records_by_id(Path(run["stages"]["extract"]["path"]) / "examples.jsonl")
    assert not duplicates and set(examples) <= set(records)
    assert not temporary_leftovers(work_dir), temporary_leftovers(work_dir)
    assert (work_dir / LOCK_FILE).read_text() == ""  # released: no holder named

    again = run_cli(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    states = {
        s: e["state"] for s, e in json.loads((work_dir / "run.json").read_text())["stages"].items()
    }
    assert set(states.values()) == {"Cached"}, states
    assert "took over" not in again.stdout + again.stderr


FLOW_RUN = textwrap.dedent(
    """
    import sys
    from eaglet.config import load_config
    from eaglet_prefect.flows.pipeline import pipeline
    state = pipeline(config=load_config(None, ["work_dir=" + sys.argv[1]]), return_state=True)
    print("STATE", state.type.value, state.message, flush=True)
    """
)


def test_a_flow_run_on_a_held_work_dir_fails_before_writing(tmp_path):
    """What a second Quick run in the UI does while a run holds its work dir."""
    work_dir = tmp_path / "work"
    holder = hold_in_another_process(work_dir)
    try:
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-c", FLOW_RUN, str(work_dir)],
            cwd=tmp_path,
            env=cli_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
        seconds = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    output = result.stdout + result.stderr
    assert "STATE FAILED" in output, output[-3000:]
    assert f"pid {holder.pid}" in output and "flow run run-a" in output, output[-3000:]
    assert sorted(p.name for p in work_dir.iterdir()) == [LOCK_FILE], list(work_dir.iterdir())
    print(f"refused in {seconds:.1f} s (Python and Prefect start-up included)")
