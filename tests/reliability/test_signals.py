"""SIGTERM and SIGINT, to `eaglet run` alone and to its whole process group, inside every
stage (and once during start-up): the run exits within 10 s with 143 or 130 and the one-line
message, no traceback, no process left; the flow run is marked Crashed (or Cancelled) in the
Prefect server, not left Running; and the same command resumes, every stage finished before
Cached. Training interrupted inside its loop saves a checkpoint of the step it reached, and the
rerun resumes from it.

Two chains of runs, each signalling one stage per run (the next run first resumes what the
last signal interrupted), the four kinds of signal spread so every stage gets two kinds and
every kind lands in both chains:

- against a separate, long-running Prefect server (`prefect server start`, the test session's,
  tests/conftest.py): its flow run's state is read through its API after each run;
- with the temporary server (no PREFECT_API_URL): the run starts and stops it; the flow run's
  state is read from the server's database afterwards (PREFECT_HOME/prefect.db).

As in test_kill.py, a watcher sees a stage start by a change under `WORK_DIR/<stage>/`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from eaglet.stages import STAGES
from tests.conftest import SharedPrefectServer, small_run_overrides
from tests.reliability.conftest import (
    kill_group,
    kill_marked,
    start_run,
    temporary_leftovers,
    wait_for_no_marked_processes,
)
from tests.reliability.run_helpers import disk_signature, stage_state

pytestmark = [pytest.mark.slow, pytest.mark.serial]

KINDS = [
    (signal.SIGTERM, "group"),
    (signal.SIGINT, "process"),
    (signal.SIGTERM, "process"),
    (signal.SIGINT, "group"),
]
EXIT_WITHIN_S = 10.0
RUN_TIMEOUT_S = 900
POLL_S = 0.005
# How long into a stage the signal comes (never past the stage's end): the long stages are
# signalled in their middle, the short ones as soon as they start.
INTO_STAGE_S = {"generate": 1.0, "hidden_states": 0.5}
MESSAGE = re.compile(
    r"^interrupted by (SIGTERM|SIGINT) during ([\w ]+?)(?: \(.*\))?; finished stages are kept; "
    r"run the same command again to resume$",
    re.M,
)


def run_args(folder: Path, model_dir: Path, data_dir: Path, name: str) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.yaml"
    config.write_text("name: signals\n")
    args = ["run", str(config)]
    overrides = [
        *small_run_overrides(folder / "work", model_dir, data_dir),
        f"name={name}",  # the flow run's name; no stage key holds it
        "train.epochs=3",  # a training loop long enough to be signalled inside
        "train.log_every=1",
    ]
    for override in overrides:
        args += ["--set", override]
    return args


def send(process, signum: int, target: str) -> None:
    if target == "group":
        os.killpg(process.pid, signum)
    else:
        os.kill(process.pid, signum)


def train_steps_logged(work_dir: Path) -> int:
    return sum(
        len(path.read_text().splitlines())
        for path in (work_dir / "train").glob("*.partial/metrics.jsonl")
    )


def checkpoint_step(work_dir: Path) -> int | None:
    for path in (work_dir / "train").glob("*.partial/state/state.json"):
        return json.loads(path.read_text())["step"]
    return None


def flow_run_state_via_api(api: str, name: str) -> str | None:
    response = httpx.post(
        f"{api}/flow_runs/filter",
        json={
            "flow_runs": {"name": {"like_": f"pipeline[{name}]"}},  # and its method
            "sort": "START_TIME_DESC",
            "limit": 5,
        },
        timeout=30,
    )
    response.raise_for_status()
    runs = response.json()
    return runs[0]["state"]["type"] if runs else None


def flow_run_state_in_database(prefect_home: Path, name: str) -> str | None:
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        row = db.execute(
            "SELECT state_type FROM flow_run WHERE name LIKE ? ORDER BY created DESC LIMIT 1",
            (f"pipeline[{name}]%",),  # `pipeline[<name>] eagle3`: the run trains
        ).fetchone()
    return row[0] if row else None


def run_states(work_dir: Path) -> dict[str, str]:
    try:
        run = json.loads((work_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return {stage: entry["state"] for stage, entry in run["stages"].items()}


def signal_inside(
    stage: str | None, kind: tuple[int, str], folder: Path, args: list[str], env: dict
) -> dict:
    """Start a run, signal it once `stage` starts (None: during start-up, 3 s in), and see how
    it ends: seconds to exit, exit code, the log, processes left."""
    signum, target = kind
    work_dir = folder / "work"
    log = folder / "run.log"
    offset = log.stat().st_size if log.exists() else 0
    watched = STAGES[STAGES.index(stage) :] if stage else []
    before = disk_signature(work_dir, watched)
    process, marker = start_run(args, folder, log, env)
    inside = False
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        if stage is None:
            time.sleep(3.0)
        else:
            while disk_signature(work_dir, watched) == before:
                assert process.poll() is None, (
                    f"the run ended before {stage} started: " + (log.read_text()[-3000:])
                )
                assert time.monotonic() < deadline, f"{stage} did not start"
                time.sleep(POLL_S)
            until = time.monotonic() + INTO_STAGE_S.get(stage, 0.0)
            while stage_state(work_dir, stage)[0] and (
                time.monotonic() < until or (stage == "train" and train_steps_logged(work_dir) == 0)
            ):
                time.sleep(POLL_S)
            inside = stage_state(work_dir, stage)[0]
        assert process.poll() is None, "the run ended before the signal: " + log.read_text()[-3000:]
        sent = time.monotonic()
        send(process, signum, target)
        try:
            code = process.wait(timeout=EXIT_WITHIN_S + 20)
        except Exception:
            code = None
        seconds = time.monotonic() - sent
        leftover = wait_for_no_marked_processes(marker, timeout_s=3.0)
    finally:
        if process.poll() is None:
            kill_group(process)
        kill_marked(marker)
    with open(log, "rb") as handle:
        handle.seek(offset)
        output = handle.read().decode(errors="replace")
    return {
        "stage": stage,
        "signal": signal.Signals(signum).name,
        "target": target,
        "code": code,
        "seconds": round(seconds, 2),
        "inside": inside,
        "leftover": leftover,
        "output": output,
    }


def check_interrupted(result: dict) -> str:
    """The checks every interrupted run passes; the stage its message names."""
    where = f"{result['signal']} to the {result['target']} inside {result['stage']}"
    output = result["output"]
    assert result["seconds"] < EXIT_WITHIN_S, f"{where}: exited after {result['seconds']} s"
    expected = 143 if result["signal"] == "SIGTERM" else 130
    assert result["code"] == expected, f"{where}: exit code {result['code']}\n{output[-3000:]}"
    assert not result["leftover"], f"{where}: processes left: {result['leftover']}"
    messages = MESSAGE.findall(output)
    assert messages, f"{where}: no interrupted message\n{output[-3000:]}"
    assert messages[-1][0] == result["signal"], messages
    assert "Traceback" not in output, f"{where}: a traceback\n{output[-4000:]}"
    return messages[-1][1]


def chain(
    kinds: list[tuple[int, str]],
    folder: Path,
    model_dir: Path,
    data_dir: Path,
    env: dict,
    flow_state,
    start_up: tuple[int, str] | None = None,
) -> list[dict]:
    """Signal each stage in turn (after a start-up signal, when given), checking each run;
    then a last run completes. `flow_state(name)` reads the flow run's state afterwards."""
    work_dir = folder / "work"
    results = []
    finished: list[str] = []  # stages a run has completed so far
    plan = ([(None, start_up)] if start_up else []) + list(zip(STAGES, kinds, strict=True))
    for i, (stage, kind) in enumerate(plan):
        name = f"{folder.name}-{i}"
        result = signal_inside(
            stage, kind, folder, run_args(folder, model_dir, data_dir, name), env
        )
        label = check_interrupted(result)
        result["message_stage"] = label
        # A start-up signal comes before any flow run (and maybe before the database exists).
        result["flow_run"] = flow_state(name) if stage is not None else None
        states = run_states(work_dir) if stage else {}
        result["states"] = states
        results.append({k: v for k, v in result.items() if k != "output"})
        if stage is not None:
            assert result["flow_run"] in ("CRASHED", "CANCELLED"), result
            # Stages finished by earlier runs came back Cached; none is left Running.
            for done in finished:
                assert states.get(done) == "Cached", (done, states)
            crashed = [s for s, state in states.items() if state == "Crashed"]
            assert crashed in ([], [label]), states
            if label in STAGES:
                assert crashed == [label], states
        finished = [s for s, state in states.items() if state in ("Completed", "Cached")]
        if stage == "train" and result["inside"] and label == "train":
            step = checkpoint_step(work_dir)
            assert step is not None and step >= 1, "no checkpoint of the step training reached"
            result["checkpoint_step"] = step
            results[-1]["checkpoint_step"] = step
    print(json.dumps(results, indent=1))

    name = f"{folder.name}-final"
    process, marker = start_run(
        run_args(folder, model_dir, data_dir, name), folder, folder / "run.log", env
    )
    try:
        assert process.wait(timeout=RUN_TIMEOUT_S) == 0, (folder / "run.log").read_text()[-4000:]
        assert not wait_for_no_marked_processes(marker), "processes outlived a finished run"
    finally:
        if process.poll() is None:
            kill_group(process)
        kill_marked(marker)
    states = run_states(work_dir)
    assert set(states) == set(STAGES)
    for done in finished:
        assert states[done] == "Cached", (done, states)
    assert set(states.values()) <= {"Cached", "Completed"}, states
    assert flow_state(name) == "COMPLETED"
    assert not temporary_leftovers(work_dir), temporary_leftovers(work_dir)
    train_step = next((r.get("checkpoint_step") for r in results if r.get("checkpoint_step")), 0)
    if train_step:
        info = json.loads(
            (Path(json.loads((work_dir / "run.json").read_text())["stages"]["train"]["path"])
             / "manifest.json").read_text()
        )["info"]  # fmt: skip
        assert info["resumed_from_step"] >= train_step, info
    return results


