"""eaglet/shutdown.py without Prefect: each case is a small Python program run in its own
process (signals go to a main thread, and the watchdog ends a process), signalled for real.

What `eaglet run` builds on: the first SIGINT/SIGTERM raises `Interrupted` (a clean exit with
130/143); a deferred section (the training loop) stops by itself at its next check, and is
interrupted when it does not check within the grace time; a main thread that never returns
is ended by the watchdog, children included; a second signal exits at once, a duplicate
delivery (process, then group) does not; descendants are found in other sessions too; log
records lose their traceback after an interrupt.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eaglet import shutdown
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.serial,  # bounds seconds
]

PRELUDE = """
import logging, os, signal, subprocess, sys, time
from pathlib import Path
from eaglet import shutdown
OUT = Path(sys.argv[1])
def ready():
    (OUT / "ready").write_text(str(os.getpid()))
"""


def start(tmp_path: Path, body: str) -> subprocess.Popen:
    script = tmp_path / "program.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_ready(process: subprocess.Popen, tmp_path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (tmp_path / "ready").exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the program never got ready"
        time.sleep(0.02)


def finish(process: subprocess.Popen, timeout: float = 30) -> tuple[int, str, str, float]:
    started = time.monotonic()
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, out, err, time.monotonic() - started


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_first_signal_raises_interrupted_and_finally_blocks_run(tmp_path, signum, code):
    process = start(
        tmp_path,
        """
        with shutdown.handling():
            shutdown.set_stage("generate")
            try:
                try:
                    ready()
                    time.sleep(60)
                finally:
                    (OUT / "finally").write_text("ran")
            except shutdown.Interrupted as exc:
                print(exc)
                sys.exit(exc.exit_code)
        """,
    )
    wait_ready(process, tmp_path)
    os.kill(process.pid, signum)
    returncode, out, err, seconds = finish(process)
    name = signal.Signals(signum).name
    assert returncode == code, err
    assert out.strip() == (
        f"interrupted by {name} during generate; finished stages are kept; "
        "run the same command again to resume"
    )
    assert (tmp_path / "finally").read_text() == "ran"
    assert "Traceback" not in err
    assert seconds < 5


@pytest.mark.parametrize("finalizer", ["__del__", "weakref callback"])
def test_an_interrupt_inside_a_finalizer_is_not_dropped(tmp_path, finalizer):
    """The signal lands while the garbage collector runs a finalizer (CI saw it in an asyncio
    transport's `__del__`), where Python drops what is raised: the run stops all the same, right
    after the finalizer, instead of carrying on to its next stage."""
    process = start(
        tmp_path,
        f"""
        import weakref
        def finalize(*_):
            os.kill(os.getpid(), signal.SIGTERM)  # the signal comes while it runs
            for _ in range(2000):  # Python code: the handler runs in here
                sum(range(100))
            (OUT / "finalizer-ended").write_text("yes")

        class Transport:
            def __del__(self):
                finalize()

        class Plain:
            pass

        with shutdown.handling():
            shutdown.set_stage("tokenize")
            try:
                ready()
                if {finalizer!r} == "__del__":
                    Transport()  # dropped at once: its finalizer runs here
                else:
                    plain = Plain()
                    ref = weakref.ref(plain, finalize)
                    del plain
                for _ in range(200):  # the next stage's work
                    time.sleep(0.01)
                (OUT / "carried-on").write_text("yes")
            except shutdown.Interrupted as exc:
                print(exc)
                sys.exit(exc.exit_code)
        """,
    )
    returncode, out, err, seconds = finish(process)
    assert returncode == 143, err
    assert "during tokenize" in out
    if finalizer == "__del__":  # not raised inside it: the finalizer ran to its end
        assert (tmp_path / "finalizer-ended").exists()
    assert not (tmp_path / "carried-on").exists()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert seconds < 5


def test_a_deferred_loop_stops_at_its_next_check_after_saving(tmp_path):
    process = start(
        tmp_path,
        """
        with shutdown.handling():
            shutdown.set_stage("train")
            step = 0
            try:
                with shutdown.deferred():
                    while True:
                        time.sleep(0.3)  # one step: never cut by the signal
                        step += 1
                        (OUT / "steps").write_text(str(step))
                        if step == 1:
                            ready()
                        if shutdown.requested():
                            (OUT / "saved").write_text(str(step))
                            shutdown.raise_if_requested()
            except shutdown.Interrupted as exc:
                print(exc)
                sys.exit(exc.exit_code)
        """,
    )
    wait_ready(process, tmp_path)
    os.kill(process.pid, signal.SIGTERM)
    returncode, out, err, seconds = finish(process)
    assert returncode == 143, err
    assert "during train" in out
    # Saved at the step the loop was in when the signal came, after that step finished.
    assert (tmp_path / "saved").read_text() == (tmp_path / "steps").read_text()
    assert int((tmp_path / "saved").read_text()) >= 1
    assert seconds < 3


def test_a_deferred_section_that_never_checks_is_interrupted_after_the_grace_time(tmp_path):
    process = start(
        tmp_path,
        """
        with shutdown.handling(grace_s=1.0):
            try:
                with shutdown.deferred():
                    ready()
                    time.sleep(60)
            except shutdown.Interrupted as exc:
                (OUT / "interrupted").write_text(str(exc))
                sys.exit(exc.exit_code)
        """,
    )
    wait_ready(process, tmp_path)
    sent = time.monotonic()
    os.kill(process.pid, signal.SIGINT)
    returncode, out, err, _ = finish(process)
    seconds = time.monotonic() - sent
    assert returncode == 130, err
    assert (tmp_path / "interrupted").exists()
    assert 0.9 < seconds < 4


def test_the_watchdog_ends_a_stuck_process_and_its_children(tmp_path):
    """A main thread that swallows the interrupt and hangs (a client retrying a dead server):
    the watchdog kills its children, even one in another session, prints the message and
    exits with 143 at the deadline."""
    process = start(
        tmp_path,
        """
        child = subprocess.Popen(["sleep", "300"], start_new_session=True)
        grandchild_parent = subprocess.Popen(
            [sys.executable, "-c", "import subprocess, time; "
             "p = subprocess.Popen(['sleep', '301']); print(p.pid, flush=True); time.sleep(300)"],
            stdout=subprocess.PIPE, text=True,
        )
        grandchild = int(grandchild_parent.stdout.readline())
        (OUT / "children").write_text(f"{child.pid} {grandchild_parent.pid} {grandchild}")
        with shutdown.handling(deadline_s=2.0):
            shutdown.set_stage("hidden_states")
            ready()
            while True:
                try:
                    time.sleep(60)
                except shutdown.Interrupted:
                    pass  # stuck: what the watchdog is for
        """,
    )
    wait_ready(process, tmp_path)
    children = [int(p) for p in (tmp_path / "children").read_text().split()]
    assert all(alive(p) for p in children)
    sent = time.monotonic()
    os.kill(process.pid, signal.SIGTERM)
    returncode, out, err, _ = finish(process)
    seconds = time.monotonic() - sent
    assert returncode == 143, err
    assert 1.8 < seconds < 5
    assert "interrupted by SIGTERM during hidden_states (still stopping after 2 s" in err
    assert "Traceback" not in err
    deadline = time.monotonic() + 5
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in children if alive(p)]


def test_a_second_signal_exits_at_once_a_duplicate_delivery_does_not(tmp_path):
    process = start(
        tmp_path,
        """
        with shutdown.handling(deadline_s=30.0, backstop_s=None):
            ready()
            try:
                time.sleep(60)
            except shutdown.Interrupted:
                (OUT / "first").write_text("")
                while True:  # a slow clean-up
                    time.sleep(0.05)
        """,
    )
    wait_ready(process, tmp_path)
    os.kill(process.pid, signal.SIGINT)
    os.kill(process.pid, signal.SIGINT)  # `timeout`: the child, then its group
    deadline = time.monotonic() + 10
    while not (tmp_path / "first").exists():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.02)
    time.sleep(0.5)
    assert process.poll() is None, "a duplicate delivery ended the clean-up"
    sent = time.monotonic()
    os.kill(process.pid, signal.SIGINT)  # a second Ctrl-C
    returncode, out, err, _ = finish(process)
    assert returncode == 130
    assert time.monotonic() - sent < 2
    assert "(a second signal: stopped at once)" in err


def test_after_an_interrupt_log_records_lose_their_traceback(tmp_path):
    process = start(
        tmp_path,
        """
        logging.basicConfig(level=logging.INFO)
        log = logging.getLogger("engine")
        with shutdown.handling():
            try:
                ready()
                time.sleep(60)
            except shutdown.Interrupted as exc:
                try:
                    raise RuntimeError("inside the clean-up")
                except RuntimeError:
                    log.exception("Engine execution interrupted by base exception")
                sys.exit(exc.exit_code)
        """,
    )
    wait_ready(process, tmp_path)
    os.kill(process.pid, signal.SIGTERM)
    returncode, out, err, _ = finish(process)
    assert returncode == 143
    assert "Engine execution interrupted by base exception" in err
    assert "Traceback" not in err


def test_handlers_come_back_after_the_block_and_nothing_happens_without_a_signal():
    before = signal.getsignal(signal.SIGTERM)
    with shutdown.handling():
        assert signal.getsignal(signal.SIGTERM) is not before
        assert not shutdown.requested()
        assert shutdown.time_left() == float("inf")
        shutdown.raise_if_requested()  # no signal: nothing
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a Prefect flow run does
        shutdown.claim_signals()
        assert signal.getsignal(signal.SIGTERM) is signal.getsignal(signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_descendants_include_children_in_other_sessions_and_their_children():
    outer = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); "
         "time.sleep(60)"],
        start_new_session=True,
    )  # fmt: skip
    try:
        # Only the tree under `outer`: the test session may hold other children (a Prefect
        # server another test started), which may start children of their own meanwhile.
        deadline = time.monotonic() + 30
        while not (inner := shutdown.descendants(pid=outer.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inner, "the child of the child never showed"
        found = shutdown.descendants()
        assert outer.pid in found and set(inner) <= set(found)
        others = shutdown.descendants(exclude={outer.pid})
        assert outer.pid not in others and not set(inner) & set(others)
        signalled = shutdown.stop_descendants(grace_s=2.0, pid=outer.pid)
        assert set(inner) <= set(signalled)
        outer.kill()
        outer.wait()
        assert not [p for p in inner if alive(p)]
    finally:
        if outer.poll() is None:
            outer.kill()
            outer.wait()


def test_messages_and_exit_codes():
    error = shutdown.Interrupted(signal.SIGTERM, "train")
    assert isinstance(error, KeyboardInterrupt)
    assert error.exit_code == 143 and shutdown.exit_code(signal.SIGINT) == 130
    assert str(error) == (
        "interrupted by SIGTERM during train; finished stages are kept; "
        "run the same command again to resume"
    )
