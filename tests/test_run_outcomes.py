"""What a run's pages say when it does not simply complete, without a server: a refusal's
artifact and state (where to change the setting), a crash's artifact (the stage that was
running and those that had finished, from the run's record), and the notifications' link to
the run's page when the server has no UI URL. Through a real server and browser:
tests/test_prefect_server.py's journey."""

from __future__ import annotations

import json

from eaglet.failure_advice import RunOrigin
from eaglet.preflight import PreflightError
from eaglet_prefect.deployments.notifications import run_link
from eaglet_prefect.flows.crashes import crash_markdown
from eaglet_prefect.flows.refusals import refusal_markdown, refused_state


def test_a_refusal_says_where_the_setting_it_names_was_set():
    refusal = PreflightError("x", ["train.device=cuda: torch sees no CUDA device"])
    from_file = RunOrigin("short form", "/b/cuda.yaml", frozenset({"work_dir"}))
    text = refusal_markdown(refusal, from_file)
    assert text.startswith("# Refused before any stage: train.device=cuda: torch sees no CUDA")
    assert "**What to do:** Change `train.device` in `/b/cuda.yaml` (the base config" in text
    assert "Retry sends the same parameters and is refused again" in text
    state = refused_state(refusal, RunOrigin("full form"))
    assert state.is_failed() and state.message == (
        "refused before any stage: train.device=cuda: torch sees no CUDA device. Change "
        "`train.device` (config → Draft training → Device)"
    )
    unnamed = PreflightError("x", ["the disk is full"])
    assert "Change the setting it names in the file `config_path` names (`/b/cuda.yaml`)" in (
        refusal_markdown(unnamed, from_file)
    )


def test_a_crash_names_the_running_stage_and_every_finished_one_from_the_run_record(tmp_path):
    record = {
        "flow_run": "run-1",
        "running": "train",
        "stages": {  # as run.json keeps them: keys sorted
            stage: {"state": "Cached", "path": f"/w/{stage}/k"}
            for stage in sorted(("download", "tokenize", "generate", "extract", "hidden_states"))
        },
    }
    (tmp_path / "run.json").write_text(json.dumps(record))
    text = crash_markdown("killed", [], tmp_path, "run-1")
    assert text.startswith("# Crashed during train: killed")
    assert "## Kept: 5 finished stages (download, tokenize, generate, extract, hidden_states)" in (
        text
    )
    assert "`train` resumes training from the last checkpoint" in text
    # another run's record (a later run in the work dir): only the task runs say what ran
    other = crash_markdown("killed", ["generate"], tmp_path, "run-2")
    assert (
        other.startswith("# Crashed during generate: killed") and "No stage had finished" in other
    )
    (tmp_path / "run.json").write_text(json.dumps({**record, "running": None}))
    assert crash_markdown("killed", [], tmp_path, "run-1").startswith(
        "# Crashed during the flow, after hidden_states: killed"
    )


def test_the_notifications_link_the_runs_page_without_a_ui_url_on_the_server():
    link = run_link("http://prefect.team:4200")
    assert link == (
        "{{ (flow_run|ui_url) or ('http://prefect.team:4200/runs/flow-run/' ~ flow_run.id) }}"
    )
    assert run_link(None) == "{{ (flow_run|ui_url) or (flow_run.id) }}"
