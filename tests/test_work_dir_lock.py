"""The work-dir lock against real processes: a second holder is refused by name, a holder
killed with SIGKILL leaves a lock the next run takes over and names."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from eaglet import work_dir_lock
from eaglet.work_dir_lock import WorkDirLocked, acquire, read_holder, release
from tests.work_dir_lock_helpers import hold_in_another_process


def test_a_second_process_is_refused_naming_the_holder(tmp_path):
    holder = hold_in_another_process(tmp_path)
    try:
        with pytest.raises(WorkDirLocked) as refused:
            acquire(tmp_path)
        message = str(refused.value)
        assert f"pid {holder.pid}" in message and "flow run run-a" in message
        assert str(tmp_path) in message
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_killed_holder_is_taken_over_and_named(tmp_path):
    holder = hold_in_another_process(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    previous = acquire(tmp_path)
    try:
        assert previous is not None and previous["pid"] == holder.pid
        assert read_holder(tmp_path)["pid"] == os.getpid()
        assert "took over" in work_dir_lock.took_over_message(tmp_path, previous)
    finally:
        release(tmp_path)


def test_a_released_lock_is_taken_without_a_take_over(tmp_path):
    assert acquire(tmp_path) is None
    release(tmp_path)
    assert read_holder(tmp_path) is None
    assert acquire(tmp_path) is None
    release(tmp_path)


def test_the_same_process_takes_it_again_and_releases_at_the_last(tmp_path):
    acquire(tmp_path)
    acquire(tmp_path, flow_run="abc")  # the CLI took it, then the flow
    assert read_holder(tmp_path)["flow_run"] == "abc"
    release(tmp_path)
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; from eaglet.work_dir_lock import acquire; "
         "acquire(sys.argv[1])", str(tmp_path)], capture_output=True, text=True,
    )  # fmt: skip
    assert probe.returncode != 0 and "in use by another eaglet run" in probe.stderr
    release(tmp_path)
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; from eaglet.work_dir_lock import acquire; "
         "acquire(sys.argv[1])", str(tmp_path)], capture_output=True, text=True,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    assert json.loads((tmp_path / ".eaglet.lock").read_text() or "null")  # the dead probe's name
