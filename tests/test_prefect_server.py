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

        yield client, _wait_for(deployment_id, 60, "the served deployment"), api
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
    client, deployment_id, _ = served
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
    client, deployment_id, _ = served
    config = _config(tmp_path, fixture_model_dir, sample_data_dir, "generation.max_tokens=8")
    run, tasks = _run(client, deployment_id, {"config": config, "until": "extract"})
    assert run["state"]["type"] == "FAILED"
    failed = tasks["extract[api]"]["state"]
    assert failed["type"] == "FAILED"
    assert "quality gate failed" in failed["message"]
    assert "hit max_tokens" in failed["message"]
    assert tasks["generate[api]"]["state"]["type"] == "COMPLETED"


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]  # fmt: skip


def _property(page, label: str):
    """The form block of one parameter, found by its label text."""
    name = page.locator("span.schema-form-property__label", has_text=label)
    return page.locator("label", has=name).last.locator(
        "xpath=ancestor::div[contains(@class,'schema-form-property')][1]"
    )


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian chromium is not installed")
def test_run_with_changed_parameters_from_the_ui_form(
    served, tmp_path, fixture_model_dir, sample_data_dir
):
    """Headless Chromium opens the Prefect UI, starts a custom run of the deployment with a
    config file given in the `config_path` field, and sees it complete. Screenshots go to
    tests/artifacts/."""
    import yaml
    from playwright.sync_api import sync_playwright

    client, deployment_id, api = served
    base = api.removesuffix("/api")
    config_file = tmp_path / "ui-run.yaml"
    config_file.write_text(yaml.safe_dump(_config(tmp_path, fixture_model_dir, sample_data_dir)))
    artifacts = ROOT / "tests" / "artifacts"
    artifacts.mkdir(exist_ok=True)

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
        )
        page = context.new_page()
        # A loaded CI box renders the UI slowly: wait for elements, never for a fixed time.
        page.set_default_timeout(120_000)
        # Only the local server: the UI would otherwise call an analytics host.
        page.route(
            "**/*",
            lambda route: (
                route.continue_() if route.request.url.startswith(base) else route.abort()
            ),
        )
        page.goto(f"{base}/deployments")
        page.get_by_role("link", name="pipeline").first.click()
        page.wait_for_load_state("networkidle")
        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_text("Custom run").first.click()
        page.get_by_role("heading", name="Parameters").wait_for()

        config_path = _property(page, "config_path (Optional)")
        config_path.get_by_role("button", name="str").click()
        config_path.locator("textarea, input").first.fill(str(config_file))
        page.screenshot(path=str(artifacts / "prefect-ui-custom-run.png"), full_page=True)
        config_path.locator("textarea, input").first.press("Tab")
        page.get_by_role("button", name="Submit").click()
        page.wait_for_timeout(3000)
        page.screenshot(path=str(artifacts / "prefect-ui-submitted.png"), full_page=False)

        def submitted():
            runs = client.post(
                "/flow_runs/filter",
                json={"deployments": {"id": {"any_": [deployment_id]}}},
            ).json()
            return next(
                (r for r in runs if r["parameters"].get("config_path") == str(config_file)),
                None,
            )

        run = _wait_for(submitted, 60, "the run submitted from the UI")

        def completed():
            state = client.get(f"/flow_runs/{run['id']}").json()["state"]["type"]
            return state if state in ("COMPLETED", "FAILED", "CRASHED") else None

        _wait_for(completed, 600, "the UI-started run to finish")
        # Read the state from the run's own page, after its name shows (the URL changes
        # before the page does, and another run's badge must not pass for this one).
        page.goto(f"{base}/runs/flow-run/{run['id']}")
        page.get_by_text(run["name"]).first.wait_for()
        page.locator(".state-badge", has_text="Completed").first.wait_for(timeout=60_000)
        page.screenshot(path=str(artifacts / "prefect-ui-run-completed.png"), full_page=True)
        context.close()

    final = client.get(f"/flow_runs/{run['id']}").json()
    assert final["state"]["type"] == "COMPLETED"
    tasks = client.post(
        "/task_runs/filter", json={"flow_runs": {"id": {"any_": [run["id"]]}}}
    ).json()
    stages = ("download", "tokenize", "generate", "extract", "hidden_states", "train", "evaluate")
    assert {t["name"] for t in tasks} == {f"{stage}[api]" for stage in stages}
