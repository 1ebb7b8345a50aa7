"""Operating eaglet through a real Prefect server as a team runs one: on PostgreSQL, behind
basic authentication (`PREFECT_SERVER_API_AUTH_STRING`; every client here sends
`PREFECT_API_AUTH_STRING`, the browser logs in), started without `PREFECT_UI_URL`. A served
deployment, runs triggered through the API with custom parameters, task states read back
(Completed, then Cached), a fix to the extraction code that re-runs extraction and what
follows but not generation, the run report artifact, a failing run whose failed task, message
and resume note are visible through the API, and the journey of a UI user in Chromium.

The deployments are served from a temporary copy of the project, so a test can change the
code the served runs hash and import without touching this checkout."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, run_cli
from tests.pipeline_helpers import copy_project as _copy_project
from tests.prefect_server_helpers import STAGES, api_client, team_auth
from tests.prefect_server_helpers import api_run_config as _config
from tests.prefect_server_helpers import finished_run as _finished
from tests.prefect_server_helpers import start_prefect_server as _start_prefect_server
from tests.prefect_server_helpers import start_process as _start
from tests.prefect_server_helpers import stop_process as _stop
from tests.prefect_server_helpers import task_states as _states
from tests.prefect_server_helpers import wait_for as _wait_for
from tests.vllm_server import free_port

pytestmark = pytest.mark.slow


class WebhookReceiver:
    """A local HTTP endpoint that keeps every JSON body POSTed to it: the target of the
    custom-webhook notification block `eaglet serve --notify` is given."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append(json.loads(body or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/eaglet-notices"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def notice_of(self, run_id: str, timeout: float = 60) -> dict:
        """The notification about flow run `run_id` (its page's URL is in the body)."""

        def arrived():
            return next((m for m in self.received if run_id in m.get("body", "")), None)

        return _wait_for(arrived, timeout, f"a notification about flow run {run_id}")

    def save_block(self, api: str, auth: str, name: str) -> str:
        """Save a custom-webhook notification block pointing here; its `<type>/<name>`."""
        from prefect.blocks.notifications import CustomWebhookNotificationBlock

        block = CustomWebhookNotificationBlock(
            name=name,
            url=self.url,
            json_data={"subject": "{{subject}}", "body": "{{body}}"},
            allow_private_urls=True,  # the receiver is on 127.0.0.1
        )
        with _as_client(api, auth):
            block.save(name, overwrite=True)
        return f"custom-webhook/{name}"


