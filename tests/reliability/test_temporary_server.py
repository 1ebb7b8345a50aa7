"""kill -9 of `eaglet run` takes the temporary Prefect server it started with it.

Without PREFECT_API_URL, a run starts Prefect's temporary API server (a uvicorn subprocess)
and stops it at exit; a kill -9 skips every exit hook, and the server used to stay alive.
The CLI now starts that server itself with PR_SET_PDEATHSIG (flows/prefect_server.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.reliability.conftest import MARKER, kill_marked, marked_processes
from tests.reliability.conftest import wait_for_no_marked_processes as wait_for_none


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.slow  # real processes end to end
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_kill_9_of_eaglet_run_takes_the_temporary_prefect_server_with_it(
    tmp_path, fixture_model_dir
):
    # A dataset that is a FIFO nobody writes to: the download stage blocks on it, so the run
    # is surely alive, its server up, when it is killed.
    rows = tmp_path / "rows.jsonl"
    os.mkfifo(rows)
    config = tmp_path / "run.yaml"
    config.write_text(
        f"work_dir: {tmp_path / 'work'}\ntarget:\n  model: {fixture_model_dir}\n"
        f"datasets:\n  - source: a\n    path: {rows}\n"
    )
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({MARKER: marker, "PREFECT_HOME": str(tmp_path / "prefect"), "OMP_NUM_THREADS": "1"})
    log = open(tmp_path / "run.log", "wb")
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eaglet_prefect.flows.cli",
            "run",
            str(config),
            "--until",
            "download",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        server = []
        while time.monotonic() < deadline:
            assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            server = [p for p in marked_processes(marker) if "uvicorn" in cmdline(p)]
            if server and (tmp_path / "work" / "run.json").exists():  # the flow is running
                break
            time.sleep(0.5)
        assert server, "the run never started its temporary Prefect server"
        time.sleep(2)  # the download task is now blocked on the FIFO
        os.kill(run.pid, signal.SIGKILL)  # the CLI process alone: no group kill
        run.wait()
        assert wait_for_none(marker, timeout_s=30) == [], "the Prefect server outlived its run"
    finally:
        log.close()
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        kill_marked(marker)


@pytest.mark.slow
@pytest.mark.serial  # it loads every CPU on purpose
def test_dask_workers_use_the_runs_temporary_server_on_a_loaded_machine(
    tmp_path, fixture_model_dir, sample_data_dir
):
    """`execution.task_runner: dask` with the temporary server: the hidden_states shard tasks
    on two Dask worker processes report to the run's one server (none starts its own), with
    a busy loop per CPU beside them; nothing outlives the run."""
    from tests.conftest import small_run_overrides
    from tests.reliability.conftest import kill_group, start_run

    config = tmp_path / "config.yaml"
    config.write_text("name: dask-temporary\n")
    args = ["run", str(config), "--until", "hidden_states"]
    overrides = small_run_overrides(tmp_path / "work", fixture_model_dir, sample_data_dir)
    for override in [*overrides, "execution.task_runner=dask", "execution.dask_workers=2"]:
        args += ["--set", override]
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    env = {"PREFECT_API_URL": None, "PREFECT_HOME": str(tmp_path / "prefect")}
    run, marker = start_run(args, tmp_path, tmp_path / "run.log", env)
    servers_seen: set[int] = set()
    workers_seen = 0
    try:
        deadline = time.monotonic() + 900
        while run.poll() is None and time.monotonic() < deadline:
            lines = {pid: cmdline(pid) for pid in marked_processes(marker)}
            servers_seen |= {p for p, c in lines.items() if "prefect.server.api.server" in c}
            workers_seen = max(workers_seen, sum("multiprocessing" in c for c in lines.values()))
            time.sleep(0.2)
        assert run.wait(timeout=5) == 0, (tmp_path / "run.log").read_text()[-4000:]
        assert wait_for_none(marker, timeout_s=30) == [], "a process outlived the run"
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        if run.poll() is None:
            kill_group(run)
        kill_marked(marker)
    log = (tmp_path / "run.log").read_text()
    assert "Timed out while attempting to connect to ephemeral" not in log
    assert len(servers_seen) == 1, f"{len(servers_seen)} Prefect servers: {servers_seen}"
    assert workers_seen >= 2, "the Dask cluster's worker processes never ran"