def test_signals_inside_every_stage_with_a_long_running_prefect_server(
    tmp_path, fixture_model_dir, sample_data_dir
):
    api = SharedPrefectServer.api_url()  # `prefect server start`, apart from the runs
    folder = tmp_path / "server"
    results = chain(
        KINDS + KINDS[:3],
        folder,
        fixture_model_dir,
        sample_data_dir,
        {"PREFECT_API_URL": api},
        lambda name: flow_run_state_via_api(api, name),
    )
    assert {r["message_stage"] for r in results} <= set(STAGES)
    # The long stages were signalled inside their partial folder.
    assert {"generate", "hidden_states", "train"} <= {r["stage"] for r in results if r["inside"]}


def test_signals_inside_every_stage_with_the_temporary_prefect_server(
    tmp_path, fixture_model_dir, sample_data_dir
):
    folder = tmp_path / "temporary"
    home = tmp_path / "prefect-home"
    rotated = KINDS[2:] + KINDS + KINDS[:1]  # every stage gets the other chain's kind + 2
    results = chain(
        rotated,
        folder,
        fixture_model_dir,
        sample_data_dir,
        {"PREFECT_API_URL": None, "PREFECT_HOME": str(home)},
        lambda name: flow_run_state_in_database(home, name),
        start_up=(signal.SIGINT, "process"),  # while the server starts and Prefect loads
    )
    assert results[0]["message_stage"] in ("start-up", "the preflight")
    assert {"generate", "hidden_states", "train"} <= {r["stage"] for r in results if r["inside"]}