def _as_client(api: str, auth: str):
    """Prefect's settings of a client of the team's server (its URL and credentials)."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    return temporary_settings({PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: auth})


SERVED = {"pipeline", "pipeline-short-form", "generate-only", "watch", "refresh"}  # `eaglet serve`


@dataclass
class Served:
    client: httpx.Client
    deployments: dict[str, str]  # name -> id
    api: str
    project: Path  # the copy of the project the deployments run from (their working dir)
    env: dict  # the environment `eaglet serve` runs in
    webhook: WebhookReceiver  # where the notifications of `eaglet serve --notify` arrive
    notify: str  # the notification block `eaglet serve --notify` names
    auth: str  # the server's `user:password` (PREFECT_API_AUTH_STRING of its clients)
    runner: subprocess.Popen | None = None  # `eaglet serve`

    def start_serve(self, log: str = "serve.log") -> None:
        """Start `eaglet serve --notify` and wait for its deployments."""
        self.runner = _start(
            [sys.executable, "-m", "eaglet_prefect.flows.cli", "serve", "--notify", self.notify],
            {**self.env, "PYTHONPATH": str(self.project)},
            Path(self.env["PREFECT_HOME"]) / log,
            cwd=self.project,
        )

        def deployments():
            found = self.client.post("/deployments/filter", json={}).json()
            ready = {d["name"]: d["id"] for d in found if not d["paused"]}
            return ready if SERVED <= ready.keys() else None

        self.deployments = _wait_for(deployments, 120, "the served deployments")

    def stop_serve(self) -> None:
        if self.runner is not None:
            _stop(self.runner)
            self.runner = None


@pytest.fixture(scope="module")
def served(tmp_path_factory, postgres):
    """A team's Prefect server on a free port (its database on PostgreSQL, basic
    authentication on, no PREFECT_UI_URL) and `eaglet serve` registered against it with the
    credentials, run from a temporary copy of the project (first on PYTHONPATH, and the
    working directory)."""
    home = tmp_path_factory.mktemp("prefect-home")
    project = _copy_project(tmp_path_factory.mktemp("project"))
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    auth = team_auth()
    env = {  # a client's environment (the server's adds its database and auth string)
        **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_API_AUTH_STRING": auth,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_UI_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        "PREFECT_API_LOG_RETRYABLE_ERRORS": "true",  # a 503's cause in server.log
    }
    database = postgres.database("served")
    server = _start_prefect_server(port, env, home / "server.log", database, auth)
    client = api_client(api, auth)
    webhook = WebhookReceiver()
    notify = webhook.save_block(api, auth, "eaglet-tests")
    served = Served(client, {}, api, project, env, webhook, notify, auth)
    try:
        served.start_serve()
        yield served
    finally:
        served.stop_serve()
        _stop(server)


def _run(client: httpx.Client, deployment_id: str, parameters: dict) -> tuple[dict, dict]:
    """Trigger a run through the API; return its final flow run and {task name: task run}."""
    response = client.post(
        f"/deployments/{deployment_id}/create_flow_run", json={"parameters": parameters}
    )
    response.raise_for_status()
    return _finished(client, response.json()["id"])


def _artifact(client: httpx.Client, run_id: str, key: str, field: str = "data") -> str:
    """The markdown (or another field) of the artifact `key` that a flow run or one of its
    tasks created."""
    found = client.post(
        "/artifacts/filter",
        json={"artifacts": {"key": {"any_": [key]}, "flow_run_id": {"any_": [run_id]}}},
    ).json()
    assert len(found) == 1, f"{len(found)} artifacts {key!r} in flow run {run_id}"
    return found[0][field]


def test_a_team_server_refuses_clients_without_its_credentials_and_runs_eaglet_run(
    served, postgres, tmp_path, fixture_model_dir, sample_data_dir
):
    """Issue 47: the server runs on PostgreSQL behind basic authentication. A client without
    the credentials, or with wrong ones, is refused (401) by the API, and `eaglet run` and
    `eaglet serve` say so in one line and exit 2 before doing anything; with them, `eaglet
    run` runs against the server. The password reaches no log, artifact or work-dir file."""
    import yaml

    api, password = served.api, served.auth.split(":", 1)[1]
    assert httpx.get(f"{api}/health").status_code == 200  # probes stay open
    for auth in (None, ("eaglet-team", "wrong")):
        refused = httpx.post(f"{api}/flow_runs/filter", json={}, auth=auth)
        assert refused.status_code == 401, (auth, refused.status_code)

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(_config(tmp_path, fixture_model_dir, sample_data_dir,
                                             "name=cli")))  # fmt: skip
    for env in ({"PREFECT_API_AUTH_STRING": None}, {"PREFECT_API_AUTH_STRING": "eaglet-team:no"}):
        env = {**env, "PREFECT_API_URL": api}
        for args in (["run", str(config), "--until", "tokenize"], ["serve"]):
            done = run_cli(args, cwd=tmp_path, env=env, timeout=300)
            assert done.returncode == 2, (args, done.stdout[-2000:], done.stderr[-2000:])
            assert "requires credentials (basic authentication)" in done.stderr, done.stderr
            assert "Set PREFECT_API_AUTH_STRING" in done.stderr and password not in done.stderr
    work = tmp_path / "work"  # nothing ran: at most the work dir's lock file was made
    assert not work.exists() or [p.name for p in work.iterdir()] == [".eaglet.lock"]

    env = {"PREFECT_API_URL": api, "PREFECT_API_AUTH_STRING": served.auth}
    done = run_cli(["run", str(config), "--until", "tokenize"], cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = served.client.post(
        "/flow_runs/filter",
        json={"flow_runs": {"name": {"any_": ["pipeline[cli] until tokenize"]}}},
    ).json()
    assert run["state"]["type"] == "COMPLETED", run["state"]
    # the server keeps it in PostgreSQL (the database the `served` fixture made)
    assert postgres.query(
        "served", f"select state_type from flow_run where id = '{run['id']}'"
    ) == ("COMPLETED")
    logs = served.client.post("/logs/filter", json={"limit": 200}).json()
    assert logs and not [entry for entry in logs if password in entry["message"]]
    found = served.client.post("/artifacts/filter", json={}).json()
    assert found and not [a for a in found if password in json.dumps(a)]
    written = [p for p in (tmp_path / "work").rglob("*") if p.is_file()]
    assert written and not [p for p in written if password.encode() in p.read_bytes()]


def test_api_runs_complete_then_come_back_cached(
    served, tmp_path, fixture_model_dir, sample_data_dir
):
    parameters = {
        "config": _config(tmp_path, fixture_model_dir, sample_data_dir),
        "until": "extract",
    }
    run, tasks = _run(served.client, served.deployments["pipeline"], parameters)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["parameters"]["until"] == "extract"
    assert run["name"] == "pipeline[api] until extract"
    stages = STAGES[:4]
    assert _states(tasks, "api", stages) == dict.fromkeys(stages, "Completed")
    assert "hidden_states[api]" not in tasks

    run, tasks = _run(served.client, served.deployments["pipeline"], parameters)
    assert run["state"]["type"] == "COMPLETED"
    assert _states(tasks, "api", stages) == dict.fromkeys(stages, "Cached")
    report = _artifact(served.client, run["id"], "run-report")
    assert report == (tmp_path / "work" / "run_report.md").read_text()
    assert "| generate | Cached |" in report
    assert "| hidden_states | not requested |" in report


def test_a_second_run_of_a_deployment_waits_for_the_first_then_completes(
    served, tmp_path, fixture_model_dir, sample_data_dir
):
    """Issue 38: a double-clicked run, or a schedule firing during a manual run, failed red
    on the work-dir lock. The deployment runs one at a time: the second waits in
    AwaitingConcurrencySlot, then completes (its stages Cached: the same config)."""
    client, deployment = served.client, served.deployments["pipeline"]
    found = client.get(f"/deployments/{deployment}").json()
    assert found["global_concurrency_limit"]["limit"] == 1, found
    assert found["concurrency_options"]["collision_strategy"] == "ENQUEUE", found
    parameters = {
        "config": _config(tmp_path, fixture_model_dir, sample_data_dir, "name=twice"),
        "until": "tokenize",
    }
    ids = []
    for _ in range(2):
        response = client.post(
            f"/deployments/{deployment}/create_flow_run", json={"parameters": parameters}
        )
        response.raise_for_status()
        ids.append(response.json()["id"])
    seen: set[tuple[str, str]] = set()  # (state, run name)
    waiting = ("AwaitingConcurrencySlot", "pipeline[twice] until tokenize")

    def one_waits_under_its_name():  # named while it waits, not only once it starts
        runs = [client.get(f"/flow_runs/{i}").json() for i in ids]
        seen.update((run["state"]["name"], run["name"]) for run in runs)
        return waiting in seen

    _wait_for(one_waits_under_its_name, 120, "a run AwaitingConcurrencySlot under its name")
    runs = [_finished(client, run_id) for run_id in ids]
    assert [run["state"]["type"] for run, _ in runs] == ["COMPLETED", "COMPLETED"], runs
    stages = STAGES[:2]
    states = sorted(tuple(_states(tasks, "twice", stages).values()) for _, tasks in runs)
    assert states == [("Cached", "Cached"), ("Completed", "Completed")], states


def test_a_preflight_refusal_leads_with_the_problem_and_logs_no_traceback(
    served, tmp_path, fixture_model_dir, sample_data_dir
):
    """Issue 38: a config the preflight refuses read like a crash in the UI (a 40-line
    traceback first, the problem after a wall of `ok:` lines, no artifact). Now: the newest
    eaglet line is the problem, no traceback anywhere in the run's logs, and the `run-refused`
    artifact leads with the problem and says what to change."""
    client = served.client
    parameters = {
        "config": _config(tmp_path, fixture_model_dir, sample_data_dir, "name=refused",
                          "train.device=cuda"),
    }  # fmt: skip
    run, tasks = _run(client, served.deployments["pipeline"], parameters)
    assert run["state"]["type"] == "FAILED" and tasks == {}, (run["state"], list(tasks))
    refused = _artifact(client, run["id"], "run-refused")
    assert refused.startswith("# Refused before any stage: train.device=cuda"), refused
    assert "Retry sends the same parameters" in refused and "Nothing ran" in refused

    def logs():
        found = client.post(
            "/logs/filter",
            json={"logs": {"flow_run_id": {"any_": [run["id"]]}}, "sort": "TIMESTAMP_DESC"},
        ).json()
        messages = [entry["message"] for entry in found]
        return messages if any("refused before any stage" in m for m in messages) else None

    messages = _wait_for(logs, 60, "the refusal in the run's logs")
    assert not [m for m in messages if "Traceback" in m], messages[:3]
    newest_eaglet = next(m for m in messages if not m.startswith("Finished in state"))
    shown = "\n".join(m[:150] for m in messages)
    assert newest_eaglet.startswith("refused before any stage: train.device=cuda"), shown
    notice = served.webhook.notice_of(run["id"])  # the failure notification
    assert notice["subject"] == "eaglet pipeline[refused] eagle3: Failed", notice
    assert notice["body"].startswith("refused before any stage: train.device=cuda"), notice
    # the full form's field, as the state message says it too
    assert "Change `train.device` (config → Draft training → Device)" in notice["body"], notice
    assert run["state"]["message"] == notice["body"].splitlines()[0]

    # A later attempt that completes marks this failure superseded (here called directly: a
    # Retry of this run would be refused again).
    from eaglet_prefect.flows.superseded import mark_failures_superseded

    with _as_client(served.api, served.auth):
        assert mark_failures_superseded(run["id"]) == 1
        assert mark_failures_superseded(run["id"]) == 0  # once
    stale = _artifact(client, run["id"], "run-refused")
    assert stale.startswith("**Superseded**: a later attempt of this run completed"), stale
    assert refused in stale  # what it said is kept below


def _flow_run_process(run_id: str) -> int | None:
    """The pid of the process running flow run `run_id` (the runner gives it the run's id)."""
    wanted = f"PREFECT__FLOW_RUN_ID={run_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except OSError:
            continue
    return None


def test_a_code_fix_to_extraction_reruns_extraction_and_later_stages_not_generation(
    served, tmp_path, fixture_model_dir, sample_data_dir
):
    """The rerun-after-fix story: a whole run, a change to the extraction code of the served
    project, the same run again from the API. The generation is reused (Cached); extraction,
    training and evaluation run again (their code holds eaglet/reasoning.py), and the hidden
    states stay Cached: extract wrote the same examples (early cutoff). The report says why."""
    config = _config(tmp_path, fixture_model_dir, sample_data_dir, "name=fix", "train.lr=0.002")
    parameters = {"config": config}
    run, tasks = _run(served.client, served.deployments["pipeline"], parameters)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["name"] == "pipeline[fix] eagle3"
    assert run["parameters"]["config"]["train"]["lr"] == 0.002
    assert set(tasks) == {f"{stage}[fix]" for stage in STAGES}
    assert _states(tasks, "fix") == dict.fromkeys(STAGES, "Completed")
    # tags by stage, and by device for the stages that load a model (a tag limit can cap them)
    assert set(tasks["train[fix]"]["tags"]) >= {"eaglet-stage:train", "eaglet-device"}
    assert "eaglet-device" not in tasks["download[fix]"]["tags"], tasks["download[fix]"]["tags"]
    report = _artifact(served.client, run["id"], "run-report")
    assert "Run completed" in report and "τ " in report
    # the notification `eaglet serve --notify` set up: the run completed, with its τ, and a link
    notice = served.webhook.notice_of(run["id"])
    assert notice["subject"] == "eaglet pipeline[fix] eagle3: Completed", notice
    figure = r"^eagle3 draft τ \d\.\d{3} \(untrained draft \d\.\d{3}\); 0 of 7 stages Cached\n"
    assert re.match(figure, notice["body"]), notice
    # the server has no PREFECT_UI_URL: the link is the UI of the API `eaglet serve` used
    assert f"{served.api.removesuffix('/api')}/runs/flow-run/{run['id']}" in notice["body"]
    assert notice["body"].startswith(run["state"]["message"])  # the run page says it too

    before = run["flow_version"]
    assert before.startswith("code "), before  # the copy is no git clone: the code hash alone

    reasoning = served.project / "eaglet" / "reasoning.py"
    original = reasoning.read_bytes()
    reasoning.write_bytes(original + b"\n# a fix to the reasoning split\n")
    try:
        run, tasks = _run(served.client, served.deployments["pipeline"], parameters)
    finally:
        reasoning.write_bytes(original)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    # the run, and its deployment, say which code ran: the edited one (serve registered the old)
    assert run["flow_version"].startswith("code ") and run["flow_version"] != before
    deployment = served.client.get(f"/deployments/{served.deployments['pipeline']}").json()
    assert deployment["version"] == run["flow_version"], (deployment["version"], run)
    reused = ("download", "tokenize", "generate", "hidden_states")
    rerun = ("extract", "train", "evaluate")
    states = dict.fromkeys(reused, "Cached") | dict.fromkeys(rerun, "Completed")
    assert _states(tasks, "fix") == states
    report = _artifact(served.client, run["id"], "run-report")
    assert "| generate | Cached |" in report and "| extract | Completed |" in report
    assert "| train | Completed |" in report and "final loss" in report
    assert "- **extract**: code changed: eaglet.reasoning" in report  # why it ran


def test_failing_task_its_message_and_how_to_resume_are_visible_through_the_api(
    served, tmp_path, fixture_model_dir, sample_data_dir
):
    config = _config(tmp_path, fixture_model_dir, sample_data_dir, "generation.max_tokens=8")
    run, tasks = _run(
        served.client, served.deployments["pipeline"], {"config": config, "until": "extract"}
    )
    assert run["state"]["type"] == "FAILED"
    failed = tasks["extract[api]"]["state"]
    assert failed["type"] == "FAILED"
    assert "quality gate failed" in failed["message"]
    assert "hit max_tokens" in failed["message"]
    assert tasks["generate[api]"]["state"]["type"] == "COMPLETED"

    work_dir = (tmp_path / "work").resolve()
    (partial,) = (work_dir / "extract").glob("*.partial")
    assert (partial / "examples.jsonl").is_file()  # the hook leaves partial outputs in place
    # advice in the terms of the full form the run came from: the settings the error names,
    # as Config → section → field, and no Retry (the same parameters fail the same way)
    resume = (
        "**Change** `reasoning.max_truncation_rate` (config → Reasoning split → Max Truncation "
        "Rate), `generation.max_tokens` (config → Generation → Max Tokens), then start a new run"
    )
    note = _artifact(served.client, run["id"], "extract-failure")
    assert "quality gate failed" in note and "hit max_tokens" in note
    assert f"Partial outputs, kept: `{partial}`" in note
    assert resume in note and "rebuilds this partial folder" in note
    assert "Retry would send the same parameters and fail the same way" in note
    assert "eaglet run" not in note  # no shell command on a UI run's page
    report = _artifact(served.client, run["id"], "run-report")
    assert "Run **failed** at `extract`" in report
    assert "| extract | Failed | 0 |" in report and "| generate | Completed |" in report
    assert note in report and resume in report


def test_a_run_cancelled_mid_generation_resumes_without_resending_finished_samples(
    served, tmp_path, fixture_model_dir, sample_data_dir
):
    """Cancel a flow run (what the UI's Cancel button does) while it generates, start the
    same run again: it resumes the partial folder, and the server is sent only the samples
    that were not written before the cancel (after the canary's probe requests)."""
    from eaglet.config import TargetConfig
    from eaglet.records.generations import Generation
    from eaglet.records.io import read_jsonl
    from eaglet.records.prompts import Prompt
    from eaglet.target import load_tokenizer
    from tests.fake_servers import FakeServer, serve

    server = FakeServer(load_tokenizer(TargetConfig(model=str(fixture_model_dir))), delay_s=0.5)
    with serve(server) as url:
        config = _config(
            tmp_path, fixture_model_dir, sample_data_dir, "name=cancel",
            f"datasets=[{{source: arith, path: {sample_data_dir / 'arith.jsonl'}, limit: 40}}]",
            "generation.engine=vllm", f"generation.endpoints=[{url}]",
            "generation.concurrency=2", "generation.canary_requests=2",
        )  # fmt: skip
        parameters = {"config": config, "until": "generate"}
        created = served.client.post(
            f"/deployments/{served.deployments['pipeline']}/create_flow_run",
            json={"parameters": parameters},
        )
        created.raise_for_status()
        run_id = created.json()["id"]
        records = tmp_path / "work" / "generate"

        def some_written() -> bool:
            files = list(records.glob("*.partial/generations.jsonl"))
            return bool(files) and files[0].read_text().count("\n") >= 5

        _wait_for(some_written, 600, "the first generated records")
        served.client.post(
            f"/flow_runs/{run_id}/set_state",
            json={"state": {"type": "CANCELLING"}, "force": True},
        ).raise_for_status()

        def cancelled():
            state = served.client.get(f"/flow_runs/{run_id}").json()["state"]
            return state if state["type"] in ("CANCELLED", "COMPLETED", "FAILED") else None

        assert _wait_for(cancelled, 120, "the cancellation")["type"] == "CANCELLED"
        (partial,) = records.glob("*.partial")
        time.sleep(2)  # requests cut off by the cancel reach the server's log
        finished = {g.sample_id for g in read_jsonl(partial / "generations.jsonl", Generation)}
        assert 5 <= len(finished) < 40
        sent_before = len(server.log)

        run, tasks = _run(served.client, served.deployments["pipeline"], parameters)
        assert run["state"]["type"] == "COMPLETED", run["state"]
        assert tasks["generate[cancel]"]["state"]["name"] == "Completed"
        resumed = [entry["body"]["prompt"] for entry in server.log[sent_before:]]
    final = partial.with_name(partial.name.removesuffix(".partial"))
    prompts = {
        tuple(p.prompt_ids): p.sample_id
        for p in read_jsonl(next((tmp_path / "work" / "tokenize").glob("*/prompts.jsonl")), Prompt)
    }
    sent_ids = [prompts[tuple(ids)] for ids in resumed[2:]]  # after the canary's 2 probes
    assert set(sent_ids).isdisjoint(finished), "a sample finished before the cancel was re-sent"
    assert sorted(sent_ids) == sorted(set(prompts.values()) - finished)
    written = [g.sample_id for g in read_jsonl(final / "generations.jsonl", Generation)]
    assert sorted(written) == sorted(prompts.values()), "every sample exactly once"


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]  # fmt: skip


