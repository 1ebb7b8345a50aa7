"""Operating eaglet through a real Prefect server: a served deployment, runs triggered through
the API with custom parameters, task states read back (Completed, then Cached), and a failing
run whose failed task and message are visible through the API."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, small_run_overrides
from tests.vllm_server import free_port

pytestmark = pytest.mark.slow


def _start(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(process: subprocess.Popen) -> None:
    # Prefect workers and runners ignore SIGTERM in some states: SIGINT first, then SIGKILL.
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise TimeoutError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A Prefect server on a free port and `eaglet serve` registered against it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_UI_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    prefect = str(Path(sys.executable).with_name("prefect"))
    server = _start(
        [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
        home / "server.log",
    )
    runner = None
    try:

        def healthy():
            try:
                return httpx.get(f"{api}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait_for(healthy, 90, "the Prefect server")
        runner = _start([sys.executable, "-m", "eaglet.cli", "serve"], env, home / "serve.log")
        client = httpx.Client(base_url=api, timeout=30)

        def deployment_id():
            response = client.post("/deployments/filter", json={})
            found = {d["name"]: d["id"] for d in response.json()}
            return found.get("pipeline")

        yield client, _wait_for(deployment_id, 60, "the served deployment")
    finally:
        if runner is not None:
            _stop(runner)
        _stop(server)


def _run(client: httpx.Client, deployment_id: str, parameters: dict) -> tuple[dict, dict]:
    """Trigger a run through the API; return its final flow run and {task name: task run}."""
    response = client.post(
        f"/deployments/{deployment_id}/create_flow_run", json={"parameters": parameters}
    )
    response.raise_for_status()
    run_id = response.json()["id"]

    def finished():
        run = client.get(f"/flow_runs/{run_id}").json()
        return run if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED") else None

    run = _wait_for(finished, 600, f"flow run {run_id}")
    task_runs = client.post(
        "/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}}
    ).json()
    return run, {t["name"]: t for t in task_runs}


def _config(tmp_path: Path, fixture_model_dir: Path, sample_data_dir: Path, *extra: str) -> dict:
    from eaglet.config import load_config

    overrides = [*small_run_overrides(tmp_path / "work", fixture_model_dir, sample_data_dir)]
    return load_config(None, [*overrides, "name=api", *extra]).model_dump(mode="json")


def test_api_runs_complete_then_come_back_cached(
    served, tmp_path, fixture_model_dir, sample_data_dir
):
    client, deployment_id = served
    parameters = {
        "config": _config(tmp_path, fixture_model_dir, sample_data_dir),
        "until": "extract",
    }
    run, tasks = _run(client, deployment_id, parameters)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["parameters"]["until"] == "extract"
    names = ["download[api]", "tokenize[api]", "generate[api]", "extract[api]"]
    assert {name: tasks[name]["state"]["name"] for name in names} == dict.fromkeys(
        names, "Completed"
    )
    assert "hidden_states[api]" not in tasks

    run, tasks = _run(client, deployment_id, parameters)
    assert run["state"]["type"] == "COMPLETED"
    assert {name: tasks[name]["state"]["name"] for name in names} == dict.fromkeys(names, "Cached")


def test_failing_task_and_its_message_are_visible_through_the_api(
    served, tmp_path, fixture_model_dir, sample_data_dir
):
    client, deployment_id = served
    config = _config(tmp_path, fixture_model_dir, sample_data_dir, "generation.max_tokens=8")
    run, tasks = _run(client, deployment_id, {"config": config, "until": "extract"})
    assert run["state"]["type"] == "FAILED"
    failed = tasks["extract[api]"]["state"]
    assert failed["type"] == "FAILED"
    assert "quality gate failed" in failed["message"]
    assert "hit max_tokens" in failed["message"]
    assert tasks["generate[api]"]["state"]["type"] == "COMPLETED"
