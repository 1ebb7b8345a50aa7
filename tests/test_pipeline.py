"""The whole pipeline through real Prefect: runs, caching, code-change invalidation, failures."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet.work_dir_status import inspect_work_dir
from tests.conftest import run_cli, small_run_overrides
from tests.pipeline_helpers import copy_project, stage_states

pytestmark = pytest.mark.slow
STAGES = ["download", "tokenize", "generate", "extract", "hidden_states", "train", "evaluate"]


def test_demo_runs_every_stage_then_reruns_fully_cached(tmp_path, fixture_model_dir):
    """The README's first command in a folder that is not the repository, with a relative
    work dir: the demo writes its data and runs every stage. Its model is the suite's fixture
    (the same seed-0 build), laid where the demo keeps it: the build from nothing is CI's
    first `make demo` in a fresh clone (`.ci/run`) and tests/test_fixture.py's, not repeated
    here (it took about half this test's 500 s).

    After `make demo` in the checkout (CI's order), `make test` names that demo's work dir
    (EAGLET_TEST_DEMO_WORK_DIR): the test moves a copy of it here and runs the demo in it,
    which finds the stages CI's first demo ran Cached (a moved work dir is still current) and
    runs any its code changed since, instead of repeating a run of about 250 s."""
    work_dir = tmp_path / "runs" / "demo"
    earlier = os.environ.get("EAGLET_TEST_DEMO_WORK_DIR")
    if earlier and (Path(earlier) / "run.json").is_file():
        shutil.copytree(earlier, work_dir, symlinks=True)
        ran_here = {"Completed", "Cached"}
    else:
        shutil.copytree(fixture_model_dir, work_dir / "models" / "fixture")
        ran_here = {"Completed"}
    demo = ["demo", "--work-dir", "runs/demo"]
    first = run_cli(demo, cwd=tmp_path, env={"EAGLET_TEST_FIXTURE_MODEL": None})
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "building the demo's fixture target model" not in first.stdout + first.stderr
    assert (work_dir / "data").is_dir()  # the demo's data, written by this run or CI's
    states = stage_states(work_dir)
    assert set(states) == set(STAGES) and set(states.values()) <= ran_here, states
    assert "draft model:" in first.stdout and "report:" in first.stdout
    report = inspect_work_dir(work_dir)
    tau, untrained = report["evaluation"]["tau"], report["evaluation"]["untrained_tau"]
    assert tau > untrained + 0.5, (tau, untrained)
    assert 1 < report["evaluation"]["emitted_tau"] <= tau  # no credit past the stop
    segments = report["evaluation"]["segments"]  # the fixture thinks, then answers
    assert {"thinking", "answer"} <= set(segments), segments
    rounds = sum(s["rounds"] for s in segments.values())
    assert sum(s["rounds"] * s["tau"] for s in segments.values()) / rounds == pytest.approx(tau)
    assert "thinking τ" in (work_dir / "run_report.md").read_text()
    draft_dir = Path(report["stages"]["train"]["path"]) / "draft"
    assert (draft_dir / "config.json").exists() and (draft_dir / "model.safetensors").exists()

    second = run_cli(demo, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert stage_states(work_dir) == dict.fromkeys(STAGES, "Cached")

    inspected = run_cli(["inspect", str(work_dir), "--json"], cwd=tmp_path)
    stages = json.loads(inspected.stdout)["stages"]
    assert {s: v["status"] for s, v in stages.items()} == dict.fromkeys(STAGES, "complete")
    download = stages["download"]["counts"]  # 300 rows, identical ones kept once
    assert download["records"] + download["duplicates"] == 300
    assert all(stages[s]["records"] > 0 for s in STAGES)
    training = json.loads(inspected.stdout)["training"]
    assert training["hidden_states_mode"] == "offline" and training["feature_bytes_stored"] > 0
    assert "offline hidden states" in (work_dir / "run_report.md").read_text()

    # one example's loss mask as JSON; a sample the loop guard dropped says so
    examples = Path(stages["extract"]["path"]) / "examples.jsonl"
    first_id = json.loads(examples.read_text().splitlines()[0])["sample_id"]
    shown = run_cli(["inspect", str(work_dir), "--sample", first_id, "--json"], cwd=tmp_path)
    example = json.loads(shown.stdout)
    assert example["found"] and 0 < example["trained_tokens"] < example["tokens"], example
    assert example["spans"][0]["kind"] == "prompt" and example["spans"][-1]["end"] == len(
        json.loads(examples.read_text().splitlines()[0])["input_ids"]
    )
    # whether the fixture loops on a prompt depends on the CPU's sums (the threads the local
    # engine got): where one did, inspect names the loop guard
    looped = report["quality"]["example_ids_by_flag"].get("looped", [])
    assert len(looped) == report["quality"]["looped"], report["quality"]
    for sample_id in looped[:1]:
        dropped = run_cli(["inspect", str(work_dir), "--sample", sample_id], cwd=tmp_path)
        assert dropped.returncode == 2 and "the loop guard stopped its answer" in dropped.stderr


def test_a_comment_in_extraction_code_reruns_extract_only_and_the_plan_says_so(
    tmp_path, fixture_model_dir, sample_data_dir
):
    """Early cutoff: extract runs again (its code changed) and writes the same bytes, so the
    stages after it, keyed by what extract wrote, stay Cached. `--plan` says so beforehand."""
    project = copy_project(tmp_path / "project")
    work_dir = tmp_path / "work"
    overrides = small_run_overrides(work_dir, fixture_model_dir, sample_data_dir)
    args = ["run", "/dev/null", *[item for o in overrides for item in ("--set", o)]]
    first = run_cli(args, cwd=project)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert stage_states(work_dir) == dict.fromkeys(STAGES, "Completed")

    extract = project / "eaglet" / "extract.py"
    extract.write_text(extract.read_text() + "\n# a comment: the code changed, not its output\n")
    plan = run_cli([*args, "--plan"], cwd=project)
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-3000:]
    assert "preflight: ok" in plan.stdout
    stages = [line for line in plan.stdout.splitlines() if line.startswith("  ")]
    lines = {line.split()[0]: line.split(None, 1)[1] for line in stages}
    assert lines == {
        "download": "Cached",
        "tokenize": "Cached",
        "generate": "Cached",
        "extract": "runs: code changed: eaglet.extract",
        "hidden_states": "Cached if extract writes the same files as before",
        "train": "Cached if extract writes the same files as before",
        "evaluate": "Cached if extract writes the same files as before",
    }
    second = run_cli(args, cwd=project)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert stage_states(work_dir) == {**dict.fromkeys(STAGES, "Cached"), "extract": "Completed"}
    extract_folder = Path(inspect_work_dir(work_dir)["stages"]["extract"]["path"])
    why = json.loads((extract_folder / "manifest.json").read_text())["why"]
    assert why == ["code changed: eaglet.extract"]
    assert "code changed: eaglet.extract" in (work_dir / "run_report.md").read_text()


def test_quality_gate_failure_names_samples_and_keeps_generation(
    tmp_path, fixture_model_dir, sample_data_dir
):
    work_dir = tmp_path / "work"
    overrides = small_run_overrides(work_dir, fixture_model_dir, sample_data_dir)
    # Eight tokens cannot hold a reasoning and an answer: every record is truncated.
    args = [
        "run",
        "/dev/null",
        "--until",
        "extract",
        *[item for o in [*overrides, "generation.max_tokens=8"] for item in ("--set", o)],
    ]
    failed = run_cli(args, cwd=tmp_path)
    assert failed.returncode != 0
    assert "quality gate failed" in failed.stdout + failed.stderr
    assert "hit max_tokens" in failed.stdout + failed.stderr
    states = stage_states(work_dir)
    assert states["generate"] == "Completed" and states["extract"] == "Failed"
    assert not list((work_dir / "extract").glob("*/manifest.json")), "no extract folder complete"

    relaxed = run_cli([*args, "--set", "reasoning.max_truncation_rate=1.0"], cwd=tmp_path)
    assert relaxed.returncode == 0, relaxed.stderr[-3000:]
    assert stage_states(work_dir)["generate"] == "Cached"
    assert stage_states(work_dir)["extract"] == "Completed"


FLOW_UNTIL_DOWNLOAD = """
import sys
from eaglet.config import load_config
from eaglet_prefect.flows.pipeline import pipeline
state = pipeline(config=load_config(None, sys.argv[2:]), until="download", return_state=True)
print("FLOW_RUN", state.state_details.flow_run_id, state.type.value, flush=True)
"""


@pytest.mark.slow  # real processes end to end
def test_the_preflight_report_reaches_the_flow_runs_logs(
    tmp_path, fixture_model_dir, sample_data_dir
):
    """A flow run started as the UI starts it (no `eaglet run` around it): every line of the
    preflight's report is in the flow run's logs on the Prefect server, not only on the
    serving process's terminal."""
    import httpx

    from tests.conftest import SharedPrefectServer, cli_env, small_run_overrides

    overrides = small_run_overrides(tmp_path / "work", fixture_model_dir, sample_data_dir)
    result = subprocess.run(
        [sys.executable, "-c", FLOW_UNTIL_DOWNLOAD, "--", *overrides],
        cwd=tmp_path,
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = [line for line in result.stdout.splitlines() if line.startswith("FLOW_RUN ")]
    assert found, result.stdout[-2000:] + result.stderr[-3000:]
    _, flow_run_id, state = found[-1].split()
    assert state == "COMPLETED", result.stderr[-3000:]
    logs = httpx.post(
        f"{SharedPrefectServer.api_url()}/logs/filter",
        json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200},
        timeout=30,
    ).json()
    messages = "\n".join(log["message"] for log in logs)
    assert re.search(r"ok: +work_dir \S+: usable", messages), messages