def _submit_run_form(page) -> dict:
    """Click the run form's Submit and wait for the server's answer to its POST
    …/create_flow_run; the flow run it made. A 503 (the SQLite-backed server's "retry": a
    busy database on a loaded machine, nothing made) is met as a user meets its error
    toast, and as Prefect's own client does: Submit again."""
    for _ in range(3):
        with page.expect_response(
            lambda r: r.request.method == "POST" and "create_flow_run" in r.url
        ) as answer:
            page.get_by_role("button", name="Submit").click()
        if answer.value.status != 503:
            break
        page.wait_for_timeout(2_000)
    assert answer.value.ok, f"the server refused the form's run: {answer.value.status}"
    return answer.value.json()


def _browser(playwright, tmp_path: Path, base: str, auth: str):
    """Headless Chromium (context, page) that reaches only the local server (the UI would
    otherwise call an analytics host) and data: URLs (the plots), logged in to the team's
    server as a person does: its login page, the `user:password` typed, *Login*."""
    context = playwright.chromium.launch_persistent_context(
        str(tmp_path / "chromium-profile"),
        executable_path=str(CHROMIUM),
        headless=True,
        args=CHROMIUM_ARGS,
    )
    page = context.new_page()
    # A loaded CI box renders the UI slowly: wait for elements, never for a fixed time.
    page.set_default_timeout(120_000)
    # Only what leaves the machine is intercepted (and aborted): an intercepted request waits
    # for its Python handler, which the sync API runs only inside a Playwright call, so a
    # request to the server routed here hung while the test polled the API between calls.
    page.route(re.compile(rf"^(?!{re.escape(base)}|data:)"), lambda route: route.abort())
    page.goto(f"{base}/deployments")
    page.wait_for_url(re.compile(r"/login"))  # an authenticated server: the UI asks first
    page.get_by_placeholder("admin:pass").fill(auth)
    page.get_by_role("button", name="Login").click()
    page.wait_for_url(f"{base}/deployments")  # kept in the page's storage from here on
    return context, page


def _property(page, label: str, index: int = -1):
    """The form block of one parameter, found by its label text (`index` among equal ones)."""
    # Anchored: "Max Tokens" must not also find "Canary Max Tokens".
    starts = re.compile(rf"^\s*{re.escape(label)}")
    name = page.locator("span.schema-form-property__label", has_text=starts)
    return (
        page.locator("label", has=name)
        .nth(index)
        .locator("xpath=ancestor::div[contains(@class,'schema-form-property')][1]")
    )


def _open_custom_run(page, base: str, deployment: str) -> None:
    """The deployment's *Run* → *Custom run* form, once its parameters show."""
    page.goto(f"{base}/deployments")
    page.get_by_role("link", name=deployment).first.click()
    page.wait_for_load_state("networkidle")
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Custom run").first.click()
    page.get_by_role("heading", name="Parameters").wait_for()


def _none_choices(page):
    """The "None" buttons Prefect's form puts beside an optional field's type (`int | None`:
    a two-button group), which neither of eaglet's forms has."""
    return page.locator(".p-button-group__button", has_text=re.compile(r"^\s*None\s*$"))


def _demo_files(project: Path, fixture_model_dir: Path, sample_data_dir: Path) -> None:
    """What the config form's defaults point at, relative to the served project: the fixture
    target in runs/demo/models/fixture and a few rows of each sample source and evaluation set
    in runs/demo/data."""
    import pandas as pd

    demo = project / "runs" / "demo"
    shutil.copytree(fixture_model_dir, demo / "models" / "fixture")
    (demo / "data").mkdir(parents=True)
    # the datasets and the evaluation sets the defaults name (a missing one would make the run
    # build the demo's inputs in a demo-setup task first)
    for name, rows in (("arith.jsonl", 8), ("tools.jsonl", 4), ("mt-bench.jsonl", 4),
                       ("gsm8k.jsonl", 4)):  # fmt: skip
        lines = (sample_data_dir / name).read_text().splitlines(keepends=True)
        (demo / "data" / name).write_text("".join(lines[:rows]))
    mixed = pd.read_parquet(sample_data_dir / "mixed.parquet").head(4)
    mixed.to_parquet(demo / "data" / "mixed.parquet", index=False)


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian chromium is not installed")
def test_run_with_changed_nested_config_fields_from_the_ui_form(
    served, tmp_path, fixture_model_dir, sample_data_dir
):
    """Headless Chromium opens the Prefect UI, starts a custom run of the `generate-only`
    deployment from the `config` form with two fields changed (the run name and, nested,
    generation.max_tokens), and sees it complete; the flow run's parameters, its name, the
    task names and the generate stage's manifest all carry the changed values. Screenshots
    go to tests/artifacts/."""
    from playwright.sync_api import sync_playwright

    _demo_files(served.project, fixture_model_dir, sample_data_dir)
    client, deployment_id = served.client, served.deployments["generate-only"]
    base = served.api.removesuffix("/api")
    artifacts = ROOT / "tests" / "artifacts"
    artifacts.mkdir(exist_ok=True)

    with sync_playwright() as playwright:
        context, page = _browser(playwright, tmp_path, base, served.auth)
        _open_custom_run(page, base, "generate-only")

        assert _none_choices(page).count() == 0  # optional fields are plain inputs, blank = None
        # sections titled in words, not by their class names ("TargetConfig (Optional)")
        page.get_by_text("Target model").first.wait_for()
        page.get_by_text("Draft training").first.wait_for()
        assert page.get_by_text(re.compile(r"\b\w+Config\b")).count() == 0
        init_from = _property(page, "Init From (Optional)").locator("textarea, input").first
        assert init_from.input_value() == ""  # None, shown blank
        init_from.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts / "prefect-ui-optional-field.png"), full_page=False)
        name = _property(page, "Name (Optional)", index=0).locator("textarea").first
        assert name.input_value() == "demo"  # the form shows the defaults
        name.fill("ui")
        max_tokens = _property(page, "Max Tokens (Optional)").locator("input").first
        assert max_tokens.input_value() == "256"
        max_tokens.fill("40")
        max_tokens.press("Tab")
        max_tokens.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts / "prefect-ui-custom-run.png"), full_page=False)
        run = _submit_run_form(page)
        assert run["deployment_id"] == deployment_id
        page.get_by_text("scheduled to start").last.wait_for()
        page.screenshot(path=str(artifacts / "prefect-ui-submitted.png"), full_page=False)
        run, tasks = _finished(client, run["id"])
        # Read the state from the run's own page, after its name shows (the URL changes
        # before the page does, and another run's badge must not pass for this one).
        page.goto(f"{base}/runs/flow-run/{run['id']}")
        page.get_by_text(run["name"]).first.wait_for()
        page.locator(".state-badge", has_text="Completed").first.wait_for(timeout=60_000)
        page.screenshot(path=str(artifacts / "prefect-ui-run-completed.png"), full_page=True)
        report = _artifact(client, run["id"], "run-report", field="id")
        page.goto(f"{base}/artifacts/artifact/{report}")
        page.get_by_text("Run report: ui").first.wait_for()
        page.screenshot(path=str(artifacts / "prefect-ui-run-report.png"), full_page=True)
        context.close()

    assert run["state"]["type"] == "COMPLETED", run["state"]
    config = run["parameters"]["config"]
    assert (config["name"], config["generation"]["max_tokens"]) == ("ui", 40)
    assert run["parameters"]["until"] == "generate"
    assert run["name"] == "pipeline[ui] until generate"
    assert set(tasks) == {"download[ui]", "tokenize[ui]", "generate[ui]"}
    work_dir = served.project / "runs" / "demo"
    generate = json.loads((work_dir / "run.json").read_text())["stages"]["generate"]
    manifest = json.loads((Path(generate["path"]) / "manifest.json").read_text())
    assert manifest["config"]["generation"]["max_tokens"] == 40
    assert "| generate | Completed |" in _artifact(client, run["id"], "run-report")


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian chromium is not installed")
def test_the_short_form_runs_the_pipeline_from_a_few_fields(
    served, tmp_path, fixture_model_dir, sample_data_dir
):
    """Headless Chromium opens the `pipeline-short-form` deployment's run form: ten fields,
    none behind a toggle; it fills three (a base config file, epochs, the work dir) and the
    run completes every stage with the base's settings and the two changes. Screenshot in
    tests/artifacts/prefect-ui-short-form.png."""
    import yaml
    from playwright.sync_api import sync_playwright

    base_file = tmp_path / "base.yaml"
    base = _config(tmp_path, fixture_model_dir, sample_data_dir, "name=short")
    base_file.write_text(yaml.safe_dump(base))
    work_dir = tmp_path / "short-work"
    client, deployment_id = served.client, served.deployments["pipeline-short-form"]
    base_url = served.api.removesuffix("/api")
    artifacts = ROOT / "tests" / "artifacts"
    artifacts.mkdir(exist_ok=True)
    labels = [  # Prefect titles a flow's parameters by their names
        "target_model", "datasets", "engine", "endpoints", "served_model", "epochs",
        "work_dir", "until", "refresh_from", "config_path", "plan_only",
    ]  # fmt: skip

    with sync_playwright() as playwright:
        context, page = _browser(playwright, tmp_path, base_url, served.auth)
        _open_custom_run(page, base_url, "pipeline-short-form")
        shown = page.locator("span.schema-form-property__label").all_inner_texts()
        assert [label.split("(")[0].strip() for label in shown] == labels, shown
        assert _none_choices(page).count() == 0  # no type/None choice anywhere
        for label, value in (("config_path", base_file), ("work_dir", work_dir), ("epochs", 2)):
            field = _property(page, label).locator("textarea, input").first
            field.fill(str(value))
            field.press("Tab")
        page.screenshot(path=str(artifacts / "prefect-ui-short-form.png"), full_page=True)
        run = _submit_run_form(page)
        page.get_by_text("scheduled to start").last.wait_for()
        context.close()

    assert run["deployment_id"] == deployment_id
    run, tasks = _finished(client, run["id"])
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["name"] == "pipeline[short] eagle3"  # the draft method of a run that trains
    assert run["parameters"]["epochs"] == 2 and run["parameters"]["work_dir"] == str(work_dir)
    assert _states(tasks, "short") == dict.fromkeys(STAGES, "Completed")
    used = yaml.safe_load((work_dir / "config.yaml").read_text())
    assert used["train"]["epochs"] == 2 and used["work_dir"] == str(work_dir)
    assert used["generation"]["max_tokens"] == base["generation"]["max_tokens"]  # the base's
    record = json.loads((work_dir / "run.json").read_text())
    assert record["config_file"] == str(work_dir / "config.yaml")  # what the run really used


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian chromium is not installed")
def test_a_whole_run_shows_its_plots_and_every_artifact_is_keyed_described_and_current(
    served, tmp_path, fixture_model_dir, sample_data_dir
):
    """All seven stages through the API: every artifact of the run has a key and a
    description, none names a `.partial` folder (gone once a stage finishes) and every path
    it names exists; the loss and acceptance plots are markdown artifacts embedding the PNG
    (no data: URL printed as text, as an image artifact does) that Chromium shows on their
    artifact pages (screenshots in tests/artifacts/)."""
    import base64

    from playwright.sync_api import sync_playwright

    parameters = {"config": _config(tmp_path, fixture_model_dir, sample_data_dir, "name=plots")}
    run, tasks = _run(served.client, served.deployments["pipeline"], parameters)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    found = served.client.post(
        "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run["id"]]}}}
    ).json()
    by_key = {a["key"]: a for a in found}
    for artifact in found:
        where = f"{artifact['type']} artifact {artifact['key']}"
        assert artifact["key"] and artifact["description"], where
        text = json.dumps(artifact["data"]) + (artifact["description"] or "")
        assert ".partial" not in text, f"{where} names a partial folder: {text[:500]}"
        for path in re.findall(r"(/[\w./-]+\.(?:jsonl|json|png|md))\b", text):
            assert Path(path).exists(), f"{where} names {path}, which does not exist"
    plots = ("training-loss", "acceptance-plot")
    for key in plots:
        image = by_key[key]
        assert image["type"] == "markdown", image["type"]
        embedded = re.match(
            r"!\[[^\]]+\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", image["data"]
        )
        assert embedded, image["data"][:200]
        assert base64.b64decode(embedded.group(1))[:4] == b"\x89PNG"

    base = served.api.removesuffix("/api")
    artifacts = ROOT / "tests" / "artifacts"
    artifacts.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        context, page = _browser(playwright, tmp_path, base, served.auth)
        for key in plots:
            page.goto(f"{base}/artifacts/artifact/{by_key[key]['id']}")
            image = page.locator("img[src^='data:image/png']").first
            image.wait_for()
            page.wait_for_function(
                "img => img.complete && img.naturalWidth > 0", arg=image.element_handle()
            )
            assert page.get_by_text("data:image/png").count() == 0  # no raw URL as text
            page.screenshot(path=str(artifacts / f"prefect-ui-{key}.png"), full_page=True)
        context.close()


def _fill_short_form(page, fields: dict) -> None:
    for label, value in fields.items():
        field = _property(page, label).locator("textarea, input").first
        field.fill(str(value))
        field.press("Tab")


def _add_nightly_schedule(page, deployment_url: str) -> str:
    """Adds a 03:00 cron schedule with the deployment page's *Schedule* dialog; returns what
    the UI's toast said. Save is pressed only once the form shows the parsed expression, so
    a slow page cannot save the form's default (every minute) or nothing."""
    page.goto(deployment_url)
    page.get_by_role("button", name="Schedule", exact=True).click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_role("button", name="Cron", exact=True).click()
    dialog.locator("input[type=text]").nth(1).fill("0 3 * * *")  # [0] is the slug
    dialog.get_by_text("At 03:00 AM").first.wait_for()
    dialog.get_by_role("button", name="Save", exact=True).click()
    said = page.get_by_text(
        re.compile(
            r"^\s*(Deployment schedule updated|Failed to update deployment schedule|"
            r"Must provide a schedule.*)\s*$"
        )
    ).first
    said.wait_for()
    return said.inner_text().strip()


def _on_first_screen(page, text: str) -> bool:
    """Whether the first occurrence of `text` on the page is inside its first screen (seen
    without scrolling), the text itself, not the block around it."""
    return page.evaluate(
        """text => {
            const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
            while (walker.nextNode()) {
                const node = walker.currentNode, at = node.data.indexOf(text);
                if (at < 0) continue;
                const range = document.createRange();
                range.setStart(node, at);
                range.setEnd(node, at + text.length);
                const box = range.getBoundingClientRect();
                return box.top >= 0 && box.bottom <= window.innerHeight;
            }
            return false;
        }""",
        text,
    )


def _logs(client: httpx.Client, run_id: str) -> list[str]:
    """The messages of a flow run's logs and its tasks', oldest first."""
    found = client.post(
        "/logs/filter",
        json={"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200},
    ).json()
    return [entry["message"] for entry in found]


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian chromium is not installed")
def test_the_journey_of_a_ui_user(served, tmp_path, fixture_model_dir, sample_data_dir):
    """What a user of the Prefect UI does on a team's server (PostgreSQL, logged in), in
    headless Chromium, in order: triggers a run from the short form and sees its first
    progress lines on the run page, sees it complete and follows its notification's link back
    to it, runs it again and sees it end Cached, inspects a failed run whose artifact, log,
    state and notification agree that Retry would fail the same way, starts two runs at once
    and sees the second wait (AwaitingConcurrencySlot) then complete, sees refused runs'
    pages lead with the problem (no traceback) and their artifacts say where the setting came
    from (the form's field; the YAML file and key `config_path` names), plans a DFlash
    training with the short form's plan switch (Planned), runs it (its report says the
    method changed, not the code), reads a run list where the plan, the Cached rerun and the
    DFlash training differ, kills a run in train (SIGKILL) and reads a crash artifact naming
    train and the five finished stages, and adds a nightly schedule with the deployment
    page's *Schedule* button that is still there after `eaglet serve` restarts. The seconds
    from *Submit* to the first sign of life and to the first progress line, and each step's
    seconds, are printed; screenshots go to tests/artifacts/journey-*.png."""
    import yaml
    from playwright.sync_api import sync_playwright

    journey = _config(tmp_path, fixture_model_dir, sample_data_dir, "name=journey")
    base_file, dflash_file, cuda_file = (tmp_path / f"{n}.yaml" for n in ("base", "dflash", "cuda"))
    base_file.write_text(yaml.safe_dump(journey))
    dflash_file.write_text(
        yaml.safe_dump({**journey, "train": {**journey["train"], "method": "dflash"}})
    )
    cuda_file.write_text(yaml.safe_dump({**journey, "train": {**journey["train"],
                                                              "device": "cuda"}}))  # fmt: skip
    fields = {"config_path": base_file, "work_dir": tmp_path / "journey-work", "epochs": 1}
    client, base = served.client, served.api.removesuffix("/api")
    artifacts = ROOT / "tests" / "artifacts"
    artifacts.mkdir(exist_ok=True)
    started = step_started = time.monotonic()

    def step(name: str) -> None:
        nonlocal step_started
        now = time.monotonic()
        print(f"journey: {name} took {now - step_started:.1f} s ({now - started:.1f} s in all)")
        step_started = now

    def open_artifact(run_id: str, key: str) -> None:
        page.goto(f"{base}/artifacts/artifact/{_artifact(client, run_id, key, field='id')}")

    def short_form_run(parameters: dict) -> str:
        response = client.post(
            f"/deployments/{served.deployments['pipeline-short-form']}/create_flow_run",
            json={"parameters": {k: str(v) if isinstance(v, Path) else v
                                 for k, v in parameters.items()}},
        )  # fmt: skip
        response.raise_for_status()
        return response.json()["id"]

    with sync_playwright() as playwright:
        context, page = _browser(playwright, tmp_path, base, served.auth)
        step("Chromium and the login")
        # 1. trigger from the short form; the run page shows progress lines as they come
        _open_custom_run(page, base, "pipeline-short-form")
        _fill_short_form(page, fields)
        run = _submit_run_form(page)
        submitted_at = time.monotonic()
        page.get_by_text("scheduled to start").last.wait_for()
        page.goto(f"{base}/runs/flow-run/{run['id']}")
        # the first sign of life: the flow's own first line (the short form's settings)
        page.get_by_text("short form over").first.wait_for(timeout=180_000)
        first_sign_s = time.monotonic() - submitted_at
        page.screenshot(path=str(artifacts / "journey-first-sign.png"), full_page=False)
        page.get_by_text("preflight: ok").first.wait_for(timeout=180_000)
        first_line_s = time.monotonic() - submitted_at
        print(
            f"first sign of life on the run page {first_sign_s:.1f} s after Submit, first "
            f"progress line {first_line_s:.1f} s"
        )
        read = page.get_by_text(re.compile(r"read \d+ samples")).first
        read.wait_for(timeout=180_000)
        read.scroll_into_view_if_needed()
        page.screenshot(path=str(artifacts / "journey-progress.png"), full_page=False)
        run, tasks = _finished(client, run["id"])
        assert run["state"]["type"] == "COMPLETED", run["state"]
        assert run["name"] == "pipeline[journey] eagle3", run["name"]
        assert run["state"]["message"].startswith("eagle3 draft τ "), run["state"]
        page.reload()
        page.locator(".state-badge", has_text="Completed").first.wait_for()
        page.screenshot(path=str(artifacts / "journey-completed.png"), full_page=False)
        step("the first run")

        # 1b. its notification names config, method and outcome, and its link opens the run
        notice = served.webhook.notice_of(run["id"])
        assert notice["subject"] == "eaglet pipeline[journey] eagle3: Completed", notice
        assert notice["body"].startswith(run["state"]["message"]), notice
        (link,) = re.findall(r"https?://\S+", notice["body"])
        assert link == f"{base}/runs/flow-run/{run['id']}", notice  # no PREFECT_UI_URL set
        page.goto(link)
        page.get_by_text(run["name"]).first.wait_for()
        page.locator(".state-badge", has_text="Completed").first.wait_for()
        page.screenshot(path=str(artifacts / "journey-notification-link.png"), full_page=False)

        # 2. the same run again: every task Cached, and the run itself ends Cached
        _open_custom_run(page, base, "pipeline-short-form")
        _fill_short_form(page, fields)
        page.screenshot(path=str(artifacts / "journey-again-form.png"), full_page=True)
        again = _submit_run_form(page)
        page.get_by_text("scheduled to start").last.wait_for()
        again, again_tasks = _finished(client, again["id"])
        assert _states(again_tasks, "journey") == dict.fromkeys(STAGES, "Cached")
        assert (again["state"]["type"], again["state"]["name"]) == ("COMPLETED", "Cached")
        assert again["state"]["message"].endswith("; 7 of 7 stages Cached"), again["state"]
        page.goto(f"{base}/runs/flow-run/{again['id']}")
        page.get_by_text("Finished in state Cached").first.wait_for()
        page.locator(".state-badge", has_text="Cached").first.wait_for()
        page.screenshot(path=str(artifacts / "journey-cached.png"), full_page=False)
        step("the Cached rerun")

        # 3. a failed run (nothing listens at its endpoint): its artifact, its log, its state
        # and its notification agree that Retry would fail the same way, and say what to change
        dead = {"config_path": base_file, "work_dir": tmp_path / "dead-work",
                "engine": "vllm", "endpoints": ["http://127.0.0.1:9"]}  # fmt: skip
        failed, _ = _finished(client, short_form_run(dead))
        assert failed["state"]["type"] == "FAILED"
        fails_again = "Retry would send the same parameters and fail the same way"
        headline = failed["state"]["message"]
        assert headline.startswith("generate failed: CanaryError: preflight canary failed:"), (
            headline
        )
        assert "is not reachable" in headline and fails_again in headline, headline
        assert "`endpoints` (a field of this form)" in headline, headline
        note = _artifact(client, failed["id"], "generate-failure")
        assert fails_again in note and "Retry can succeed" not in note, note
        assert "**Change** `endpoints` (a field of this form)" in note, note
        not_retried = "generate failed for a reason a retry cannot mend (CanaryError): not retrying"

        def logged() -> str | None:  # the task's last logs reach the server after its state
            logs = "\n".join(_logs(client, failed["id"]))
            return logs if not_retried in logs and fails_again in logs else None

        logs = _wait_for(logged, 60, "the failure's log lines")
        assert "Retry can succeed" not in logs
        notice = served.webhook.notice_of(failed["id"])
        assert notice["subject"] == "eaglet pipeline[journey] eagle3: Failed", notice
        assert notice["body"].startswith(headline), notice  # eaglet's line, not Prefect's
        assert "Flow run encountered an exception" not in notice["body"], notice
        page.goto(f"{base}/runs/flow-run/{failed['id']}")
        page.locator(".state-badge", has_text="Failed").first.wait_for()
        page.get_by_text("is not reachable").first.wait_for()
        page.get_by_text(fails_again).first.wait_for()  # the advice in the log, in UI terms
        page.screenshot(path=str(artifacts / "journey-failed.png"), full_page=False)
        open_artifact(failed["id"], "generate-failure")
        key_line = page.get_by_text(
            re.compile(r"^Error: CanaryError: preflight canary failed: .*not reachable")
        )
        key_line.first.wait_for()
        # as text that wraps, not a clipped code line
        assert _on_first_screen(page, "is not reachable")
        page.screenshot(path=str(artifacts / "journey-failed-artifact.png"), full_page=False)
        step("the failed run")

        # 3b. two runs at once (a double click): the second waits its turn, then completes
        # a fresh work dir, so the first run takes a while (it generates) and the second waits
        twice = {**fields, "epochs": 1, "until": "generate", "work_dir": tmp_path / "twice-work"}
        first_id, second_id = short_form_run(twice), short_form_run(twice)

        def waiting() -> str | None:  # the runner may pick either up first
            for run_id in (first_id, second_id):
                state = client.get(f"/flow_runs/{run_id}").json()["state"]["name"]
                if state == "AwaitingConcurrencySlot":
                    return run_id
            return None

        waiting_id = _wait_for(waiting, 120, "one of the two runs waiting for the slot")
        page.goto(f"{base}/runs/flow-run/{waiting_id}")
        queued_badge = re.compile(r"Awaiting\s*Concurrency\s*Slot", re.IGNORECASE)
        page.locator(".state-badge", has_text=queued_badge).first.wait_for()
        # what it waits for, in its log (a state Prefect gives no message)
        holder = first_id if waiting_id == second_id else second_id
        page.get_by_text(re.compile(rf"waits for .*\(flow run {holder}\)")).first.wait_for()
        page.screenshot(path=str(artifacts / "journey-queued.png"), full_page=False)
        for run_id in (first_id, second_id):
            queued, _ = _finished(client, run_id)
            assert queued["state"]["type"] == "COMPLETED", queued["state"]
        page.reload()  # it ran after the other, on the same config: every stage reused
        page.locator(".state-badge", has_text="Cached").first.wait_for()
        step("two runs at once")

        # 3c. a refusal before any stage: its page's first screen shows the problem, no
        # traceback; its artifact names the short form's own field
        refused_id = short_form_run({**twice, "target_model": tmp_path / "no-such-model"})
        refused, _ = _finished(client, refused_id)
        assert refused["state"]["type"] == "FAILED", refused["state"]
        assert refused["state"]["message"].startswith("refused before any stage: "), refused
        page.goto(f"{base}/runs/flow-run/{refused_id}")
        page.get_by_text("refused before any stage").first.wait_for()
        page.wait_for_load_state("networkidle")
        assert page.get_by_text("Traceback").count() == 0
        page.screenshot(path=str(artifacts / "journey-refused.png"), full_page=False)
        assert _on_first_screen(page, "problem: target.model: folder")  # not below the ok lines
        report = _artifact(client, refused_id, "run-refused", field="id")
        page.goto(f"{base}/artifacts/artifact/{report}")
        page.get_by_text(re.compile(r"Refused before any stage: .*no-such-model")).first.wait_for()
        page.get_by_text(
            re.compile(r"Change target_model \(a field of this form\)")
        ).first.wait_for()
        page.screenshot(path=str(artifacts / "journey-refused-artifact.png"), full_page=False)
        notice = served.webhook.notice_of(refused_id)
        assert notice["subject"] == "eaglet pipeline[journey] until generate: Failed", notice
        assert notice["body"].startswith(refused["state"]["message"]), notice
        assert "no-such-model" in notice["body"], notice

        # 3d. a refusal of a setting in the YAML file `config_path` names: the file and key
        cuda_id = short_form_run({**fields, "config_path": cuda_file})
        cuda, _ = _finished(client, cuda_id)
        assert cuda["state"]["type"] == "FAILED", cuda["state"]
        refused_md = _artifact(client, cuda_id, "run-refused")
        where = f"`train.device` in `{cuda_file}` (the base config `config_path` names"
        assert f"**What to do:** Change {where}" in refused_md, refused_md
        assert where in cuda["state"]["message"], cuda["state"]
        open_artifact(cuda_id, "run-refused")
        page.get_by_text(f"Change train.device in {cuda_file}").first.wait_for()
        page.screenshot(path=str(artifacts / "journey-refused-yaml.png"), full_page=False)
        step("two refusals")

        # 4. plan a DFlash training with the short form's plan switch: the run ends Planned
        dflash_fields = {**fields, "config_path": dflash_file}
        _open_custom_run(page, base, "pipeline-short-form")
        _fill_short_form(page, dflash_fields)
        plan_switch = _property(page, "plan_only").get_by_role("switch")
        plan_switch.click()
        page.screenshot(path=str(artifacts / "journey-plan-form.png"), full_page=False)
        plan = _submit_run_form(page)
        assert plan["parameters"]["plan_only"] is True, plan["parameters"]
        plan, plan_tasks = _finished(client, plan["id"])
        assert plan_tasks == {} and plan["name"] == "pipeline[journey] dflash (plan)", plan
        assert (plan["state"]["type"], plan["state"]["name"]) == ("COMPLETED", "Planned")
        assert re.match(r"plan: .*train, evaluate would run", plan["state"]["message"]), plan
        page.goto(f"{base}/runs/flow-run/{plan['id']}")
        page.locator(".state-badge", has_text="Planned").first.wait_for()
        page.screenshot(path=str(artifacts / "journey-planned.png"), full_page=False)

        # 4b. the DFlash training: its report says the method changed, not the code
        trained, _ = _finished(client, short_form_run(dflash_fields))
        assert trained["state"]["type"] == "COMPLETED", trained["state"]
        assert trained["name"] == "pipeline[journey] dflash", trained["name"]
        assert trained["state"]["message"].startswith("dflash draft τ "), trained["state"]
        report = _artifact(client, trained["id"], "run-report")
        assert "- **train**: config changed: train.method 'eagle3' -> 'dflash'" in report, report
        assert "code changed" not in report, report
        step("a DFlash plan and its training")

        # 5. the run list tells a plan, a Cached rerun and a DFlash training apart: each
        # one's row (found by its link) shows its name and its own state
        page.goto(f"{base}/runs")
        page.get_by_placeholder("Search by flow run name").last.fill("pipeline[journey]")
        for shown, badge in ((plan, "Planned"), (again, "Cached"), (trained, "Completed")):
            link = page.locator(f"a[href='/runs/flow-run/{shown['id']}']")
            row = page.locator(".flow-run-list-item", has=link)
            row.scroll_into_view_if_needed()
            row.locator(".state-badge", has_text=badge).wait_for()
            assert link.inner_text().strip() == shown["name"]
        page.screenshot(path=str(artifacts / "journey-run-list.png"), full_page=True)

        # 6. a run killed (SIGKILL) in train: Crashed, no task left Running, and the crash
        # artifact names train and the five stages that had finished (Cached here)
        killed_id = short_form_run({**fields, "epochs": 200})  # long enough to kill in train

        def training():
            found = client.post(
                "/task_runs/filter", json={"flow_runs": {"id": {"any_": [killed_id]}}}
            ).json()
            return any(t["name"] == "train[journey]" and t["state"]["type"] == "RUNNING"
                       for t in found)  # fmt: skip

        _wait_for(training, 600, "the train task running")
        process = _wait_for(lambda: _flow_run_process(killed_id), 30, "the run's process")
        os.kill(process, signal.SIGKILL)
        killed, _ = _finished(client, killed_id)
        assert killed["state"]["type"] == "CRASHED", killed["state"]

        def crashed_artifact():
            found = client.post(
                "/artifacts/filter",
                json={"artifacts": {"key": {"any_": ["run-crashed"]},
                                    "flow_run_id": {"any_": [killed_id]}}},
            ).json()  # fmt: skip
            return found[0] if found else None

        crash = _wait_for(crashed_artifact, 60, "the run-crashed artifact")
        text = crash["data"]
        assert text.startswith("# Crashed during train:"), text
        finished = "download, tokenize, generate, extract, hidden_states"
        assert f"## Kept: 5 finished stages ({finished})" in text, text
        assert "resumes training from the last checkpoint" in text, text
        _, tasks = _finished(client, killed_id)
        assert tasks["train[journey]"]["state"]["type"] == "CRASHED", tasks["train[journey]"]
        assert not [t for t in tasks.values() if t["state"]["type"] in ("RUNNING", "PENDING")]
        notice = served.webhook.notice_of(killed_id)
        assert notice["subject"] == "eaglet pipeline[journey] eagle3: Crashed", notice
        page.goto(f"{base}/runs/flow-run/{killed_id}")
        page.locator(".state-badge", has_text="Crashed").first.wait_for()
        page.wait_for_load_state("networkidle")
        assert page.locator(".state-badge", has_text="Running").count() == 0
        page.screenshot(path=str(artifacts / "journey-killed.png"), full_page=False)
        page.goto(f"{base}/artifacts/artifact/{crash['id']}")
        page.get_by_text(f"Kept: 5 finished stages ({finished})").first.wait_for()
        page.screenshot(path=str(artifacts / "journey-crash-artifact.png"), full_page=False)
        step("a run killed in train")

        # 7. a nightly schedule added on the deployment's page
        def cron_schedules() -> list:
            deployment = client.get(f"/deployments/{served.deployments['pipeline']}").json()
            return [(s["schedule"].get("cron"), s["active"]) for s in deployment["schedules"]]

        deployment_page = f"{base}/deployments/deployment/{served.deployments['pipeline']}"
        toast = _add_nightly_schedule(page, deployment_page)
        if toast != "Deployment schedule updated":
            # What a user does when the UI says the save failed (a loaded server's database
            # can refuse a write): save again. The screenshot keeps what the UI said.
            page.screenshot(path=str(artifacts / "journey-schedule-refused.png"))
            print(f"the UI said {toast!r} on the first save; saving again")
            toast = _add_nightly_schedule(page, deployment_page)
        assert toast == "Deployment schedule updated"
        assert _wait_for(cron_schedules, 30, "the schedule saved") == [("0 3 * * *", True)]
        served.stop_serve()
        served.start_serve("serve-restarted.log")
        assert cron_schedules() == [("0 3 * * *", True)]
        page.goto(f"{base}/deployments/deployment/{served.deployments['pipeline']}")
        page.get_by_text("At 03:00 AM").first.wait_for()
        page.wait_for_load_state("networkidle")
        page.screenshot(path=str(artifacts / "journey-schedule.png"), full_page=False)
        step("a nightly schedule and a restart of eaglet serve")
        context.close()


def _runs_of(client: httpx.Client, deployment_id: str) -> list[dict]:
    return client.post(
        "/flow_runs/filter", json={"deployments": {"id": {"any_": [deployment_id]}}}
    ).json()


def test_a_changed_target_fires_the_watch_and_the_refresh_retrains_and_promotes(
    served, tmp_path, fixture_model_dir, drifted_model_dir, sample_data_dir
):
    """Issue 51: a README edit and a byte-for-byte copy of the target fire nothing, and a
    refresh started by hand then measures the draft and stops, retraining nothing; replacing
    the target's folder by a drifted target fires the watch's `eaglet.target.changed`, the
    refresh deployment's trigger starts it, and it trains from the old draft and promotes the
    new one, whose τ on the new target beats the old draft's there."""
    from eaglet.refresh import PROMOTED_FILE

    target, work = tmp_path / "target", tmp_path / "work"
    shutil.copytree(fixture_model_dir, target)
    config = _config(  # a small draft feels the drift by a few %: refresh beyond 1 %; trained
        # past its warmup (24 steps), then as many again from it on the new target's answers
        # (half as many, which passed before, lost by 0.009 τ on a fresh install of 2026-12-07:
        # 1.358 against the old draft's 1.367; as many: 1.429)
        tmp_path, target, sample_data_dir, "name=follow", "train.epochs=8", "train.warmup_steps=2",
        "refresh.max_drop=0.01", "refresh.epochs_fraction=1.0",
        f"evaluate.sets=[{{name: gsm8k, path: {sample_data_dir / 'gsm8k.jsonl'}, limit: 6}}]",
    )  # fmt: skip
    first, _ = _run(served.client, served.deployments["pipeline"], {"config": config})
    assert first["state"]["type"] == "COMPLETED", first["state"]
    promoted = json.loads((work / PROMOTED_FILE).read_text())
    assert promoted["tau"]["gsm8k"] > 1  # the run made its draft the current one

    watch, refresh = served.deployments["watch"], served.deployments["refresh"]
    (target / "README.md").write_text("# the fixture target\n")  # a file no stage reads
    shutil.copytree(target, tmp_path / "copy")
    shutil.rmtree(target)
    (tmp_path / "copy").rename(target)  # the same bytes, every file new
    watched, _ = _run(served.client, watch, {"work_dir": str(work)})
    assert watched["state"]["type"] == "COMPLETED"
    assert not _runs_of(served.client, refresh)  # no event, no refresh
    kept, tasks = _run(served.client, refresh, {"work_dir": str(work)})  # by hand
    assert kept["state"]["type"] == "COMPLETED" and "kept" in kept["state"]["message"], kept
    assert set(tasks) == {"measure-draft"}  # measured; no stage ran
    assert json.loads((work / PROMOTED_FILE).read_text())["train_key"] == promoted["train_key"]

    shutil.rmtree(target)
    shutil.copytree(drifted_model_dir, target)  # the target was fine-tuned
    watched, _ = _run(served.client, watch, {"work_dir": str(work)})
    assert watched["state"]["type"] == "COMPLETED"
    started = _wait_for(
        lambda: [r for r in _runs_of(served.client, refresh) if r["id"] != kept["id"]],
        120, "the refresh its trigger started",
    )  # fmt: skip
    assert started[0]["parameters"]["work_dir"] == str(work)
    run, tasks = _finished(served.client, started[0]["id"])
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["state"]["message"].startswith("promoted the new draft"), run["state"]
    after = json.loads((work / PROMOTED_FILE).read_text())
    assert after["train_key"] != promoted["train_key"]
    report = _artifact(served.client, run["id"], "refresh-report")
    assert "## After training from it" in report and "gsm8k" in report
